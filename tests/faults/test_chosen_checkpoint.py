"""A checkpoint chosen by a metric carries every step it was compared on.

Issue 34: `ModelCheckpoint(save_best_only=True)` over 5 epochs kept the 2nd
epoch's file, whose ledger counted 2 epochs of steps, while the choice of
that file depended on all 5. The monitored values are scripted by a callback
placed before the checkpoint (the best epoch is the 2nd of 5, or the 4th
batch of 8), so the choice is the same on every machine.
"""

import os

import keras
import numpy as np
import pytest

import tfdp
from tfdp.models import atomic_save

N, BATCH, EPOCHS = 64, 16, 5
STEPS_PER_EPOCH = N // BATCH
VAL_LOSS = [1.0, 0.5, 0.8, 0.9, 0.7]  # the best epoch is the 2nd
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Scripted(keras.callbacks.Callback):
    """Writes the monitored value into the logs the checkpoint reads next."""

    def __init__(self, key, values, batch=False):
        super().__init__()
        self.key, self.values, self.batch, self.calls = key, values, batch, 0

    def _write(self, logs):
        logs[self.key] = self.values[self.calls]
        self.calls += 1

    def on_epoch_end(self, epoch, logs=None):
        if not self.batch:
            self._write(logs)

    def on_train_batch_end(self, batch, logs=None):
        if self.batch:
            self._write(logs)


class Kernels(keras.callbacks.Callback):
    """The last layer's kernel after every epoch (or batch)."""

    def __init__(self, batch=False):
        super().__init__()
        self.batch, self.kernels = batch, []

    def _record(self):
        self.kernels.append(self.model.layers[-1].kernel.numpy().copy())

    def on_epoch_end(self, epoch, logs=None):
        if not self.batch:
            self._record()

    def on_train_batch_end(self, batch, logs=None):
        if self.batch:
            self._record()


def data(zeros=False):
    rng = np.random.default_rng(0)
    x = np.zeros((N, 4), np.float32) if zeros else rng.normal(size=(N, 4)).astype(np.float32)
    return x, rng.integers(0, 3, N)


def build(seed=3, bias=True):
    model = tfdp.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh", use_bias=bias),
         keras.layers.Dense(3, use_bias=bias)]
    )
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed),
        loss=LOSS,
    )
    return model


def train(checkpoint, scripted=None, epochs=EPOCHS, model=None, zeros=False, batch=False):
    model = model or build()
    kernels = Kernels(batch=batch)
    scripted = scripted or Scripted("val_loss", VAL_LOSS)
    model.fit(*data(zeros), batch_size=BATCH, epochs=epochs, verbose=0,
              callbacks=[scripted, checkpoint, kernels])
    return model, kernels.kernels


@pytest.mark.parametrize("weights_only", [False, True])
def test_a_best_only_checkpoint_carries_the_whole_run(tmp_path, weights_only):
    path = str(tmp_path / ("best.weights.h5" if weights_only else "best.keras"))
    checkpoint = keras.callbacks.ModelCheckpoint(
        path, monitor="val_loss", save_best_only=True, save_weights_only=weights_only)
    model, kernels = train(checkpoint)
    assert model.privacy.steps == EPOCHS * STEPS_PER_EPOCH
    if weights_only:
        loaded = build()
        loaded.load_weights(path)
    else:
        loaded = tfdp.load_model(path)
    # The file holds the 2nd epoch's weights and optimizer state...
    np.testing.assert_array_equal(loaded.layers[-1].kernel.numpy(), kernels[1])
    assert not np.array_equal(kernels[1], kernels[-1])
    assert int(loaded.optimizer.iterations.numpy()) == 2 * STEPS_PER_EPOCH
    # ...and the ledger and step counter of all 5 epochs it was compared on.
    assert loaded.privacy.steps == model.privacy.steps == int(loaded._dp_steps.numpy())
    assert loaded.privacy.epsilon(1e-5) == model.privacy.epsilon(1e-5)


