"""The messages of tfdp's own record reads that failed, for the step's error.

A record read runs in a `tf.numpy_function` of the input pipeline
(`tfdp.data.reader`); when it raises, TensorFlow re-raises the Python
error's text, with the op's annotations, from the train step. The step's
error wrapper (`tfdp.models.step_errors`) withholds that text unless it is
one known to hold no value (`value_free`: tf.data's count of a pipeline
shorter than its `assert_cardinality`, a fixed-order pipeline's changed
order), or one tfdp wrote: an exception raised by tfdp's own code (the
last frame of its traceback is in the `tfdp` package), whose messages
name a record by position, never by value ("Reading record 15 of list failed (ValueError)",
"Record 23 has a label outside [0, 2]"). Those messages are kept here as
they were raised, and the wrapper shows the kept text, never TensorFlow's:
an error of a `tf.data` pipeline of the user's own (validation data), or
one a user's `check` raised, is withheld.

Example:

>>> import numpy as np
>>> from tfdp.data.sources import RecordSource
>>> source = RecordSource([(np.zeros(1), 0), (np.zeros(2), 0)])
>>> try:
...     remembering(source.__getitem__)(1)
... except ValueError as error:
...     message = str(error)
>>> found_in(f"ValueError: {message}\\n [[IteratorGetNext]]") == message
True
>>> found_in("ValueError: could not convert 'SECRET-ID-4711'") is None
True
"""

import collections
import os
import re
import threading

_KEPT = 64  # the latest messages; a step's error is raised right after its read
_messages = collections.deque(maxlen=_KEPT)
_lock = threading.Lock()
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# What TensorFlow writes before an op's message: where the node was made.
_DETECTED_AT = (r"(Graph execution error:\s*)?(Detected at node \S+ defined at \(most recent call "
                r"last\):\s*((File \"[^\"\n]*\", line \d+, in [^\n]*|<stack traces unavailable>)\s*)*)?"
                # tf.data's, for an error in a dataset's function
                r"(Error in user-defined function passed to \w+:\d+ transformation with iterator: "
                r"[\w:]+: )?")
_value_free = []


def value_free(pattern):
    """Declares the messages that match `pattern` (a regular expression for
    the whole message, TensorFlow's annotations removed) free of record
    values: a pipeline op's own, worded by tfdp or tf.data with counts and
    positions only."""
    _value_free.append(re.compile(_DETECTED_AT + pattern))


def is_value_free(message):
    """Whether `message` (annotations removed) is wholly one declared by
    `value_free`: nothing else, such as a record's text, is in it."""
    return any(pattern.fullmatch(message) for pattern in _value_free)


# tf.data's, for a pipeline shorter than its `assert_cardinality`.
value_free(r"Input dataset was expected to contain \d+ elements? but contained only \d+ elements?\.")


def raised_by_tfdp(error):
    """Whether `error` was raised by tfdp's own code: its traceback's last
    frame is a file of the `tfdp` package (an error of a user's function
    that tfdp calls ends in the user's frame; NumPy's, raised in C, ends in
    tfdp's, and names shapes and dtypes)."""
    frame = error.__traceback__
    if frame is None:
        return False
    while frame.tb_next is not None:
        frame = frame.tb_next
    return os.path.abspath(frame.tb_frame.f_code.co_filename).startswith(_PACKAGE)


def remembering(read):
    """`read`, keeping the message of an exception it raises when tfdp's
    code raised it (`raised_by_tfdp`); the exception propagates unchanged."""

    def run(*args):
        try:
            return read(*args)
        except Exception as error:
            if raised_by_tfdp(error):
                with _lock:
                    _messages.append(str(error))
            raise

    return run


def found_in(text):
    """The longest kept message that `text` holds, or None."""
    with _lock:
        kept = list(_messages)
    found = [message for message in kept if message and message in text]
    return max(found, key=len) if found else None
