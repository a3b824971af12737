"""A child process that ends when its parent does, removing its folder.

The private search (`tfdp.tuning.process`) trains its trials in a child
process that writes the chosen model into a temporary folder. If the user's
process dies (SIGKILL, SIGTERM, a crash), nothing in it can run: the child
must notice and end by itself, removing that folder, instead of training
every trial and leaving `chosen.keras` behind. Two ways, either enough:

- the parent keeps open the write end of a pipe whose read end only the
  child holds; a thread of the child blocks reading it, and the read ends
  (EOF) when the parent's process is gone, however it died;
- on Linux, the child also asks the kernel for SIGTERM when its parent
  dies (`prctl(PR_SET_PDEATHSIG)`), handled like the EOF.

`popen` starts such a child; the child calls `watch(folder)` first thing.
The parent removes the folder itself on every path where it runs code.

Example:

```python
child, pipe = popen([sys.executable, "-c", "from tfdp import parent_death; ..."])
try:
    child.wait()
finally:
    os.close(pipe)
```
"""

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading

_PIPE, _PARENT = "TFDP_PARENT_PIPE", "TFDP_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def popen(args, **kwargs):
    """`subprocess.Popen(args, **kwargs)` with the pipe the child watches.

    The child runs in a new session (`start_new_session=True`): a signal to
    the parent's whole process group (a terminal's SIGHUP, `kill -9 -PGID`,
    a job scheduler's kill) does not kill it before it removes its folder;
    it sees the pipe's EOF or the parent-death signal and leaves.

    Returns:
        (the Popen, the pipe's write end): close the write end once the
        child is done (its closing, or this process's death, ends a child
        that still runs).
    """
    read, write = os.pipe()
    env = dict(kwargs.pop("env", None) or os.environ, **{_PIPE: str(read),
                                                        _PARENT: str(os.getpid())})
    try:
        child = subprocess.Popen(args, pass_fds=(read,), env=env, start_new_session=True,
                                 **kwargs)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return child, write


def watch(folder):
    """In a child started by `popen`: ends this process, removing `folder`,
    as soon as the parent is gone (the pipe's EOF, or SIGTERM from the
    kernel on Linux). Does nothing in a process `popen` did not start."""
    fd, parent = os.environ.pop(_PIPE, None), os.environ.pop(_PARENT, None)
    if fd is None or parent is None:
        return

    def leave(*_):
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(1)

    signal.signal(signal.SIGTERM, leave)
    _ask_for_sigterm_at_parent_death()
    if os.getppid() != int(parent):  # died before the request
        leave()
    threading.Thread(target=_until_closed, args=(int(fd), leave), daemon=True,
                     name="tfdp-parent-watch").start()


def _until_closed(fd, leave):
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    leave()


def _ask_for_sigterm_at_parent_death():
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the pipe alone
