"""Keras's BackupAndRestore with every mechanism (issue 25, item 3).

Keras restores in `on_train_begin`, which replaces the model's weights,
optimizer state and privacy ledger. Every release of a `fit` (the step
event, DPIS's N~ and K~) must be made after that restore, into the ledger
that is kept, with the values the steps then use. Each test resumes from a
backup taken after one epoch and compares the resumed ledger, event by
event, with a reference built from what each run's optimizer did.
"""

import keras
import numpy as np
import pytest

import tfdp
from tfdp.accounting import PrivacyLedger
from tfdp.mechanisms import importance_sampling as isp

N, BATCH, DELTA = 64, 16, 1e-5
Q = BATCH / N
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 4)).astype(np.float32), rng.integers(0, 3, N)


def public_data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, 8)


MAKERS = {
    "dpsgd": lambda sigma: tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=sigma, seed=1),
    "dp_adam": lambda sigma: tfdp.optimizers.DPOptimizer(
        keras.optimizers.Adam(1e-3), l2_norm_clip=1.0, noise_multiplier=sigma, seed=1
    ),
    "sadpsgd": lambda sigma: tfdp.optimizers.SADPSGD(
        0.1, l2_norm_clip=1.0, noise_multiplier=sigma, seed=1, public_energy_data=public_data()
    ),
    "adadp": lambda sigma: tfdp.optimizers.AdaDP(0.01, l2_norm_clip=1.0, noise_multiplier=sigma, seed=1),
}


def build(optimizer):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)]
    )
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


def fit(model, folder, epochs, extra=()):
    x, y = data()
    backup = keras.callbacks.BackupAndRestore(str(folder), delete_checkpoint=False)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, callbacks=[backup, *extra], verbose=0)


@pytest.mark.parametrize("mechanism", sorted(MAKERS))
def test_a_resumed_run_charges_the_noise_its_new_optimizer_adds(mechanism, tmp_path):
    """Backup after epoch 1 with sigma = 1; resume with a new optimizer of
    sigma = 3 for epoch 2. The ledger holds 4 steps of sigma 1 then 4 of
    sigma 3, the events each optimizer's steps release.

    Broken variant caught: the step event opened before Keras's restore (the
    old code): the restored ledger kept charging sigma 1 for epoch 2.
    """
    first = build(MAKERS[mechanism](1.0))
    fit(first, tmp_path, epochs=1)
    second_optimizer = MAKERS[mechanism](3.0)
    second = build(second_optimizer)
    fit(second, tmp_path, epochs=2)

    reference = PrivacyLedger()
    reference.begin_steps(first.optimizer.step_event(Q))
    reference.advance(first.privacy.steps)
    reference.begin_steps(second_optimizer.step_event(Q))
    reference.advance(second.privacy.steps - first.privacy.steps)
    assert (first.privacy.steps, second.privacy.steps) == (4, 8)
    assert second.privacy.composed_event() == reference.composed_event()
    assert second.privacy.epsilon(DELTA) == pytest.approx(reference.epsilon(DELTA), rel=1e-12)


def dpis(seed):
    return tfdp.optimizers.DPIS(
        0.1, l2_norm_clip=1.0, target_epsilon=8.0, epochs=3, sigma_n=4.0, sigma_k=5.0, seed=seed
    )


class Killed(Exception):
    pass


class KillAtEpochBegin(keras.callbacks.Callback):
    """Stands for a kill after the backup of epoch `epoch - 1`."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise Killed()


@pytest.mark.parametrize("kill_at", [None, 1, 2], ids=["finished", "killed", "killed_in_last_epoch"])
def test_a_resumed_dpis_run_holds_every_release_it_made(kill_at, tmp_path):
    """DPIS(epochs=3) backed up after an epoch, resumed by a new DPIS: the
    ledger holds one N~, one K~ per DPIS epoch and each epoch's 4 steps under
    the step event of the K~, N~, sigma_G and clip that its sampler used.

    "finished": the first fit asked for one epoch. "killed" (at epoch 1 or 2):
    it asked for three and was killed after a backup that already holds the
    next epoch's K~ (released at the end of the epoch before): the resumed
    run goes on with that epoch and its released values, releasing no new K~.

    Broken variants caught: DPIS's releases made before Keras's restore (the
    old code): the resumed run released a second N~ and a K~ that the restore
    dropped from the ledger, sampled its first epoch with them, and the ledger
    charged that epoch's steps under the first run's step event. A resume that
    starts a new epoch for a begun one (the first fix): an extra K~, one epoch
    short, and no resume at all in the last epoch ("planned out").
    """
    first = build(dpis(seed=1))
    if kill_at is None:
        fit(first, tmp_path, epochs=1)
    else:
        with pytest.raises(Killed):
            fit(first, tmp_path, epochs=3, extra=[KillAtEpochBegin(kill_at)])
    second_optimizer = dpis(seed=2)
    second = build(second_optimizer)
    fit(second, tmp_path, epochs=3)

    epochs = {}
    for row in first.optimizer.epoch_history + second_optimizer.epoch_history:
        released = {key: row[key] for key in ("sigma_g", "k_tilde", "clip_norm", "n_tilde")}
        assert epochs.setdefault(row["epoch"], released) == released, row  # a resume uses it as released
    assert sorted(epochs) == [0, 1, 2]
    n_tilde = epochs[0]["n_tilde"]
    assert all(epoch["n_tilde"] == n_tilde for epoch in epochs.values()), epochs
    reference = PrivacyLedger()
    reference.record(isp.count_event(4.0))
    for index in sorted(epochs):
        epoch = epochs[index]
        reference.record(isp.norm_sum_event(5.0, isp.norm_sum_sampling_probability(BATCH, n_tilde)))
        reference.begin_steps(
            isp.step_event(epoch["sigma_g"], epoch["clip_norm"], epoch["k_tilde"], n_tilde, BATCH)
        )
        reference.advance(4)
    assert second.privacy.steps == 12
    assert second.privacy.composed_event() == reference.composed_event()
    assert second.privacy.epsilon(DELTA) == pytest.approx(reference.epsilon(DELTA), rel=1e-12)


class ReloadAtTrainBegin(keras.callbacks.Callback):
    """A callback of the user's that loads saved weights in on_train_begin."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_train_begin(self, logs=None):
        self.model.load_weights(self.path)


