"""DPBandMF through `fit` on a tf.data pipeline: the correlated noise it
adds, DP-SGD's noise with one band, a crafted record's effect, the ledger,
the secret noise stream (never in model files, exact on resume), and the
pipelines and resumes it refuses."""

import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.accounting import bandmf as bandmf_accounting
from tfdp.mechanisms import bandmf
from tfdp.optimizers import bandmf_state

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(n=64, dim=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def pipeline(x, y, batch=8, **shuffle):
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:
        ds = ds.shuffle(len(x), **shuffle)
    return ds.batch(batch, drop_remainder=True)


def classifier(optimizer, dim=6, seed=1):
    keras.utils.set_random_seed(seed)
    model = tfdp.DPSequential([keras.Input((dim,)), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


def bandmf_opt(bands=4, sigma=1.0, seed=0, lr=0.5, **kwargs):
    return tfdp.optimizers.DPBandMF(keras.optimizers.SGD(lr), 1.0, sigma, bands=bands,
                                    seed=seed, **kwargs)


class Recorder(keras.callbacks.Callback):
    """The first layer's kernel after every step."""

    def __init__(self):
        super().__init__()
        self.kernels = []

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(self.model.layers[0].kernel.numpy().copy())


# -- the noise the optimizer adds ----------------------------------------------------


def noise_of_steps(bands, steps_per_epoch=8, epochs=2, units=20000, coefficients=None,
                   jit_compile=False):
    """The noise vectors w_t the optimizer added, read off the updates of a
    kernel whose gradients are 0 (inputs 0), as rows [steps, units]."""
    batch = 2
    x = np.zeros((steps_per_epoch * batch, 1), "float32")
    y = np.zeros((steps_per_epoch * batch, units), "float32")
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((1,)), keras.layers.Dense(
        units, use_bias=False, kernel_initializer="zeros")])
    opt = tfdp.optimizers.DPBandMF(keras.optimizers.SGD(1.0), 1.0, 1.0, bands=bands, seed=5,
                                   coefficients=coefficients)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    recorder = Recorder()
    model.fit(pipeline(x, y, batch), epochs=epochs, verbose=0, callbacks=[recorder])
    kernels = np.stack([np.zeros((1, units))] + recorder.kernels)[:, 0]
    return -np.diff(kernels, axis=0) * batch, opt  # w_t = -(theta_t - theta_{t-1}) B / lr


def expected_covariance(coefficients, n):
    strategy = np.zeros((n, n))
    for lag, value in enumerate(coefficients):
        strategy += value * np.eye(n, k=-lag)
    inverse = np.linalg.inv(strategy)
    return inverse @ inverse.T  # sigma = C_clip = 1


def covariance_gap(noise, coefficients):
    """(gap of the std pooled over steps, relative; largest gap of a
    correlation between two steps, absolute) against the strategy's.

    With 20,000 coordinates the pooled std's standard error is about
    1 / sqrt(2 * 16 * 20,000) = 0.0013 and a correlation's about
    1 / sqrt(20,000) = 0.007: the checks below sit at 4 and 5 of them."""
    expected = expected_covariance(coefficients, noise.shape[0])
    measured = np.cov(noise)
    std_gap = abs(np.sqrt(np.mean(np.diag(measured) / np.diag(expected))) - 1)
    scale = np.sqrt(np.outer(np.diag(expected), np.diag(expected)))
    corr_gap = np.max(np.abs(measured - expected) / scale)
    return std_gap, corr_gap


def test_the_noise_has_the_banded_strategys_covariance_and_uncorrelated_noise_fails():
    noise, opt = noise_of_steps(bands=4)
    std_gap, corr_gap = covariance_gap(noise, opt.coefficients)
    assert std_gap < 0.005 and corr_gap < 0.035, (std_gap, corr_gap)
    compiled, _ = noise_of_steps(bands=4, jit_compile=True)  # the same under XLA
    std_gap, corr_gap = covariance_gap(compiled, opt.coefficients)
    assert std_gap < 0.005 and corr_gap < 0.035, (std_gap, corr_gap)
    # the noise is really correlated: neighbouring steps are far from independent
    assert abs(np.corrcoef(noise[4], noise[5])[0, 1]) > 0.3
    # negative controls: DP-SGD's uncorrelated noise (one band), and a 1% smaller
    # noise, fail the same check
    plain, _ = noise_of_steps(bands=1)
    assert max(covariance_gap(plain, opt.coefficients)) > 0.1
    assert covariance_gap(noise * 0.985, opt.coefficients)[0] > 0.005


def test_one_band_adds_exactly_dp_sgds_noise_for_the_same_draws():
    variables = [tf.Variable(tf.zeros([5, 3])), tf.Variable(tf.zeros([3]))]
    sums = [tf.random.stateless_normal([5, 3], [1, 2]), tf.random.stateless_normal([3], [3, 4])]
    info = {"expected_batch_size": tf.constant(8.0), "mask": tf.ones([8])}
    reference = tfdp.optimizers.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.3, seed=11)
    banded = tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.1), 1.0, 1.3, bands=1, seed=11)
    banded._new_stream(variables, bandmf_state.fixed_order_layout(4, 8), planned=8, now=0)
    for _ in range(3):
        expected = reference.noisy_gradients(sums, info, variables)
        got = banded.noisy_gradients(sums, info, variables)
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(e.numpy(), g.numpy())
        reference.apply_private_gradients(expected, variables)
        banded.apply_private_gradients(got, variables)


