"""The compiled ops the per-example tests compare with their references."""

import os

import pytest


def required_library(loaded, what):
    """The library of `loaded` ((library or None, reason), a module's
    `_load()`), or a skip naming the reason; under CI=true a failure (CI
    must have the compiled ops)."""
    library, reason = loaded
    if library is None:
        message = f"the compiled {what} are unavailable here: {reason}"
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    return library
