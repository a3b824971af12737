"""Training killed by SIGKILL mid-epoch, resumed from its last checkpoint.

The semantics (README, "Faults"): a checkpoint's ledger covers the steps
before it; `PrivacyJournal` writes each step range to disk BEFORE it runs, so
after a kill `journal.recover(model)` charges every step that ran after the
checkpoint. The ledger may over-count (journaled ahead, never ran) but never
under-counts. Without recovery (the negative control) the resumed ledger
misses the lost steps, and the journal refuses to train on.
"""

import json
import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import tfdp
from tfdp.accounting import compute_epsilon

sys.path.insert(0, os.path.dirname(__file__))
import _train_until_killed as child  # noqa: E402

DELTA = 1e-5
Q = child.BATCH / child.N
BLOCK_AT = 25  # mid-epoch 3: the last checkpoint holds 20 steps


def run_and_kill(workdir, frequencies):
    script = os.path.join(os.path.dirname(__file__), "_train_until_killed.py")
    process = subprocess.Popen(
        [sys.executable, script, str(workdir), frequencies, str(BLOCK_AT)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    ready = os.path.join(workdir, "ready")
    deadline = time.time() + 180
    while not os.path.exists(ready):
        if process.poll() is not None:
            raise AssertionError(f"child exited early: {process.stderr.read().decode()[-2000:]}")
        if time.time() > deadline:
            process.kill()
            raise AssertionError("child did not reach the blocking step")
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    process.stderr.close()
    with open(ready) as file:
        return int(file.read())


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """One child killed at step BLOCK_AT, journaling with both frequencies
    (a journal file each): each parametrization below resumes from its own
    journal and the shared checkpoint, which it only reads."""
    workdir = tmp_path_factory.mktemp("killed")
    return workdir, run_and_kill(workdir, "batch,epoch")


@pytest.mark.xdist_group("killed_run")  # one worker: the child runs once
@pytest.mark.parametrize("frequency, charged", [("batch", BLOCK_AT), ("epoch", 30)])
def test_killed_run_resumes_with_a_ledger_covering_every_step_that_ran(killed_run, frequency, charged):
    workdir, ran = killed_run
    assert ran == BLOCK_AT
    model = tfdp.load_model(workdir / "last.keras")  # registers tfdp's classes first
    assert model.privacy.steps == 20  # the last epoch-end checkpoint
    journal = tfdp.callbacks.PrivacyJournal(child.journal_path(workdir, frequency), frequency=frequency)
    x, y = child.data()

    # Negative control: resuming from the checkpoint alone under-counts, and
    # the journal refuses to train on such a model.
    assert model.privacy.epsilon(DELTA) < compute_epsilon(child.SIGMA, Q, ran, DELTA)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=f"records {charged} steps, but this model's ledger counts 20"):
        model.fit(x, y, batch_size=child.BATCH, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[journal])
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # no step ran

    assert journal.recover(model) == charged - 20
    assert model.privacy.steps == charged >= ran  # may over-count, never under-count
    assert model.privacy.epsilon(DELTA) == pytest.approx(compute_epsilon(child.SIGMA, Q, charged, DELTA))
    assert journal.recover(model) == 0  # idempotent

    # Training goes on from there, journaled; a second kill would be covered too.
    model.fit(x, y, batch_size=child.BATCH, epochs=1, steps_per_epoch=3, verbose=0, callbacks=[journal])
    assert model.privacy.steps == charged + 3
    assert journal.journaled_steps() == charged + 3
    assert model.privacy.epsilon(DELTA) == pytest.approx(compute_epsilon(child.SIGMA, Q, charged + 3, DELTA))


def test_lost_steps_are_charged_with_the_event_they_ran_with(tmp_path):
    """Lost steps at a different sampling rate than the checkpoint's."""
    x, y = child.data()
    journal = tfdp.callbacks.PrivacyJournal(str(tmp_path / "j.jsonl"), frequency="batch")
    model = child.build()
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=4, verbose=0, callbacks=[journal])
    model.save(tmp_path / "ck.keras")
    model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=6, verbose=0, callbacks=[journal])  # then "killed"
    restored = keras.models.load_model(tmp_path / "ck.keras")
    assert journal.recover(restored) == 6
    assert restored.privacy.epsilon(DELTA) == pytest.approx(model.privacy.epsilon(DELTA))
    assert restored.privacy.steps == 10


def write_journal(path, lines):
    with open(path, "wb") as file:
        file.write(b"".join(lines))