def test_batch_checks_charge_every_step_up_to_the_last_check(tmp_path):
    # Checks every 2 batches over 2 epochs of 4: at steps 2, 4 (best), 6, 8.
    path = str(tmp_path / "best.keras")
    checkpoint = keras.callbacks.ModelCheckpoint(
        path, monitor="loss", save_best_only=True, save_freq=2)
    losses = [5.0, 4.0, 3.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    model, kernels = train(checkpoint, Scripted("loss", losses, batch=True), epochs=2, batch=True)
    loaded = tfdp.load_model(path)
    np.testing.assert_array_equal(loaded.layers[-1].kernel.numpy(), kernels[3])
    assert loaded.privacy.steps == model.privacy.steps == 8


def test_with_a_formatted_path_the_latest_best_file_is_the_kept_one(tmp_path):
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best-{epoch}.keras"), monitor="val_loss", save_best_only=True)
    model, _ = train(checkpoint)
    assert sorted(os.listdir(tmp_path)) == ["best-1.keras", "best-2.keras"]
    # best-1 was written at epoch 1 and no choice kept it afterwards: its own steps.
    assert tfdp.load_model(tmp_path / "best-1.keras").privacy.steps == STEPS_PER_EPOCH
    assert tfdp.load_model(tmp_path / "best-2.keras").privacy.steps == model.privacy.steps


def test_a_second_fit_keeps_charging_the_file_of_the_first(tmp_path):
    path = str(tmp_path / "best.keras")
    checkpoint = keras.callbacks.ModelCheckpoint(path, monitor="val_loss", save_best_only=True)
    model, kernels = train(checkpoint, epochs=2)  # best: the 2nd epoch
    train(checkpoint, Scripted("val_loss", [0.9, 0.6]), epochs=2, model=model)  # no improvement
    loaded = tfdp.load_model(path)
    np.testing.assert_array_equal(loaded.layers[-1].kernel.numpy(), kernels[1])
    assert loaded.privacy.steps == model.privacy.steps == 4 * STEPS_PER_EPOCH


def test_resuming_from_the_chosen_file_continues_at_the_run_s_step_count(tmp_path):
    """Inputs 0 and no biases: every gradient is 0 and each step's update is
    its noise alone, so a replayed noise key would repeat an update."""
    path = str(tmp_path / "best.keras")
    checkpoint = keras.callbacks.ModelCheckpoint(path, monitor="val_loss", save_best_only=True)
    model, kernels = train(checkpoint, model=build(seed=5, bias=False), zeros=True, batch=True)
    run_noise = np.diff(np.stack([kernels[0] * 0] + kernels), axis=0)[1:]
    loaded = tfdp.load_model(path)
    assert loaded.privacy.steps == EPOCHS * STEPS_PER_EPOCH
    # The same seed again: the noise key folds the model's step counter in.
    loaded.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=5),
        loss=LOSS)
    _, resumed = train(keras.callbacks.Callback(), epochs=1, model=loaded, zeros=True, batch=True)
    assert loaded.privacy.steps == (EPOCHS + 1) * STEPS_PER_EPOCH
    resumed_noise = np.diff(np.stack(resumed), axis=0)
    for step in resumed_noise:
        assert not any(np.allclose(step, earlier, atol=1e-7) for earlier in run_noise)


def test_a_rewrite_killed_midway_leaves_the_kept_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "best.keras"
    checkpoint = keras.callbacks.ModelCheckpoint(str(path), monitor="val_loss", save_best_only=True)
    real_atomic_write = atomic_save.atomic_write

    class Killed(Exception):
        pass

    def dying_write(target, write):
        def half_then_die(tmp):
            with open(tmp, "wb") as file:
                file.write(b"PK\x03\x04 half a zip")
            raise Killed()

        return real_atomic_write(target, half_then_die)

    class KillAfterEpoch2(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:  # after the best file was written
                monkeypatch.setattr("tfdp.models.dp_model.atomic_write", dying_write)

    model = build()
    with pytest.raises(Killed):
        model.fit(*data(), batch_size=BATCH, epochs=EPOCHS, verbose=0,
                  callbacks=[Scripted("val_loss", VAL_LOSS), checkpoint, KillAfterEpoch2()])
    assert sorted(os.listdir(tmp_path)) == ["best.keras"]  # no temporary file left
    loaded = tfdp.load_model(path)  # the 2nd epoch's file, whole
    assert loaded.privacy.steps == 2 * STEPS_PER_EPOCH