# -- privacy through fit ---------------------------------------------------------------


class NoiselessDPBandMF(tfdp.optimizers.DPBandMF):
    def noise_stddev(self):
        return 0.0


@pytest.mark.parametrize("crafted", [1e6, 1e-30, 1e30])
def test_a_crafted_record_moves_one_step_by_at_most_lr_c_over_b(crafted):
    x, y = data(n=32)
    lr, clip, batch = 2.0, 0.1, 8
    x[3] = crafted * np.where(np.arange(x.shape[1]) % 2, 1.0, -1.0)
    updates = []
    for weight in (1.0, 0.0):  # the record, and the record zeroed out (weight 0)
        model = classifier(NoiselessDPBandMF(keras.optimizers.SGD(lr), clip, 1.0, bands=2,
                                             seed=0))
        y[3] = int(np.argmin(model(x[3:4]).numpy()))  # a label it gets wrong (no predict trace)
        weights = np.ones(len(x), "float32")
        weights[3] = weight
        ds = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(batch, drop_remainder=True)
        before = np.concatenate([w.numpy().ravel() for w in model.trainable_variables])
        recorder = StepUpdates()
        model.fit(ds, epochs=1, verbose=0, callbacks=[recorder])
        updates.append(recorder.after_first - before)
    moved = np.linalg.norm(updates[0] - updates[1])
    assert moved <= lr * clip / batch * (1 + 1e-5), moved
    if crafted == 1e6:  # clipped, not dropped (1e30 overflows: a non-finite gradient is dropped)
        assert moved > 0.5 * lr * clip / batch, moved


