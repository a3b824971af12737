"""The scenario launcher's watchdog (`_launch.run_all`) tells a slow process
from a hung one by the CPU time it uses, not by a wall-clock budget: on a
loaded machine (the fixture's fixed 300 s gave 29 errors at load 5 to 9) a
slow process only takes longer. Stub processes (no TensorFlow) stand in for
the scenarios; each test takes a few seconds."""

import os
import textwrap
import time

import pytest

import _launch

STUB = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    mode, seconds, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    start = time.process_time()
    if mode == "busy":        # slow but working: CPU time, then results
        while time.process_time() - start < seconds:
            pass
    elif mode == "sleep":     # hung: waits on nothing, uses no CPU
        time.sleep(seconds)
    elif mode == "spin":      # runaway: never ends on its own
        while True:
            pass
    elif mode == "fail":
        sys.exit(3)
    np.savez(out, mode=np.array(mode))
    """
)

pytestmark = pytest.mark.skipif(_launch.cpu_seconds(os.getpid()) is None,
                                reason="the watchdog reads CPU time from Linux's /proc")

# Small windows so that each test takes seconds: hung means less than 0.05 s
# of CPU in 2 s (2.5% of a core), which a busy process gets at any load a
# test machine sees.
FAST = dict(stall_seconds=2.0, min_cpu_seconds=0.05, cpu_budget_seconds=30.0)


def run(tmp_path, jobs, **limits):
    script = tmp_path / "stub.py"
    script.write_text(STUB)
    return _launch.run_all({name: (args, None) for name, args in jobs.items()}, tmp_path,
                           script=script, **{**FAST, **limits})


def test_a_process_slower_than_the_stall_window_finishes(tmp_path):
    """3 s of CPU (more wall time on a loaded machine) against a 2 s window:
    a fixed budget of 2 s fails this run, the watchdog lets it finish."""
    start = time.monotonic()
    results = run(tmp_path, {"slow": ["busy", "3"], "quick": ["busy", "0.1"]})
    assert time.monotonic() - start > FAST["stall_seconds"]
    assert str(results["slow"]["mode"]) == "busy" and str(results["quick"]["mode"]) == "busy"


def test_a_hung_process_is_ended_with_a_reason(tmp_path):
    with pytest.raises(AssertionError, match=r"hung: in the last \d+ s they used") as error:
        run(tmp_path, {"hung": ["sleep", "600"], "done": ["busy", "0.1"]})
    assert "--- hung ---" in str(error.value)


def test_a_runaway_process_is_ended_at_the_cpu_budget(tmp_path):
    with pytest.raises(AssertionError, match=r"runaway: they used \d+ s of CPU, more than the budget of 1 s"):
        run(tmp_path, {"spin": ["spin", "0"]}, cpu_budget_seconds=1.0)


def test_a_failed_process_ends_the_others_at_once(tmp_path):
    """With the stall rule off, only the failure can end the sleeper (else
    pytest-timeout fails the test)."""
    with pytest.raises(AssertionError, match=r"\['failed'\] exited with codes \[3\]"):
        run(tmp_path, {"failed": ["fail", "0"], "hung": ["sleep", "100000"]},
            stall_seconds=float("inf"))
