"""`TF_CPP_MIN_LOG_LEVEL` as TensorFlow read it.

TensorFlow's C++ log reads the variable once, when TensorFlow is imported:
setting it later (a notebook's later cell, `os.environ` below the imports)
changes nothing, so the value at `fit` says nothing of whether the log
prints a failing op's message. `import tfdp` imports this module first and
keeps the value then, and whether TensorFlow was imported already;
`tfdp.models.step_errors`, imported right after TensorFlow (importing
TensorFlow imports Keras, whose import makes tfdp register its classes,
`tfdp._keras_registration`, which imports it), keeps the value at its
import too. TensorFlow read the second when it was imported after tfdp
(`tfdp train` sets it after `import tfdp`). When TensorFlow was imported
first it read a value between the process's start and tfdp's import: the
value at tfdp's import where the process started with that same value
(Linux's /proc/self/environ keeps the start's environment, which later
changes to os.environ do not reach), else `UNKNOWN` (a notebook's cell that
sets the variable after an earlier cell imported TensorFlow; or no /proc),
which counts as a log that prints.

Example:

>>> prints_op_errors("2"), prints_op_errors(None), prints_op_errors("1")
(False, True, True)
"""

import os
import sys

ENV = "TF_CPP_MIN_LOG_LEVEL"
# What TensorFlow read when that cannot be known: taken as a log that prints.
UNKNOWN = "unknown (not the value the process started with)"


def value_at_start(path="/proc/self/environ"):
    """The variable's value when the process started (None: unset), which
    later changes to os.environ do not alter; `UNKNOWN` where `path` cannot
    be read (no /proc).

    Example:

    >>> value_at_start("/nonexistent") == UNKNOWN
    True
    """
    try:
        with open(path, "rb") as start:
            entries = start.read().split(b"\0")
    except OSError:
        return UNKNOWN
    prefix = ENV.encode() + b"="
    for entry in entries:
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace")
    return None


_values = [os.environ.get(ENV)]  # at tfdp's import, then at step_errors'
tensorflow_was_imported_first = "tensorflow" in sys.modules
_at_start = value_at_start() if tensorflow_was_imported_first else None


def note_after_tensorflow_import():
    """Keeps the value now (TensorFlow being imported by the caller)."""
    _values.append(os.environ.get(ENV))


def value_tensorflow_read():
    """The value TensorFlow read at its import (None: unset; `UNKNOWN`)."""
    if tensorflow_was_imported_first:
        return _values[0] if _at_start == _values[0] else UNKNOWN
    if len(_values) == 1:
        return _values[0]
    return _values[1]


def prints_op_errors(value):
    """Whether TensorFlow's C++ log prints an op's error message at level
    `value`: unset, below 2, or not a number."""
    try:
        return int(value if value is not None else "0") < 2
    except ValueError:
        return True