class StepUpdates(keras.callbacks.Callback):
    """All trainable weights after the first step."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.after_first = np.concatenate(
                [w.numpy().ravel() for w in self.model.trainable_variables])


@pytest.fixture(scope="module")
def fitted_four_bands():
    """A 4-band classifier after a 3-epoch fit (24 steps, sigma 2), for the
    tests that only read it (its ledger; its noise history and saved files)."""
    x, y = data()
    model = classifier(bandmf_opt(bands=4, sigma=2.0))
    model.fit(pipeline(x, y), epochs=3, verbose=0)
    return model


def test_fit_charges_one_gaussian_per_epoch_started_under_zero_out(fitted_four_bands):
    model = fitted_four_bands
    assert model.privacy.steps == 24
    assert model.privacy.epsilon(1e-5) == bandmf_accounting.fixed_order_epsilon(2.0, 24, 8, 4, 1e-5)
    assert model.privacy.relation == "zero_out"
    assert "contributes nothing" in model.privacy.statement(1e-5)


def test_privacy_budget_stops_at_the_end_of_the_last_affordable_epoch():
    x, y = data()
    budget = bandmf_accounting.fixed_order_epsilon(2.0, 16, 8, 4, 1e-5)
    model = classifier(bandmf_opt(bands=4, sigma=2.0))
    model.fit(pipeline(x, y), epochs=5, verbose=0,
              callbacks=[tfdp.callbacks.PrivacyBudget(epsilon=budget, delta=1e-5)])
    assert model.privacy.steps == 16
    assert model.privacy.epsilon(1e-5) <= budget


def test_xla_gives_the_result_without_xla():
    """Noiseless (XLA draws other, equally distributed, uniforms than the
    kernels do: the noise under XLA is checked by its covariance above)."""
    x, y = data()
    results = []
    for jit in (False, True):
        opt = NoiselessDPBandMF(keras.optimizers.SGD(0.5), 1.0, 1.0, bands=3, seed=4)
        keras.utils.set_random_seed(1)
        model = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer=opt, loss=LOSS, jit_compile=jit)
        model.fit(pipeline(x, y), epochs=2, verbose=0)
        results.append(model.layers[0].kernel.numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_physical_batches_give_the_unsplit_result():
    x, y = data()
    results = []
    for physical in (None, 3):
        model = classifier(bandmf_opt(bands=3, seed=4))
        model.fit(pipeline(x, y), epochs=2, verbose=0, physical_batch_size=physical)
        results.append(model.layers[0].kernel.numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-6)


# -- the secret noise stream ---------------------------------------------------------------


def test_the_noise_history_is_in_no_model_file_or_export(tmp_path, fitted_four_bands):
    model = fitted_four_bands
    opt = model.optimizer
    history = opt._stream.history  # one [bands - 1, *shape] buffer per trainable variable
    assert [tuple(h.shape) for h in history] == [(3,) + tuple(v.shape)
                                                 for v in model.trainable_variables]
    assert all(float(tf.reduce_max(tf.abs(h))) > 0 for h in history)
    shapes = {tuple(h.shape) for h in history}
    assert not shapes & {tuple(v.shape) for v in opt.variables}
    assert not shapes & {tuple(v.shape) for v in model.variables}
    model.save(tmp_path / "m.keras")
    with zipfile.ZipFile(tmp_path / "m.keras") as archive:
        weights = archive.read("model.weights.h5")
    for h in history:
        assert h.numpy()[0].tobytes()[:64] not in weights
    model.export(str(tmp_path / "export"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "export"))
    assert not shapes & {tuple(v.shape) for v in loaded.variables}


def test_get_config_round_trips_and_settings_are_fixed(tmp_path):
    x, y = data()
    opt = bandmf_opt(bands=3, noise_state=str(tmp_path / "state.npz"))
    classifier(opt).fit(pipeline(x, y), epochs=1, verbose=0)
    config = opt.get_config()
    assert config["bands"] == 3 and len(config["coefficients"]) == 3
    assert "noise_state" not in config and "seed" not in config
    again = tfdp.optimizers.DPBandMF.from_config(config)
    assert again.get_config() == config
    np.testing.assert_array_equal(again.coefficients, opt.coefficients)
    for name, value in (("bands", 2), ("noise_multiplier", 3.0), ("noise_state", "x")):
        with pytest.raises(AttributeError, match="fixed once the optimizer is created"):
            setattr(opt, name, value)


def test_a_resume_continues_the_noise_exactly_and_never_reuses_a_draw(tmp_path):
    x, y = data()
    ds = pipeline(x, y, seed=3, reshuffle_each_iteration=False)
    state = str(tmp_path / "noise_state.npz")
    # The run's strategy (a 1-epoch fit would plan 8 steps, not 16).
    coefficients = bandmf.optimal_coefficients(4, 16)

    straight = classifier(bandmf_opt(seed=9, coefficients=coefficients))
    straight.fit(ds, epochs=2, verbose=0)

    first = classifier(bandmf_opt(seed=9, noise_state=state, coefficients=coefficients))
    first.fit(ds, epochs=1, verbose=0)
    first.save(tmp_path / "ckpt.keras")
    history_at_save = [h.numpy().copy() for h in first.optimizer._stream.history]

    def resumed(**kwargs):
        model = tfdp.models.load_model(tmp_path / "ckpt.keras")
        iterations = int(model.optimizer.iterations.numpy())
        opt = bandmf_opt(seed=9, **kwargs)
        model.compile(optimizer=opt, loss=LOSS)
        opt.build(model.trainable_variables)
        opt.iterations.assign(iterations)  # as the checkpoint's optimizer had it
        return model

    model = resumed(noise_state=state)
    model.fit(ds, epochs=1, verbose=0)
    np.testing.assert_allclose(model.layers[0].kernel.numpy(), straight.layers[0].kernel.numpy(),
                               rtol=1e-6, atol=1e-7)
    assert model.privacy.epsilon(1e-5) == straight.privacy.epsilon(1e-5)
    assert len(model.privacy.composed_event().events) == 1  # one stream, one segment
    # negative control: the same resume with a fresh history gives other weights
    fresh = resumed(fresh_noise_history=True)
    fresh.fit(ds, epochs=1, verbose=0)
    assert np.max(np.abs(fresh.layers[0].kernel.numpy() - straight.layers[0].kernel.numpy())) > 1e-3
    assert [e.count for e in fresh.privacy.composed_event().events] == [1, 1]
    # and the state file held the history at the checkpoint, not later
    assert all(np.array_equal(a, b) for a, b in zip(
        history_at_save, [h.numpy() for h in first.optimizer._stream.history]))


def test_a_resume_without_the_noise_state_or_with_a_stale_one_is_refused(tmp_path):
    x, y = data()
    ds = pipeline(x, y)
    state = str(tmp_path / "state.npz")
    model = classifier(bandmf_opt(noise_state=state))
    model.fit(ds, epochs=1, verbose=0)
    model.save(tmp_path / "epoch1.keras")
    model.fit(ds, epochs=2, verbose=0)  # the state file moves on to 24, its .prev to 16

    loaded = tfdp.models.load_model(tmp_path / "epoch1.keras")
    loaded.compile(optimizer=bandmf_opt(), loss=LOSS)
    with pytest.raises(ValueError, match="no noise_state was given.*fresh_noise_history=True"):
        loaded.fit(ds, epochs=1, verbose=0)
    loaded.compile(optimizer=bandmf_opt(noise_state=state), loss=LOSS)
    with pytest.raises(ValueError, match="saved at model step 24 .*at step 16.*, but the "
                                         "model is at step 8"):
        loaded.fit(ds, epochs=1, verbose=0)
    loaded.compile(optimizer=bandmf_opt(noise_state=state, sigma=3.0), loss=LOSS)
    with pytest.raises(ValueError, match="other settings.*noise_multiplier"):
        loaded.fit(ds, epochs=1, verbose=0)
    assert loaded.privacy.steps == 8  # nothing ran


def test_an_order_that_changes_between_epochs_stops_before_the_batch_is_trained():
    x, y = data()
    passes = []

    def generator():  # a pipeline tfdp cannot inspect: the second pass is reversed
        order = range(len(x)) if not passes else reversed(range(len(x)))
        passes.append(1)
        for i in order:
            yield x[i], y[i]

    ds = tf.data.Dataset.from_generator(generator, output_signature=(
        tf.TensorSpec((6,), tf.float32), tf.TensorSpec((), tf.int64)))
    ds = ds.apply(tf.data.experimental.assert_cardinality(len(x))).batch(8, drop_remainder=True)
    model = classifier(bandmf_opt())
    recorder = Recorder()
    with pytest.raises(tf.errors.InvalidArgumentError, match="order changed"):
        model.fit(ds, epochs=2, verbose=0, callbacks=[recorder])
    assert len(recorder.kernels) == 8  # the first pass; the reversed batch never trained
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), recorder.kernels[-1])
    # The failed step may still be counted (its counter does not wait for the
    # data): an over-count, never an under-count.
    assert model.privacy.steps in (8, 9)


def test_a_first_pass_tells_pipelines_in_another_order_apart_and_is_adopted_as_the_order():
    """What workers compare before training (`FixedOrderData.first_pass`):
    the same seeded shuffle reads the same, another seed does not; the pass
    becomes the order every later pass is checked against, and a pass
    that differs from positions already recorded is refused."""
    from tfdp.data.fixed_order import FixedOrderData, OrderCheck

    x, y = data()

    def first_pass(seed):
        return FixedOrderData(pipeline(x, y, seed=seed, reshuffle_each_iteration=False),
                              planned_steps=8).first_pass()

    fingerprints, digest = first_pass(3)
    assert first_pass(3)[1] == digest
    other_fingerprints, other_digest = first_pass(4)
    assert other_digest != digest and not np.array_equal(other_fingerprints, fingerprints)
    check = OrderCheck(8)
    check.adopt(fingerprints)
    assert check.state()[1] == 8
    np.testing.assert_array_equal(check.state()[0], fingerprints)
    with pytest.raises(ValueError, match="order changed.*position 0"):
        check.adopt(other_fingerprints)


@pytest.mark.parametrize("make,match", [
    (lambda ds: ds.unbatch().shuffle(64).batch(8, drop_remainder=True), "reshuffles each epoch"),
    (lambda ds: ds.repeat(2), "repeats"),
    (lambda ds: ds.repeat(), "infinite"),
    (lambda ds: ds.filter(lambda a, b: True), "cardinality is unknown"),
    (lambda ds: ds.unbatch().batch(7), "batch size that varies"),
    (lambda ds: ds.take(3), "at least `bands` = 4 steps apart"),
])
def test_pipelines_that_break_the_fixed_order_are_refused_by_name(make, match):
    x, y = data()
    model = classifier(bandmf_opt())
    with pytest.raises(ValueError, match=match):
        model.fit(make(pipeline(x, y)), epochs=1, verbose=0)
    assert model.privacy.steps == 0


def test_fit_arguments_a_pipeline_carries_itself_are_refused():
    x, y = data()
    model = classifier(bandmf_opt())
    for kwargs, match in (({"batch_size": 16}, "leave batch_size"),
                          ({"steps_per_epoch": 3}, "leave steps_per_epoch"),
                          ({"validation_split": 0.2}, "validation_split"),
                          ({"y": y}, "pass it as x alone")):
        with pytest.raises(ValueError, match=match):
            model.fit(pipeline(x, y), epochs=1, verbose=0, **kwargs)
    dpsgd = classifier(tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0))
    with pytest.raises(ValueError, match="DPBandMF"):
        dpsgd.fit(pipeline(x, y), epochs=1, verbose=0)


def test_coefficients_follow_the_planned_steps_and_then_stay_fixed():
    x, y = data()
    opt = bandmf_opt(bands=4)
    model = classifier(opt)
    model.fit(pipeline(x, y), epochs=3, verbose=0)
    np.testing.assert_allclose(opt.coefficients, bandmf.optimal_coefficients(4, 24))
    model.fit(pipeline(x, y), epochs=10, verbose=0)  # continues the same stream
    np.testing.assert_allclose(opt.coefficients, bandmf.optimal_coefficients(4, 24))
    assert len(model.privacy.composed_event().events) == 1
