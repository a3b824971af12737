"""DP-BandMF with the crash-safety tools: a `PrivacyJournal` replay charges
what the ledger charged (rounds of P or b steps, the relation, streams
counted apart), and a run killed between writing its noise state and its
last `BackupAndRestore` backup resumes from the backup with the previous
noise state, exactly."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.mechanisms import bandmf

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
DELTA = 1e-5


def data(n=64, dim=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def pipeline(x, y, batch=8):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def classifier(optimizer, seed=1):
    keras.utils.set_random_seed(seed)
    model = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


def bandmf_opt(seed=0, **kwargs):
    return tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.5), 1.0, 1.0, bands=4, seed=seed,
                                    **kwargs)


def replayed(journal):
    """A fresh model whose ledger is the journal's replay."""
    model = classifier(bandmf_opt())
    journal.recover(model)
    return model


@pytest.mark.parametrize("frequency", ["epoch", "batch"])
def test_a_journal_replay_charges_a_fixed_order_as_the_ledger(tmp_path, frequency):
    x, y = data()
    journal = tfdp.callbacks.PrivacyJournal(str(tmp_path / "journal.jsonl"), frequency)
    model = classifier(bandmf_opt())
    model.fit(pipeline(x, y), epochs=2, verbose=0, callbacks=[journal])  # 16 steps, P = 8
    replay = replayed(journal)
    assert replay.privacy.steps == 16
    assert replay.privacy.relation == model.privacy.relation == "zero_out"
    assert [e.count for e in replay.privacy.composed_event().events] == [2]
    assert replay.privacy.epsilon(DELTA) == model.privacy.epsilon(DELTA)


def test_a_journal_replay_counts_amplified_rounds_and_new_streams_apart(tmp_path):
    x, y = data(n=256)
    journal = tfdp.callbacks.PrivacyJournal(str(tmp_path / "journal.jsonl"))
    model = classifier(bandmf_opt())
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=6, verbose=0, callbacks=[journal])
    # a new stream from step 6: its rounds are counted from its own start
    model.compile(optimizer=bandmf_opt(fresh_noise_history=True), loss=LOSS)
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=6, verbose=0, callbacks=[journal])
    assert [e.count for e in model.privacy.composed_event().events] == [2, 2]
    replay = replayed(journal)
    # one merged segment would count ceil(12 / 4) = 3 rounds: less than was spent
    assert [e.count for e in replay.privacy.composed_event().events] == [2, 2]
    assert replay.privacy.epsilon(DELTA) == model.privacy.epsilon(DELTA)
    assert replay.privacy.relation == "add_or_remove"


def test_a_replay_after_a_checkpoint_continues_its_stream(tmp_path):
    """Steps lost after a checkpoint continue the checkpoint's open stream:
    the replayed ledger equals the one of the run that lost them."""
    x, y = data()
    journal = tfdp.callbacks.PrivacyJournal(str(tmp_path / "journal.jsonl"))
    model = classifier(bandmf_opt())
    model.fit(pipeline(x, y), epochs=1, verbose=0, callbacks=[journal])
    model.save(tmp_path / "epoch1.keras")
    model.fit(pipeline(x, y), epochs=2, verbose=0, callbacks=[journal])  # 24 steps in all
    loaded = tfdp.models.load_model(tmp_path / "epoch1.keras")
    assert journal.recover(loaded) == 16
    assert [e.count for e in loaded.privacy.composed_event().events] == [3]
    assert loaded.privacy.epsilon(DELTA) == model.privacy.epsilon(DELTA)


