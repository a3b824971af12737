"""Restores a `keras.callbacks.BackupAndRestore` backup before `fit` releases.

Keras's `BackupAndRestore` loads its backup in `on_train_begin`, which
replaces the model's weights, its optimizer's variables and its privacy
ledger. `DPModel.fit` opens the run's step event and makes a mechanism's
releases (DPIS's N~, K~ and ghat table) before Keras starts the callbacks,
so a restore there would keep charging the backup's step event and drop
those releases from the ledger. `restore_backups` runs every such restore
first, in `fit`, before anything is released (then lets a `PrivacyJournal`
charge the steps that ran after the backup, or before a kill that came
before the first backup), and hands Keras each callback
without its `on_train_begin`. `LedgerGuard` refuses, before the first step,
any other callback that replaces the ledger when training begins.

Example:

```python
backup = keras.callbacks.BackupAndRestore("run/backup")
model.fit(x, y, epochs=40, callbacks=[backup])  # killed; rerun the same line:
model.fit(x, y, epochs=40, callbacks=[backup])  # restores, then releases
```
"""

import contextlib
import json
import os
import warnings

import keras

_HOOKS = tuple(
    name
    for name in dir(keras.callbacks.Callback)
    if name.startswith("on_") and name != "on_train_begin"
)


@contextlib.contextmanager
def naming_the_file(path):
    """Adds the file's name to a ValueError raised while loading it (a
    damaged or mismatched privacy ledger), unless the message has it."""
    try:
        yield
    except ValueError as error:
        if str(path) in str(error):
            raise
        raise ValueError(f"Cannot load {str(path)!r}: {error}") from error


class _Restored(keras.callbacks.Callback):
    """A `BackupAndRestore` whose restore already ran: forwards every hook
    except `on_train_begin` (which would restore, and replace the ledger,
    again)."""

    def __init__(self, backup):
        super().__init__()
        self.backup = backup

    def set_model(self, model):
        super().set_model(model)
        self.backup.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.backup.set_params(params)


def _forward(name):
    def hook(self, *args, **kwargs):
        return getattr(self.backup, name)(*args, **kwargs)

    hook.__name__ = name
    return hook


for _name in _HOOKS:
    setattr(_Restored, _name, _forward(_name))


def restore_backups(model, callbacks):
    """Restores every `BackupAndRestore` in `callbacks` into `model` now.

    Call it after the model and optimizer are built and before any release.

    Args:
        model: the built `DPModel` / `DPSequential` that `fit` trains.
        callbacks: the list of callbacks passed to `fit`.

    With a `BackupAndRestore` in `callbacks`, every
    `tfdp.callbacks.PrivacyJournal` in them then charges the journaled steps
    the model does not cover (`PrivacyJournal.recover`): those that ran
    after the restored backup, or, when no backup was found (the run was
    killed before its first backup, and this rerun starts over), all the
    steps the killed run journaled. The restore happens inside `fit`, so
    there is no other moment to recover, and rerunning the same `fit` is
    how a run with a backup resumes.

    An optimizer with a `check_backup(callback)` method (DP-BandMF, whose
    noise state must be at every backup's step) refuses a backup it cannot
    resume from, before the restore.

    Returns:
        The list with each `BackupAndRestore` replaced by a forwarder that
        skips its `on_train_begin` (the restore it already made).
    """
    from tfdp.callbacks import PrivacyJournal

    result = []
    backups = restored = False
    check = getattr(model.optimizer, "check_backup", None)  # DP-BandMF's noise state
    journaled = any(isinstance(callback, PrivacyJournal) for callback in callbacks)
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            if check is not None:
                check(callback)
            backups = True
            callback.set_model(model)
            restored |= os.path.exists(callback._weights_path)  # pylint: disable=protected-access
            with _refusing_damage(callback.backup_dir, journaled):
                callback.on_train_begin()
            callback = _Restored(callback)
        result.append(callback)
    if backups:
        for callback in callbacks:
            if isinstance(callback, PrivacyJournal):
                callback.recover(model)
    if restored and not journaled:
        warnings.warn(_UNJOURNALED, UnjournaledRestoreWarning, stacklevel=3)
    return result


class UnjournaledRestoreWarning(UserWarning):
    """A `BackupAndRestore` backup was restored and no `PrivacyJournal`
    records the run: the steps after the backup may be under-counted."""


_UNJOURNALED = (
    "BackupAndRestore restored a backup, but no tfdp.callbacks.PrivacyJournal records this "
    "run: the steps the interrupted run took after its last backup ran and are not in the "
    "backup's ledger, so epsilon under-counts them, and a seeded optimizer draws their noise "
    "again. The recipe: pass PrivacyJournal('run/journal.jsonl') with BackupAndRestore in "
    "the callbacks of every fit of the run; fit then charges those steps when it restores "
    "(docs/guides/crash-and-resume.md, 'With BackupAndRestore')."
)


