"""Shared fixtures.

`installed`: tests that need a file an install step provides call
`installed(path, how)`. Locally a missing install skips the test; under
CI=true it fails the run, so CI never goes green with a silently skipped test.
"""

import os

import pytest


def require_installed(path, how):
    """Skips (fails under CI=true) unless `path` exists; `how` installs it."""
    if os.path.exists(path):
        return
    message = f"{path} is missing; install it with: {how}"
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        pytest.fail(f"CI=true and an install step did not run: {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture
def installed():
    return require_installed
