"""A rollback in one process never replays noise (issue 43, item 8).

After `model.load_weights(earlier)` into the same model and optimizer, the
step counter and the optimizer's `iterations` are back where they were, so
a key folded with them only (the old code) drew bit-identical noise in the
next `fit`: two released branches then differ by the noise-free difference
of their gradient sums. An unseeded run folds a fresh nonce per `fit`
into the key. A seeded run is reproducible by design: it replays
(documented in docs/mechanisms/guarantee.md).

The models here have zero inputs, so their gradients are 0 and each update
is the noise alone.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.optimizers import dp_optimizer

DIM, BATCH, STEPS = 64, 8, 3
X = np.zeros((64, DIM), np.float32)
Y = np.zeros((64, DIM), np.float32)


class KernelTrace(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.kernels = []

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(self.model.layers[0].kernel.numpy().copy())


def noise_model(optimizer):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential(
        [keras.Input((DIM,)), keras.layers.Dense(DIM, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def updates(model, fit):
    """The kernel's change at each step of `fit(model, callbacks)`."""
    trace = KernelTrace()
    start = model.layers[0].kernel.numpy().copy()
    fit(model, [trace])
    kernels = [start] + trace.kernels
    return np.stack([b - a for a, b in zip(kernels, kernels[1:])])


def fit_arrays(model, callbacks):
    model.fit(X, Y, batch_size=BATCH, epochs=1, steps_per_epoch=STEPS, callbacks=callbacks,
              verbose=0)


def branches(model, fit, tmp_path):
    """Trains, saves, trains (branch 1), loads the saved weights into the
    same model and optimizer, trains again (branch 2): both branches' updates."""
    fit(model, [])
    steps = model.privacy.steps
    model.save_weights(tmp_path / "earlier.weights.h5")
    first = updates(model, fit)
    model.load_weights(tmp_path / "earlier.weights.h5")
    assert model.privacy.steps == steps
    second = updates(model, fit)
    return first, second


DP_SGD = {
    "DPSGD": lambda seed: tfdp.optimizers.DPSGD(1.0, 1.0, 1.0, seed=seed),
    "DPOptimizer": lambda seed: tfdp.optimizers.DPOptimizer(
        keras.optimizers.Adam(0.1), 1.0, 1.0, seed=seed),
}


def replayed_entries(first, second):
    """How many update entries of each step are equal in both branches.

    Fresh noise can still round to the same float32 update now and then:
    with Adam an entry's update is a bounded function of its noise and
    sits near 0.05, where float32 steps by about 4e-9, so about one run in
    a thousand sees one equal entry among 12,288 by chance (the old test,
    which allowed none, failed once so). A replayed step repeats all 4,096
    of its entries; fewer than 1% of a step's entries equal is never a
    replay and never a chance outcome (expected count 1e-3).
    """
    return np.isclose(first, second, rtol=0, atol=1e-9).reshape(len(first), -1).sum(axis=1)


@pytest.mark.parametrize("name", sorted(DP_SGD))
def test_dp_sgd_after_load_weights_draws_fresh_noise(tmp_path, name):
    first, second = branches(noise_model(DP_SGD[name](None)), fit_arrays, tmp_path)
    assert np.all(np.abs(first) > 0)
    assert np.all(replayed_entries(first, second) < 0.01 * DIM * DIM)


def test_without_the_fit_nonce_the_rollback_replays(tmp_path, monkeypatch):
    """Negative control: the key as the old code built it (no nonce) adds
    the first branch's noise again, bit for bit."""
    monkeypatch.setattr(dp_optimizer.DPOptimizer, "_draw_fit_nonce",
                        lambda self, model, shared=None: None)
    first, second = branches(noise_model(DP_SGD["DPSGD"](None)), fit_arrays, tmp_path)
    np.testing.assert_array_equal(first, second)
    assert np.all(replayed_entries(first, second) == DIM * DIM)


def test_a_seeded_run_replays_after_a_rollback_by_design(tmp_path):
    """What a seed promises: the same noise for the same step count and
    iterations, a rollback included (guarantee page)."""
    first, second = branches(noise_model(DP_SGD["DPSGD"](3)), fit_arrays, tmp_path)
    np.testing.assert_array_equal(first, second)


# -- DP-BandMF with a noise state: the rollback resumes from `.prev` ----------------


def bandmf(seed=None, noise_state=None, bands=4):
    return tfdp.optimizers.DPBandMF(keras.optimizers.SGD(1.0), 1.0, 1.0, bands=bands,
                                    seed=seed, noise_state=noise_state)


def fit_fixed_order(model, callbacks):
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH, drop_remainder=True)
    model.fit(dataset, epochs=1, callbacks=callbacks, verbose=0)


def released_z(coefficients, common, noise, steps):
    """z_t = c_0 w_t + c_1 w_{t-1} + ... for the branch's steps, from the
    common steps' w (`common`) and the branch's updates (`noise`)."""
    w = np.concatenate([common, -noise * BATCH])
    return np.stack([sum(c * w[t - i] for i, c in enumerate(coefficients) if t - i >= 0)
                     for t in steps])


def test_dp_bandmf_after_load_weights_draws_fresh_noise_on_the_released_history(tmp_path):
    state = str(tmp_path / "noise_state.npz")
    model = noise_model(bandmf(noise_state=state))
    common = -updates(model, fit_fixed_order) * BATCH  # w_1 .. w_8 (lr 1, sigma C = 1)
    model.save_weights(tmp_path / "earlier.weights.h5")
    first = updates(model, fit_fixed_order)
    model.save_weights(tmp_path / "branch1.weights.h5")
    model.load_weights(tmp_path / "earlier.weights.h5")
    second = updates(model, fit_fixed_order)  # resumes the history at step 8 (.prev)
    assert model.privacy.steps == 16
    assert np.all(replayed_entries(first, second) < 0.01 * DIM * DIM)
    # The history is the one released: the z_t of the second branch, rebuilt
    # from its w_t and the common steps' w, are N(0, 1) and independent of
    # the first branch's.
    coefficients = model.optimizer.coefficients
    z_first = released_z(coefficients, common, first, range(8, 16))
    z_second = released_z(coefficients, common, second, range(8, 16))
    assert abs(np.std(z_second) - 1.0) < 0.03 and abs(np.std(z_first) - 1.0) < 0.03
    assert abs(np.corrcoef(z_first.ravel(), z_second.ravel())[0, 1]) < 0.03
    # Control: on another history (none) the same w_t do not give N(0, 1).
    wrong = released_z(coefficients, 0 * common, second, range(8, 9))
    assert abs(np.std(wrong) - 1.0) > 0.1
    # A model file of the first branch cannot take the second branch's state.
    branch1 = noise_model(bandmf(noise_state=state))
    branch1.load_weights(tmp_path / "branch1.weights.h5")
    with pytest.raises(ValueError, match="another branch of it: from model step 8 on"):
        fit_fixed_order(branch1, [])
    assert branch1.privacy.steps == 16


def test_dp_bandmf_without_the_fit_nonce_the_rollback_replays(tmp_path, monkeypatch):
    """Negative control: without the nonce the rolled-back branch adds the
    first branch's noise again."""
    monkeypatch.setattr(dp_optimizer.DPOptimizer, "_draw_fit_nonce",
                        lambda self, model, shared=None: None)
    state = str(tmp_path / "noise_state.npz")
    model = noise_model(bandmf(noise_state=state))
    first, second = branches(model, fit_fixed_order, tmp_path)
    np.testing.assert_array_equal(first, second)
