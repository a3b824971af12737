"""Keeping the number of trials out of names, logs and tracebacks.

Every `build(hp)` advances Keras's name counters (`dense_7`, the variable
paths under it), and TensorFlow counts the functions it traces, printing
"5 out of the last 5 calls ... triggered tf.function retracing" and keeping
the count after the search. Either would tell the number of trials. A
search builds every model from the same name counters (`NameCounters`),
runs its trials with tfdp's and TensorFlow's loggers silenced and leaves
TensorFlow's retracing counts as it found them (`quiet_trials`), and
re-raises an error without the frames of the trials (`without_frames`).
TensorFlow's own process-wide uid counter cannot be set back: a search runs
in a child process (`tfdp.tuning.process`), which reports an error's type
and withholds its message, unless the error is a `Refusal`.

Example:

>>> import keras
>>> counters = NameCounters()
>>> first = counters.build(lambda hp: keras.layers.Dense(1), None)
>>> second = counters.build(lambda hp: keras.layers.Dense(1), None)
>>> first.name == second.name
True
"""

import collections
import contextlib
import logging
import traceback

from keras.src.backend.common import global_state
from tensorflow.python.eager.polymorphic_function import polymorphic_function

from tfdp.preprocessing import provenance

_UIDS = "object_name_uids"  # keras.backend.get_uid's counters


def _uids():
    return dict(global_state.get_global_attribute(_UIDS, default={}) or {})


def _set_uids(values):
    global_state.set_global_attribute(_UIDS, collections.defaultdict(int, values))


class NameCounters:
    """Keras's name counters, set back before every build of a search."""

    def __init__(self):
        self._start = _uids()

    def build(self, build, hp):
        """`build(hp)` with the counters as they were when the search began
        (and `adapt_privately` refused in it)."""
        _set_uids(self._start)
        with provenance.inside_search_build():
            try:
                return build(hp)
            except provenance.AdaptationInSearch as error:
                raise Refusal(str(error)) from None

    def after(self):
        """The counters now (after the build just run)."""
        return _uids()

    def leave(self, values=None):
        """Leaves the counters at `values` (one trial's worth), or as found."""
        _set_uids(self._start if values is None else values)


@contextlib.contextmanager
def quiet_trials():
    """Silences tfdp's and TensorFlow's loggers (tfdp logs one line per
    traced step, TensorFlow warns about retracing) and restores TensorFlow's
    retracing counts on exit."""
    loggers = [logging.getLogger("tfdp"), logging.getLogger("tensorflow")]
    levels = [logger.level for logger in loggers]
    detectors = _tracing_detectors()
    saved = {key: _counts(detector) for key, detector in detectors.items()}
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for key in [key for key in detectors.keys() if key not in saved]:
            del detectors[key]
        for key, counts in saved.items():
            if key in detectors:
                _set_counts(detectors[key], counts)
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# pylint: disable=protected-access
def _tracing_detectors():
    """TensorFlow's per-function retracing counts (a private table)."""
    return polymorphic_function._frequent_tracing_detector_manager._detectors


_COUNTS = ("_calls_per_tracings", "_call_count", "_total_warning_count")


def _counts(detector):
    return {name: getattr(detector, name) for name in _COUNTS} | {
        "_calls_per_tracings": list(detector._calls_per_tracings)}


def _set_counts(detector, counts):
    for name, value in counts.items():
        setattr(detector, name, value)
# pylint: enable=protected-access


class Refusal(ValueError):
    """A search's own refusal of a hypermodel, raised before any record is
    read: its message names only hyperparameters, their values, Keras paths
    (set back before every build) and types, never a TensorFlow counter, so
    the search re-raises it with its message (as a ValueError).

    Example:

    >>> isinstance(Refusal("a shared layer"), ValueError)
    True
    """


def rebuilt(kind, message):
    """An exception of type `kind` with `message`, or a RuntimeError naming
    the type when `kind` cannot be rebuilt from a message alone.

    Example:

    >>> type(rebuilt(ValueError, "bad")).__name__, str(rebuilt(KeyError, "k"))
    ('ValueError', 'KeyError: k')
    """
    try:
        fresh = kind(message)
    except Exception:  # noqa: BLE001 - any constructor that does not take a message
        fresh = None
    if fresh is None or str(fresh) != message:
        fresh = RuntimeError(f"{kind.__name__}: {message}")
    return fresh


def without_frames(error):
    """A new exception of `error`'s type and message, with no traceback or
    context: the frames of the trials (their models, the number of trials)
    are cleared and left behind. A type that cannot be rebuilt from its
    message becomes a RuntimeError naming it.

    Example:

    >>> fresh = without_frames(ValueError("bad value"))
    >>> type(fresh).__name__, str(fresh), fresh.__traceback__
    ('ValueError', 'bad value', None)
    """
    message = str(error)
    chained = error
    while chained is not None:
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__
    return rebuilt(type(error), message)
