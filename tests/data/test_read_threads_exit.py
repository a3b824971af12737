"""A record read that never returns cannot keep the interpreter from exiting.

RecordSource reads records in threads. Python joins a ThreadPoolExecutor's
(non-daemon) workers at exit, so a read blocked forever (a network
filesystem, a source waiting on a lock) left the process alive after its
main thread ended: a reliability run once stalled 14 minutes at exit in
`Py_FinalizeEx -> wait_for_thread_shutdown`. Runs in a fresh process.
"""

import pathlib
import subprocess
import sys
import textwrap

import tfdp

ROOT = pathlib.Path(tfdp.__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import threading
    import numpy as np
    from tfdp.data.sources import RecordSource

    reading, never = threading.Event(), threading.Event()

    class Records:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            if i == 3:
                reading.set()
                never.wait()  # a read that never returns
            return np.zeros(2, np.float32), np.int64(i)

    source = RecordSource(Records(), num_threads=2)
    out = [np.zeros((2, 2), np.float32), np.zeros(2, np.int64)]
    # The training pipeline's thread: it waits for the read as long as it lasts.
    threading.Thread(target=source.read_batch, args=([1, 3], out), daemon=True).start()
    reading.wait()
    print("main thread ends", flush=True)
    """
)


def test_the_process_exits_while_a_record_read_blocks():
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        # Importing TensorFlow takes its time; the check starts when the main thread ends.
        assert child.stdout.readline() == "main thread ends\n", child.stderr.read()
        # Exit takes a second or two; a hang is forever (the old code), so
        # 120 s only bounds the test.
        child.wait(timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError("the process did not exit: Python waited for the blocked read's thread")
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, child.stderr.read()
