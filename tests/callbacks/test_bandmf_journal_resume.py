"""DP-BandMF resumes with the crash-and-resume guide's recipe (issue 44,
items 1 and 2): `BackupAndRestore` + `PrivacyJournal` + `noise_state`,
killed mid-epoch, then the same `fit` rerun.

The journal charges the steps that ran (or were journaled ahead) after the
last backup; their noise was drawn from the stream and is lost with the
kill, while the noise state is at the backup's step. The rerun starts a new
noise stream (a new ledger segment, as `fresh_noise_history=True`) at the
journal's step count, with a warning: the killed stream's released rows end
there, and each stream is counted on its own.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
DELTA = 1e-5
P = 8  # steps per epoch of the fixed order


def data(n=64, dim=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def pipeline(x, y, batch=8):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def classifier(state, seed=1):
    keras.utils.set_random_seed(seed)
    model = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPBandMF(
        keras.optimizers.SGD(0.5), 1.0, 1.0, bands=4, noise_state=state), loss=LOSS)
    return model


class KillAtStep(keras.callbacks.Callback):
    """Raises after model step `step` (a kill: no epoch-end or train-end hook runs)."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.model.privacy.steps == self.step:
            raise RuntimeError("killed")


def fit_args(mode):
    if mode == "amplified":
        x, y = data(n=256)
        return (x, y), dict(batch_size=16, steps_per_epoch=P)
    x, y = data()
    return (pipeline(x, y),), {}


def run(model, mode, tmp_path, frequency, extra=(), epochs=3, save_freq="epoch"):
    args, kwargs = fit_args(mode)
    journal = tfdp.callbacks.PrivacyJournal(str(tmp_path / "journal.jsonl"), frequency)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=save_freq)
    model.fit(*args, epochs=epochs, verbose=0, callbacks=[journal, backup, *extra], **kwargs)
    return journal


@pytest.mark.parametrize("mode, frequency, kill_at, charged", [
    ("fixed", "epoch", 13, 16),   # mid-epoch, the whole epoch journaled ahead
    ("fixed", "batch", 13, 13),   # mid-epoch, one step journaled at a time
    ("fixed", "batch", 16, 16),   # at an epoch's last batch, before its end
    ("amplified", "epoch", 11, 16),
])
def test_the_guides_recipe_resumes_after_a_mid_epoch_kill(tmp_path, mode, frequency, kill_at,
                                                          charged):
    state = str(tmp_path / "noise_state.npz")
    killed = classifier(state)
    with pytest.raises(RuntimeError, match="killed"):
        run(killed, mode, tmp_path, frequency, extra=[KillAtStep(kill_at)])
    assert killed.optimizer.iterations.numpy() == kill_at  # the steps applied

    resumed = classifier(state)
    with pytest.warns(UserWarning, match=rf"PrivacyJournal charged {charged - P} steps .* "
                                         rf"new DP-BandMF noise stream at model step {charged}"):
        journal = run(resumed, mode, tmp_path, frequency)
    # the backup (step 8) was restored, the journal charged up to `charged`,
    # and epochs 2 and 3 ran from there
    ran_after = 2 * P
    assert resumed.privacy.steps == charged + ran_after == journal.journaled_steps()
    assert resumed.optimizer.iterations.numpy() == P + ran_after  # updates in these weights
    assert charged >= kill_at  # never under-counted
    # the killed stream up to `charged`, then the new one, counted apart
    per_round = P if mode == "fixed" else 4
    counts = [e.count for e in resumed.privacy.composed_event().events]
    assert counts == [-(-charged // per_round), -(-ran_after // per_round)]
    # a second kill of the resumed run goes on the same way
    assert resumed.optimizer.coefficients is not None


def test_a_mid_epoch_backup_is_refused_before_the_first_step(tmp_path):
    """Item 2: with `save_freq=N` the backup is written mid-epoch and the
    noise state at epoch ends, so the stream could never resume from it
    (the rerun was refused after the kill, with the steps charged)."""
    state = str(tmp_path / "noise_state.npz")
    model = classifier(state)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"BackupAndRestore\(save_freq=3\) saves in the middle "
                                         r"of epochs.*noise_state.*Received: save_freq=3"):
        run(model, "fixed", tmp_path, "batch", save_freq=3)
    assert model.privacy.steps == 0 and model.optimizer.iterations.numpy() == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # an epoch backup with noise_state, or a mid-epoch one without it, trains
    for folder, noise_state, save_freq in (("a", state, "epoch"), ("b", None, 3)):
        (tmp_path / folder).mkdir()
        run(classifier(noise_state), "fixed", tmp_path / folder, "batch", epochs=1,
            save_freq=save_freq)
