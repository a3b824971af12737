"""Ctrl-C during `fit` while a record read blocks (issue 35, item 5).

A SIGINT must stop `fit` after at most the record reads already under way:
no read may start after it, so a slow source (a network disk) stops within
about one record read. The ledger counts exactly the steps that ran, the
journal covers them, and the next `fit` in the same process trains.
"""

import json
import os
import signal
import subprocess
import sys
import time

SECONDS_PER_RECORD = 1.0


def read_log(path):
    if not os.path.exists(path):
        return []
    with open(path) as log:
        return [float(line.split()[0]) for line in log if line.strip()]


def test_sigint_stops_a_fit_blocked_in_record_reads(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "_interrupted_fit.py")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    # stderr to a file: a pipe nobody reads would block the child when full.
    errors = open(tmp_path / "stderr", "wb")  # noqa: SIM115
    process = subprocess.Popen([sys.executable, script, str(tmp_path), str(SECONDS_PER_RECORD)],
                               stdout=subprocess.DEVNULL, stderr=errors, env=env)
    reads = tmp_path / "reads"
    deadline = time.time() + 300
    while len(read_log(reads)) < 6:  # reads are under way, some step is waiting on them
        if process.poll() is not None:
            raise AssertionError(f"child exited early: {(tmp_path / 'stderr').read_text()[-3000:]}")
        assert time.time() < deadline, "the child never started reading"
        time.sleep(0.05)
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=300)  # a hang guard, not a time budget
    finally:
        if process.poll() is None:
            process.kill()
        errors.close()
    stderr = (tmp_path / "stderr").read_text()
    assert process.returncode == 0, stderr[-3000:]
    with open(tmp_path / "result.json") as file:
        result = json.load(file)
    assert result["interrupted"]
    # The reads under way at the signal finish; none starts after it (a small
    # allowance for reads the signal's delivery raced with).
    started_after = [t for t in read_log(reads) if sent + 0.05 < t < result["stopped"]]
    assert len(started_after) == 0, (len(started_after), result["stopped"] - sent)
    # The ledger counts the steps whose updates were applied; the journal covers them.
    assert result["ledger_steps"] == result["applied_steps"]
    assert result["journaled_steps"] >= result["ledger_steps"]
    assert result["second_fit_steps"] == 4
