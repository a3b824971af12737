"""The private search's child ends with its parent, removing its folder
(issue 55, item 3).

A SIGKILL or SIGTERM of the user's process left the child training every
trial and `chosen.keras` with `result.json` in a temporary folder forever.
These tests run `tfdp.parent_death` as `tfdp.tuning.process` does, with a
parent and a child that import no TensorFlow (about a second each); the
negative control is a child that does not call `watch`.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The parent takes SIGHUP's default action (it ends), as a terminal's
# process does, also when the test run itself was started under `nohup`
# (which ignores SIGHUP in every process it starts).
PARENT = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGHUP, signal.SIG_DFL)
sys.path.insert(0, {root!r})
from tfdp import parent_death
child_code = ("import sys, time; sys.path.insert(0, {root!r}); from tfdp import parent_death; "
              + ("parent_death.watch(sys.argv[1]); " if {watch} else "")
              + "open(sys.argv[1] + '/chosen.keras', 'w').close(); time.sleep(900)")
child, pipe = parent_death.popen([sys.executable, "-c", child_code, {folder!r}])
print(child.pid, flush=True)
time.sleep(900)
"""


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_until(condition, seconds):
    """Polls `condition` until it holds or `seconds` pass (a generous bound:
    a loaded machine delays a process's start and exit by many seconds, and
    a test that waits on a condition ends as soon as it holds)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def kill_parent(tmp_path, sig, watch=True, patience=300, group=False):
    """Kills the parent (with `group`, its whole process group: the parent
    leads its own) once the child wrote its file, then waits up to
    `patience` seconds for the child to end."""
    folder = tmp_path / "tfdp-search-x"
    folder.mkdir()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(root=ROOT, folder=str(folder), watch=watch)],
        stdout=subprocess.PIPE, text=True, start_new_session=group)
    child = int(parent.stdout.readline())
    assert wait_until((folder / "chosen.keras").exists, 300), "the child never wrote its file"
    (os.killpg if group else os.kill)(parent.pid, sig)
    parent.wait(timeout=300)
    wait_until(lambda: not alive(child) and not folder.exists(), patience)
    return child, folder


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_child_ends_with_its_parent_and_removes_the_folder(tmp_path, sig):
    child, folder = kill_parent(tmp_path, sig)
    assert not alive(child)
    assert not folder.exists()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_killing_the_parents_process_group_also_removes_the_folder(tmp_path, sig):
    """A terminal's hang-up or `kill -9 -PGID` reaches every process of the
    group at once: the child, in its own session, still removes the folder."""
    child, folder = kill_parent(tmp_path, sig, group=True)
    assert not alive(child)
    assert not folder.exists()


def test_the_child_deletes_the_pickled_trials_before_it_imports_tensorflow(tmp_path):
    """A child killed while importing (here: by a `tfdp` whose import kills
    its process) leaves no copy of the private data on disk."""
    pytest.importorskip("cloudpickle")
    from tfdp.tuning import process

    dying = tmp_path / "dying" / "tfdp"
    dying.mkdir(parents=True)
    (dying / "__init__.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    folder = tmp_path / "tfdp-search-x"
    folder.mkdir()
    (folder / "trials.pkl").write_bytes(b"record 7781-unique private bytes")
    child = subprocess.run([sys.executable, "-c", process._CHILD, str(folder),
                            str(dying.parent)], timeout=60)
    assert child.returncode == -signal.SIGKILL  # it died importing tfdp
    assert not (folder / "trials.pkl").exists()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_negative_control_a_child_that_does_not_watch_outlives_its_parent(tmp_path):
    child, folder = kill_parent(tmp_path, signal.SIGKILL, watch=False, patience=1)
    try:
        assert alive(child) and (folder / "chosen.keras").exists()
    finally:
        os.kill(child, signal.SIGKILL)


def test_the_search_starts_its_child_watching_the_parent():
    pytest.importorskip("cloudpickle")
    from tfdp.tuning import process

    assert "parent_death.watch(sys.argv[1])" in process._CHILD
    assert process._CHILD.index("parent_death.watch") < process._CHILD.index("tuning import")
