"""A short run of benchmarks/stress_fits.py: 20 fits in one process (two of
each scenario: epoch ends, early stops, exceptions and KeyboardInterrupt from
callbacks, memmaps, a RecordSource, physical batches, XLA, DPIS), each with a
hang watchdog. The 1,000-fit run is the script's default."""

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "stress_fits.py")


def test_twenty_short_fits_finish():
    done = subprocess.run([sys.executable, SCRIPT, "--fits", "20", "--fit-timeout", "300",
                           "--timeout", "1200"], capture_output=True, text=True, timeout=1300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "20 of 20 fits finished" in done.stdout
