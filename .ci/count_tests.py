"""Prints how many tests the suite collects (README and docs/development.md
name this command instead of a number that goes stale).

    python .ci/count_tests.py          # e.g. "2043 tests"
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def collected(output):
    """The count in pytest's "N tests collected" line (None if absent)."""
    found = re.search(r"(\d+) tests? collected", output)
    return int(found.group(1)) if found else None


def main():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=False)
    count = collected(run.stdout)
    if count is None:
        sys.exit(f"pytest collected no count (exit status {run.returncode}):\n{run.stdout[-2000:]}")
    print(f"{count} tests")


if __name__ == "__main__":
    main()
