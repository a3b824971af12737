"""A short run of benchmarks/stress_fits.py: 10 fits in one process, one of
each scenario (epoch ends, early stops, exceptions and KeyboardInterrupt
from callbacks, memmaps, a RecordSource, physical batches, XLA, DPIS), each
with a hang watchdog; the scenarios share their model, so a fit follows
each failed one. The hang it hunts struck about one fit in 185: the
1,000-fit run, the script's default, is the search for it."""

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "stress_fits.py")


def test_ten_short_fits_finish():
    done = subprocess.run([sys.executable, SCRIPT, "--fits", "10", "--fit-timeout", "300",
                           "--timeout", "1200"], capture_output=True, text=True, timeout=1300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "10 of 10 fits finished" in done.stdout
