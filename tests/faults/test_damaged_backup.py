"""A damaged BackupAndRestore backup, and a backup restored without a journal
(issue 55, items 5 and 6).

- A truncated or zeroed `.weights.h5`, a torn `training_metadata.json` or a
  damaged ledger is refused naming the backup folder and the way out
  (delete it, rerun; the journal charges the steps), not with a raw h5py or
  JSON error, and before any step.
- A backup restored with no `PrivacyJournal` in the fit warns once, naming
  the recipe; with a journal, or with no backup to restore, nothing is said.
"""

import shutil
import warnings

import keras
import numpy as np
import pytest

import tfdp
from tfdp.models.restore import UnjournaledRestoreWarning

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 4)).astype(np.float32), rng.integers(0, 3, 32)


def build():
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=LOSS)
    return model


class Killed(Exception):
    pass


class KillAfterFirstEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        raise Killed()


@pytest.fixture(scope="module")
def backup(tmp_path_factory):
    """A backup after one epoch of a run killed then, and its journal."""
    folder = tmp_path_factory.mktemp("run")
    journal = tfdp.callbacks.PrivacyJournal(str(folder / "journal.jsonl"))
    with pytest.raises(Killed):
        build().fit(*data(), batch_size=8, epochs=3, verbose=0, callbacks=[
            journal, keras.callbacks.BackupAndRestore(str(folder / "backup")),
            KillAfterFirstEpoch()])
    assert (folder / "backup" / "latest.weights.h5").exists()
    return folder


def rerun(folder, journal=True):
    model = build()
    callbacks = [keras.callbacks.BackupAndRestore(str(folder / "backup"))]
    if journal:
        callbacks.append(tfdp.callbacks.PrivacyJournal(str(folder / "journal.jsonl")))
    model.fit(*data(), batch_size=8, epochs=3, verbose=0, callbacks=callbacks)
    return model


def copy_of(backup, tmp_path):
    shutil.copytree(backup, tmp_path / "run")
    return tmp_path / "run"


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def zero(path):
    path.write_bytes(bytes(path.stat().st_size))


def tear(path):
    path.write_bytes(path.read_bytes()[:5])


def flip_ledger(path):
    data = path.read_bytes()
    at = data.index(b'"noise_multiplier": 1.0') + len(b'"noise_multiplier": ')
    path.write_bytes(data[:at] + b"0" + data[at + 1:])  # sigma 1.0 -> 0.0: refused by its checksum


@pytest.mark.parametrize("damage, name", [
    (truncate, "latest.weights.h5"), (zero, "latest.weights.h5"),
    (tear, "training_metadata.json"), (flip_ledger, "latest.weights.h5")])
def test_a_damaged_backup_is_refused_naming_its_folder_and_the_way_out(backup, tmp_path, damage, name):
    folder = copy_of(backup, tmp_path)
    damage(folder / "backup" / name)
    model = build()
    with pytest.raises(ValueError) as refused:
        model.fit(*data(), batch_size=8, epochs=3, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(str(folder / "backup")),
            tfdp.callbacks.PrivacyJournal(str(folder / "journal.jsonl"))])
    message = str(refused.value)
    assert f"backup in '{folder / 'backup'}' is damaged" in message
    assert "Delete that folder and rerun the same fit on a newly built model" in message and "PrivacyJournal" in message
    assert tfdp.callbacks.PrivacyJournal(str(folder / "journal.jsonl")).journaled_steps() == 4
    # The way out works: without the backup the journal charges the killed run's steps.
    shutil.rmtree(folder / "backup")
    assert rerun(folder).privacy.steps == 4 + 12  # the journaled epochs, then this fit's


def test_a_backup_restored_without_a_journal_warns_once_naming_the_recipe(backup, tmp_path):
    folder = copy_of(backup, tmp_path)
    with pytest.warns(UnjournaledRestoreWarning) as caught:
        rerun(folder, journal=False)
    ours = [w for w in caught if issubclass(w.category, UnjournaledRestoreWarning)]
    assert len(ours) == 1
    assert "PrivacyJournal('run/journal.jsonl')" in str(ours[0].message)


def test_no_warning_with_a_journal_or_without_a_backup_to_restore(backup, tmp_path):
    folder = copy_of(backup, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnjournaledRestoreWarning)
        rerun(folder, journal=True)  # restored, journaled
        rerun(tmp_path / "fresh", journal=False)  # nothing to restore
