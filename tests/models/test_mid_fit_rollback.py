"""A callback that rolls the model back during fit (load_weights of an
earlier state between epochs, a "restore on a loss spike" callback) is
refused before the next step. Before, the steps after it ran again under
the noise key already used (DP-SGD replayed the noise bit for bit, and two
branches' noisy gradients differed by their noise-free difference) and the
ledger counted them once (6 charged where 9 ran; DP-BandMF charged 16
rounds of 24). Found by review."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp

DIM = 16


class RollBack(keras.callbacks.Callback):
    """Saves after epoch 0, loads that state back after epoch 1."""

    def __init__(self, folder):
        super().__init__()
        self.path = os.path.join(folder, "epoch0.weights.h5")

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.model.save_weights(self.path)
        if epoch == 1:
            self.model.load_weights(self.path)


def _model(optimizer):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((DIM,)), keras.layers.Dense(
        DIM, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=optimizer, loss="mse")
    return model


@pytest.mark.parametrize("make", [
    lambda: tfdp.optimizers.DPSGD(1.0, 1.0, 1.0),
    lambda: tfdp.optimizers.DPOptimizer(keras.optimizers.Adam(0.1), 1.0, 1.0),
], ids=["DPSGD", "DPOptimizer"])
def test_a_rollback_inside_fit_is_refused_before_the_next_step(tmp_path, make):
    model = _model(make())
    x = np.zeros((64, DIM), np.float32)
    with pytest.raises(ValueError, match="rolled the model back during fit.*from 6 to 3"):
        model.fit(x, x, batch_size=8, epochs=3, steps_per_epoch=3, verbose=0,
                  callbacks=[RollBack(str(tmp_path))])
    assert model.privacy.steps == 6  # every step that ran is counted; none ran after it
    assert model.privacy.epsilon(1e-5) > 0


class AssignBack(keras.callbacks.Callback):
    """Snapshots every variable after step 1 and writes them back after step 3
    (the step counter among them): a rollback inside one epoch, before
    LedgerGuard's own batch hook (found by review: the noise replayed and the
    ledger counted 4 steps of 6)."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.snapshot = [v.numpy().copy() for v in self.model.variables]
        if batch == 2:
            for variable, value in zip(self.model.variables, self.snapshot):
                variable.assign(value)


def test_a_rollback_by_assigning_variables_inside_an_epoch_is_refused_at_once():
    model = _model(tfdp.optimizers.DPSGD(1.0, 1.0, 1.0))
    x = np.zeros((64, DIM), np.float32)
    with pytest.raises(ValueError, match="rolled the model back during fit.*from 3 to 1"):
        model.fit(x, x, batch_size=8, epochs=1, steps_per_epoch=6, verbose=0,
                  callbacks=[AssignBack(), tfdp.callbacks.PrivacyBudget(accountant="pld")])
    assert model.privacy.steps == 3


def test_a_dp_bandmf_rollback_inside_fit_is_refused(tmp_path):
    model = _model(tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.5), 1.0, 1.0, bands=4,
                                            noise_state=str(tmp_path / "noise.npz")))
    x = np.zeros((64, DIM), np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, x)).batch(8, drop_remainder=True)
    with pytest.raises(ValueError, match="rolled the model back during fit"):
        model.fit(data, epochs=3, verbose=0, callbacks=[RollBack(str(tmp_path))])


def test_a_rollback_between_fits_trains_and_ordinary_callbacks_pass(tmp_path):
    """Negative control: loading earlier weights between two fits, and a
    callback that only reads, train as before."""
    model = _model(tfdp.optimizers.DPSGD(1.0, 1.0, 1.0))
    x = np.zeros((64, DIM), np.float32)
    model.fit(x, x, batch_size=8, epochs=1, steps_per_epoch=3, verbose=0)
    model.save_weights(str(tmp_path / "a.weights.h5"))
    model.fit(x, x, batch_size=8, epochs=1, steps_per_epoch=3, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: None)])
    model.load_weights(str(tmp_path / "a.weights.h5"))
    model.fit(x, x, batch_size=8, epochs=2, steps_per_epoch=3, verbose=0)
    assert model.privacy.steps == 9