def test_torn_last_line_is_ignored_other_damage_is_refused(tmp_path):
    header = json.dumps({"format": "tfdp.PrivacyJournal", "version": 1}).encode() + b"\n"
    event = tfdp.accounting.event_to_dict(tfdp.accounting.dpsgd_event(1.0, 0.25))
    entry = json.dumps({"start": 0, "end": 4, "event": event}).encode() + b"\n"
    path = tmp_path / "j.jsonl"
    journal = tfdp.callbacks.PrivacyJournal(str(path))

    write_journal(path, [header, entry, entry[:20]])  # killed while writing: those steps never started
    assert journal.journaled_steps() == 4
    write_journal(path, [header, entry[:20] + b"\n", entry])
    with pytest.raises(ValueError, match="Corrupt privacy journal .* line 2 is not JSON"):
        journal.journaled_steps()
    write_journal(path, [b'{"format": "other"}\n', entry])
    with pytest.raises(ValueError, match="expected a tfdp.PrivacyJournal header"):
        journal.journaled_steps()
    write_journal(path, [header, json.dumps({"start": 5, "end": 2, "event": event}).encode() + b"\n"])
    with pytest.raises(ValueError, match="line 2 is not an entry"):
        journal.journaled_steps()


def test_a_journal_from_another_run_is_refused(tmp_path):
    x, y = child.data()
    short = tfdp.callbacks.PrivacyJournal(str(tmp_path / "short.jsonl"), frequency="batch")
    model = child.build()
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[short])
    other = child.build()
    other.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=5, verbose=0)
    with pytest.raises(ValueError, match="Mismatched privacy journal: the model's ledger counts 5 steps"):
        other.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=1, verbose=0, callbacks=[short])
    with pytest.raises(ValueError, match="Mismatched privacy journal"):
        short.recover(other)
    assert other.privacy.steps == 5


@pytest.mark.parametrize("kwargs, message", [(dict(path=3), "Received: path=3"), (dict(path="j", frequency="step"), "frequency='step'")])
def test_journal_arguments(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        tfdp.callbacks.PrivacyJournal(**kwargs)


FULL_DISK_CHILD = """
import resource, sys
sys.path.insert(0, {folder!r})
import _train_until_killed as child
import tfdp
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))  # the disk fills at {limit} bytes
x, y = child.data()
model = child.build()
journal = tfdp.callbacks.PrivacyJournal({path!r}, frequency="batch")
model.fit(x, y, batch_size=child.BATCH, epochs=100, steps_per_epoch=child.STEPS_PER_EPOCH,
          verbose=0, callbacks=[journal])
"""


def test_a_journal_torn_by_a_full_disk_stays_readable_after_the_resumed_fit(tmp_path):
    """As the issue reproduced it (`ulimit -f`): the disk fills while a line
    is written, the fit dies, and the journal ends in a fragment. The old code
    ignored the fragment on the first resume but appended the next entry
    right after it, and from then on `journaled_steps()` and `recover` raised
    "Corrupt privacy journal ... is not JSON"."""
    path = str(tmp_path / "journal.jsonl")
    limit = 6000
    script = FULL_DISK_CHILD.format(folder=os.path.dirname(__file__), limit=limit, path=path)
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=600)
    assert process.returncode != 0 and b"File too large" in process.stderr, process.stderr[-2000:]
    data = open(path, "rb").read()
    assert len(data) == limit and not data.endswith(b"\n")  # torn, as a full disk leaves it
    journal = tfdp.callbacks.PrivacyJournal(path, frequency="batch")
    ran = journal.journaled_steps()
    assert ran > 10

    model = child.build()
    assert journal.recover(model) == ran
    x, y = child.data()
    model.fit(x, y, batch_size=child.BATCH, epochs=1, steps_per_epoch=3, verbose=0, callbacks=[journal])
    assert journal.journaled_steps() == ran + 3 == model.privacy.steps
    again = child.build()
    assert journal.recover(again) == ran + 3  # a later crash recovers from the same file
    assert open(path, "rb").read().count(b"\n") == ran + 3 + 1  # one line per step, the header


def test_a_torn_header_is_rewritten(tmp_path):
    """Killed while writing the header itself: the next entry starts the file again."""
    path = str(tmp_path / "j.jsonl")
    with open(path, "wb") as file:
        file.write(b'{"format": "tfdp.Priv')
    journal = tfdp.callbacks.PrivacyJournal(path, frequency="batch")
    assert journal.journaled_steps() == 0
    model = child.build()
    x, y = child.data()
    model.fit(x, y, batch_size=child.BATCH, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[journal])
    assert journal.journaled_steps() == 2
    header = {"format": "tfdp.PrivacyJournal", "version": tfdp.callbacks.PrivacyJournal.VERSION}
    assert open(path, "rb").read().startswith(json.dumps(header).encode() + b"\n")
