"""KerasHub tests: skipped without keras_hub, failed under CI=true (the
`test` extra installs it)."""

import os

import pytest


@pytest.fixture
def keras_hub():
    try:
        import keras_hub as module
    except ImportError:
        message = "keras_hub is not installed; install it with: pip install 'tfdp[hub]'"
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true and an install step did not run: {message}", pytrace=False)
        pytest.skip(message)
    return module
