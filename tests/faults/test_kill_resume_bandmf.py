"""DP-BandMF killed by SIGKILL at random steps under the crash-and-resume
guide's recipe (`noise_state` + `PrivacyJournal` + `BackupAndRestore`), then
resumed by rerunning the same `fit` (issue 44, item 1).

The rerun restores the last epoch-end backup, the journal charges the steps
after it that ran (or were journaled ahead), and, since their noise was lost
with the kill, a new noise stream starts at the journal's count: a new
ledger segment. Checked: the ledger never counts fewer steps than ran, it
equals the journal, the resumed weights hold exactly the steps applied to
them, each stream's rounds are counted apart, and epsilon is at least the
uninterrupted run's. Before the fix every one of these reruns was refused
("saved at model step 8, but the model is at step 16").
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tfdp

sys.path.insert(0, os.path.dirname(__file__))
import _bandmf_until_killed as child  # noqa: E402

DELTA = 1e-5
KILLS = np.random.default_rng(44).integers(1, child.EPOCHS * child.P, size=3)  # fixed seed


def run_and_kill(workdir, mode, frequency, block_at):
    script = os.path.join(os.path.dirname(__file__), "_bandmf_until_killed.py")
    process = subprocess.Popen(
        [sys.executable, script, str(workdir), mode, frequency, str(block_at)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    ready = os.path.join(workdir, "ready")
    deadline = time.time() + 300
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
def uninterrupted_epsilon(tmp_path_factory):
    """The epsilon of the same recipe's run that nobody kills, per mode: one
    run serves both fixed-order tests (the journal's frequency decides when
    it writes its lines, not what the run charges)."""
    epsilons = {}

    def get(mode, frequency):
        if mode not in epsilons:
            folder = str(tmp_path_factory.mktemp(f"straight_{mode}"))
            straight = child.build(folder)
            child.fit(straight, folder, mode, frequency)
            assert straight.privacy.steps == child.EPOCHS * child.P
            epsilons[mode] = straight.privacy.epsilon(DELTA)
        return epsilons[mode]

    return get


def rounds(steps, per_round):
    return -(-steps // per_round)


@pytest.mark.parametrize("mode, frequency, block_at", [
    ("fixed", "epoch", int(KILLS[0])),
    ("fixed", "batch", int(KILLS[1])),
    ("amplified", "batch", int(KILLS[2])),
])
def test_a_killed_bandmf_run_resumes_with_the_guides_recipe(
        tmp_path, uninterrupted_epsilon, mode, frequency, block_at):
    ran = run_and_kill(tmp_path, mode, frequency, block_at)
    assert ran == block_at
    journaled = tfdp.callbacks.PrivacyJournal(str(tmp_path / "journal.jsonl")).journaled_steps()
    assert journaled >= ran
    backed_up = child.P * ((ran - 1) // child.P)  # the last epoch end before the kill

    model = child.build(str(tmp_path))
    with pytest.warns(UserWarning, match=rf"charged {journaled - backed_up} steps .* new "
                                         rf"DP-BandMF noise stream at model step {journaled}"):
        journal = child.fit(model, str(tmp_path), mode, frequency)
    total = child.EPOCHS * child.P
    rerun = total - backed_up  # Keras reruns the epochs after the backup
    assert model.privacy.steps == journaled + rerun == journal.journaled_steps()
    assert model.optimizer.iterations.numpy() == total  # the updates these weights hold
    per_round = child.P if mode == "fixed" else child.BANDS
    counts = [e.count for e in model.privacy.composed_event().events]
    assert counts == [rounds(journaled, per_round), rounds(rerun, per_round)]

    assert model.privacy.epsilon(DELTA) >= uninterrupted_epsilon(mode, frequency)
