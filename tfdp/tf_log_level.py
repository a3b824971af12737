"""`TF_CPP_MIN_LOG_LEVEL` as TensorFlow read it.

TensorFlow's C++ log reads the variable once, when TensorFlow is imported:
setting it later (a notebook's later cell, `os.environ` below the imports)
changes nothing, so the value at `fit` says nothing of whether the log
prints a failing op's message. `import tfdp` imports this module first and
keeps the value then, and whether TensorFlow was imported already;
`tfdp.models.step_errors`, imported right after TensorFlow (importing
TensorFlow imports Keras, whose import makes tfdp register its classes,
`tfdp._keras_registration`, which imports it), keeps the value at its
import too. TensorFlow read the first when it was imported before tfdp
(unless the variable changed between the two imports, which no module of
tfdp sees), else the second (`tfdp train` sets it after `import tfdp`).

Example:

>>> prints_op_errors("2"), prints_op_errors(None), prints_op_errors("1")
(False, True, True)
"""

import os
import sys

ENV = "TF_CPP_MIN_LOG_LEVEL"
_values = [os.environ.get(ENV)]  # at tfdp's import, then at step_errors'
tensorflow_was_imported_first = "tensorflow" in sys.modules


def note_after_tensorflow_import():
    """Keeps the value now (TensorFlow being imported by the caller)."""
    _values.append(os.environ.get(ENV))


def value_tensorflow_read():
    """The value TensorFlow read at its import (None: unset)."""
    if tensorflow_was_imported_first or len(_values) == 1:
        return _values[0]
    return _values[1]


def prints_op_errors(value):
    """Whether TensorFlow's C++ log prints an op's error message at level
    `value`: unset, below 2, or not a number."""
    try:
        return int(value if value is not None else "0") < 2
    except ValueError:
        return True