class KillAtEpochEnd(keras.callbacks.Callback):
    """Raises at the end of epoch `epoch`: after the noise state is written
    (the optimizer's callbacks run first) and before the backup is."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("killed")


@pytest.fixture(scope="module")
def straight():
    """The uninterrupted 3-epoch run the resumes must equal: its kernel and epsilon
    (fitted once for the three kill tests, which all compare against it)."""
    x, y = data()
    model = classifier(bandmf_opt(seed=9, coefficients=bandmf.optimal_coefficients(4, 24)))
    model.fit(pipeline(x, y), epochs=3, verbose=0)
    return model.layers[0].kernel.numpy(), model.privacy.epsilon(DELTA)


def test_a_kill_between_noise_state_and_backup_resumes_exactly_from_the_previous_state(tmp_path, straight):
    x, y = data()
    ds = pipeline(x, y)
    state = str(tmp_path / "noise_state.npz")
    coefficients = bandmf.optimal_coefficients(4, 24)

    backup = str(tmp_path / "backup")
    killed = classifier(bandmf_opt(seed=9, coefficients=coefficients, noise_state=state))
    with pytest.raises(RuntimeError, match="killed"):
        killed.fit(ds, epochs=3, verbose=0, callbacks=[
            KillAtEpochEnd(1), keras.callbacks.BackupAndRestore(backup)])
    # the noise state moved on to step 16; the backup holds step 8
    resumed = classifier(bandmf_opt(seed=9, coefficients=coefficients, noise_state=state))
    resumed.fit(ds, epochs=3, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert resumed.privacy.steps == 24
    straight_kernel, straight_epsilon = straight
    np.testing.assert_allclose(resumed.layers[0].kernel.numpy(), straight_kernel, rtol=1e-6, atol=1e-7)
    assert resumed.privacy.epsilon(DELTA) == straight_epsilon
    assert [e.count for e in resumed.privacy.composed_event().events] == [3]


@pytest.mark.parametrize("temporary", ["complete", "lost"])
def test_a_kill_between_the_two_renames_of_a_save_resumes_exactly(tmp_path, temporary, straight):
    """Killed inside the noise-state save at step 16, after it moved the state
    at step 8 to .prev and before it renamed its temporary file (the state at
    16) to the path; the backup holds step 8. The rerun completes the save
    (or, with the temporary file gone, reads .prev) and resumes exactly."""
    x, y = data()
    ds = pipeline(x, y)
    state = tmp_path / "noise_state.npz"
    coefficients = bandmf.optimal_coefficients(4, 24)

    backup = str(tmp_path / "backup")
    killed = classifier(bandmf_opt(seed=9, coefficients=coefficients, noise_state=str(state)))
    with pytest.raises(RuntimeError, match="killed"):
        killed.fit(ds, epochs=3, verbose=0, callbacks=[
            KillAtEpochEnd(1), keras.callbacks.BackupAndRestore(backup)])
    if temporary == "complete":  # between the renames: the new state still in its temporary file
        state.rename(tmp_path / ".noise_state.npz.0123456789ab.tmp")
    else:
        state.unlink()
    (tmp_path / ".noise_state.npz.ba9876543210.tmp").write_bytes(b"PK\x03\x04cut")  # another, cut short
    resumed = classifier(bandmf_opt(seed=9, coefficients=coefficients, noise_state=str(state)))
    resumed.fit(ds, epochs=3, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert resumed.privacy.steps == 24
    straight_kernel, straight_epsilon = straight
    np.testing.assert_allclose(resumed.layers[0].kernel.numpy(), straight_kernel, rtol=1e-6, atol=1e-7)
    assert resumed.privacy.epsilon(DELTA) == straight_epsilon
    assert sorted(p.name for p in tmp_path.iterdir()) == ["noise_state.npz", "noise_state.npz.prev"]


def test_a_state_older_than_the_previous_one_is_still_refused(tmp_path):
    x, y = data()
    ds = pipeline(x, y)
    state = str(tmp_path / "state.npz")
    model = classifier(bandmf_opt(noise_state=state))
    model.fit(ds, epochs=1, verbose=0)
    model.save(tmp_path / "epoch1.keras")
    model.fit(ds, epochs=2, verbose=0)  # the state at 24, the previous one at 16
    loaded = tfdp.models.load_model(tmp_path / "epoch1.keras")
    loaded.compile(optimizer=bandmf_opt(noise_state=state), loss=LOSS)
    with pytest.raises(ValueError, match=r"saved at model step 24 \(and the previous one, .*"
                                         r"\.prev', at step 16\), but the model is at step 8"):
        loaded.fit(ds, epochs=1, verbose=0)
    assert loaded.privacy.steps == 8


def test_a_version_1_journal_is_still_replayed(tmp_path):
    path = tmp_path / "journal.jsonl"
    event = tfdp.accounting.dpsgd_event(1.0, 0.1)
    entry = {"start": 0, "end": 5, "event": tfdp.accounting.event_to_dict(event)}
    path.write_text('{"format": "tfdp.PrivacyJournal", "version": 1}\n'
                    + __import__("json").dumps(entry) + "\n")
    model = classifier(bandmf_opt())
    assert tfdp.callbacks.PrivacyJournal(str(path)).recover(model) == 5
    assert model.privacy.composed_event().events[0].count == 5