@contextlib.contextmanager
def _refusing_damage(folder, journaled):
    """Refuses a backup that cannot be read (a truncated or zeroed
    `.weights.h5`, a torn `training_metadata.json`, a damaged ledger) with
    the backup's folder and the way out, instead of a raw h5py or JSON
    error."""
    try:
        yield
    except (OSError, KeyError, TypeError, json.JSONDecodeError, ValueError) as error:
        if isinstance(error, ValueError) and not isinstance(error, json.JSONDecodeError) \
                and "Corrupt privacy ledger" not in str(error):
            raise  # a refusal of a readable backup (another run's, mismatched)
        journal = (
            "the PrivacyJournal in its callbacks then charges every step the interrupted "
            "run journaled" if journaled else
            "add a tfdp.callbacks.PrivacyJournal of the run if you kept one: it then charges "
            "every step the interrupted run journaled (without one, the steps already run "
            "are not charged)")
        raise ValueError(
            f"The BackupAndRestore backup in {str(folder)!r} is damaged and cannot be "
            f"restored ({type(error).__name__}: {error}). Delete that folder and rerun the "
            f"same fit on a newly built model (this one may hold part of the backup): it "
            f"starts again from the beginning, and {journal}. Training was not started."
        ) from error


class LedgerGuard(keras.callbacks.Callback):
    """Refuses a callback that replaced the privacy ledger as training began,
    or rolled the model back while it trains.

    `fit` adds it last, after opening the step event in `ledger`; a callback
    that loaded weights in `on_train_begin` replaced that ledger (and the
    releases in it), so training stops before its first step. A callback
    that loads earlier weights between steps (their step count is lower than
    the steps already run) stops training before the next step.

    Args:
        ledger: the ledger `fit` opened the run's step event in.
        callbacks: the fit's callbacks, named in the error.
    """

    def __init__(self, ledger, callbacks):
        super().__init__()
        self._ledger = ledger
        self._names = sorted(
            {
                type(c).__name__
                for c in callbacks
                if not type(c).__module__.startswith(("tfdp.", "keras."))
            }
        )
        self._steps = None
        self._last_batch = -1

    def on_train_begin(self, logs=None):
        self._steps = self._ledger.steps
        self._check_not_replaced()

    def on_epoch_begin(self, epoch, logs=None):
        self._last_batch = -1
        self._check_not_rolled_back()

    def on_train_batch_begin(self, batch, logs=None):
        self._check_not_rolled_back()

    def on_train_batch_end(self, batch, logs=None):
        # The steps Keras ran since the last check (several with
        # steps_per_execution): the count must have grown by as many.
        self._steps += batch - self._last_batch
        self._last_batch = batch
        self._check_not_rolled_back()

    def _check_not_rolled_back(self):
        """Refuses a rollback during the fit: a callback that loaded or
        assigned earlier weights (and their step count) between steps would
        run those steps again under the same noise key, and the ledger would
        count them once (found by review: two branches' noisy gradients
        differed by the noise-free difference of their gradients). The step
        count must be at least the steps this fit started from plus the steps
        Keras ran; on a rollback it is set back to that (the ledger then
        counts every step that ran) and training stops before another step."""
        model = self.model
        steps = model.privacy.steps
        if model.privacy is self._ledger and steps >= self._steps:
            return
        counter = getattr(model, "_dp_steps", None)
        if counter is not None and steps < self._steps:
            counter.assign(self._steps)
        raise ValueError(
            "A callback rolled the model back during fit() (it loaded or assigned earlier "
            f"weights: the private step count went from {self._steps} to {steps}): the "
            "steps after it would run again under the noise already released and the "
            "ledger would count them once. Roll back between fits (call load_weights, "
            "then fit again: a new fit draws fresh noise), or stop training with a "
            "callback instead. Training stopped before another step; the ledger counts "
            f"the {self._steps} steps that ran. Received: callbacks {self._names}"
        )

    def _check_not_replaced(self):
        if self.model.privacy is not self._ledger:
            raise ValueError(
                "A callback replaced the model's weights and privacy ledger in "
                "on_train_begin (it loaded a checkpoint), after fit() had opened this "
                "run's privacy event in the ledger it replaced: the steps would be "
                "charged under the checkpoint's event. Load checkpoints before fit(), "
                "or use keras.callbacks.BackupAndRestore (tfdp restores it first). "
                "Training was not started. Received: callbacks "
                f"{self._names}"
            )
