"""README's test command names a failure as it happens and stops on Ctrl-C.

Each test runs `python -m pytest -q -n 2` (README's command) on the two
child tests below (which run only under TFDP_RUN_CONTROL_CHILD) in a fresh
process group.

Ctrl-C: a shell runs a script's background job with SIGINT ignored, and
Python keeps an ignored SIGINT ignored, so such a run went on through any
number of Ctrl-C's (the first session of issue 45 saw it ignore two);
tests/conftest.py gives it back Python's handler.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHILD = "TFDP_RUN_CONTROL_CHILD"
child_only = pytest.mark.skipif(not os.environ.get(CHILD), reason="a child of test_run_control")


@child_only
def test_child_fails():
    assert 1 + 1 == 3, "a deliberate failure"


@child_only
def test_child_waits(tmp_path_factory):
    pathlib.Path(os.environ[CHILD], "waiting").write_text("")
    time.sleep(float(os.environ.get("TFDP_RUN_CONTROL_WAIT", "0")))


def run_children(folder, wait, ignore_sigint=False):
    def child_setup():
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadgroup", "tests/test_run_control.py", "-k", "test_child"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, CHILD: str(folder), "TFDP_RUN_CONTROL_WAIT": str(wait)},
        start_new_session=True, preexec_fn=child_setup,
    )


def test_a_failure_is_named_before_the_run_ends(tmp_path):
    process = run_children(tmp_path, wait=0)
    output, _ = process.communicate(timeout=300)
    named = "FAILED tests/test_run_control.py::test_child_fails"
    assert named in output, output
    summary = output.index("= FAILURES =") if "= FAILURES =" in output else len(output)
    assert output.index(named) < summary, output


def test_ctrl_c_stops_a_run_started_with_sigint_ignored(tmp_path):
    process = run_children(tmp_path, wait=600, ignore_sigint=True)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "waiting").exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail("the run went on after SIGINT")
    assert "KeyboardInterrupt" in output, output