def test_another_callback_that_restores_at_train_begin_is_refused(tmp_path):
    """A restore tfdp does not know of (here a user callback's load_weights)
    is refused before the first step: it would replace the ledger holding this
    fit's step event. Control: the same fit without it trains."""
    model = build(MAKERS["dpsgd"](1.0))
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    path = str(tmp_path / "saved.weights.h5")
    model.save_weights(path)
    resumed = build(MAKERS["dpsgd"](3.0))
    with pytest.raises(ValueError, match="on_train_begin.*ReloadAtTrainBegin"):
        resumed.fit(x, y, batch_size=BATCH, epochs=1, callbacks=[ReloadAtTrainBegin(path)], verbose=0)
    assert resumed.privacy.steps == 4  # the reloaded count: no step ran after it
    assert int(resumed._dp_steps.numpy()) == resumed.privacy.steps
    resumed.load_weights(path)
    before = resumed.privacy.steps
    resumed.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert resumed.privacy.steps == before + 4


class KillAtStep(keras.callbacks.Callback):
    """Stands for a kill mid-epoch, after `steps` steps in all."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def on_train_batch_end(self, batch, logs=None):
        if self.model.privacy.steps == self.steps:
            raise Killed()


def test_a_privacy_journal_charges_the_steps_after_the_backup_on_resume(tmp_path):
    """Killed mid-epoch 2 (step 6), after the backup of epoch 1 (step 4):
    steps 5 and 6 ran and are in the journal only. Resumed with the same
    callbacks, fit charges them after restoring the backup (no other moment
    exists to call `journal.recover`): 4 + 4 journaled + 4 resumed steps.

    Broken variant caught: no recovery after the restore (the old code), where
    the journal refused every resume ("records 8 steps, but this model's
    ledger counts 4").
    """
    journal_path = str(tmp_path / "journal.jsonl")
    first = build(MAKERS["dpsgd"](1.0))
    with pytest.raises(Killed):
        fit(first, tmp_path / "backup", epochs=2,
            extra=[tfdp.callbacks.PrivacyJournal(journal_path), KillAtStep(6)])
    assert first.privacy.steps == 6
    second = build(MAKERS["dpsgd"](1.0))
    fit(second, tmp_path / "backup", epochs=2, extra=[tfdp.callbacks.PrivacyJournal(journal_path)])
    reference = PrivacyLedger()
    reference.begin_steps(first.optimizer.step_event(Q))
    reference.advance(12)
    assert second.privacy.steps == 12
    assert second.privacy.epsilon(DELTA) == pytest.approx(reference.epsilon(DELTA), rel=1e-12)


def test_killed_before_the_first_backup_the_same_fit_reruns_and_charges_the_lost_steps(tmp_path):
    """Killed at step 2 of epoch 1, before any backup was written: rerunning
    the same fit (README's instruction) starts over and charges the 4 steps
    the journal holds for the killed epoch (they ran, their logs may have
    been seen), then trains its own 8. The old code refused the rerun ("4
    steps ran after the checkpoint it was loaded from") though nothing was
    loaded."""
    journal_path = str(tmp_path / "journal.jsonl")
    first = build(MAKERS["dpsgd"](1.0))
    with pytest.raises(Killed):
        fit(first, tmp_path / "backup", epochs=2,
            extra=[tfdp.callbacks.PrivacyJournal(journal_path), KillAtStep(2)])
    second = build(MAKERS["dpsgd"](1.0))
    fit(second, tmp_path / "backup", epochs=2, extra=[tfdp.callbacks.PrivacyJournal(journal_path)])
    reference = PrivacyLedger()
    reference.begin_steps(first.optimizer.step_event(Q))
    reference.advance(4 + 8)
    assert second.privacy.steps == 12
    assert second.privacy.epsilon(DELTA) == pytest.approx(reference.epsilon(DELTA), rel=1e-12)
    assert tfdp.callbacks.PrivacyJournal(journal_path).journaled_steps() == 12


def test_control_without_a_backup_callback_the_journal_still_asks_for_recover(tmp_path):
    """Without BackupAndRestore, fit has no restore to follow and recovers
    nothing itself: the journal refuses a model behind it."""
    journal_path = str(tmp_path / "journal.jsonl")
    x, y = data()
    first = build(MAKERS["dpsgd"](1.0))
    with pytest.raises(Killed):
        first.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                  callbacks=[tfdp.callbacks.PrivacyJournal(journal_path), KillAtStep(2)])
    second = build(MAKERS["dpsgd"](1.0))
    with pytest.raises(ValueError, match="recover"):
        second.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                   callbacks=[tfdp.callbacks.PrivacyJournal(journal_path)])
    assert second.privacy.steps == 0
