"""Errors of the private train step keep the records' values out of their text.

An op that fails on a value (`tf.strings.to_number` on a word, a gather
with an id out of range, `DecodeCSV` on a malformed line) raises an
`InvalidArgumentError` whose message quotes that value: a private record's
raw field in a traceback, a log or a notebook's output, which no epsilon
covers (a review of this round found a record's id so). A DP model's train,
test and predict functions therefore re-raise TensorFlow's op errors as the same
error class naming the failing node (the layer and op, which the model
fixes, not the data) and withhold TensorFlow's message. The original error
is not chained (`__cause__` and `__context__` are empty), so no handler or
logger prints it. The failing node is the one TensorFlow's LAST
annotation names (`annotated_nodes`): TensorFlow appends its `[[...]]`
lines after the op's message, which can quote a record that holds such a
line itself ("SECRET [[IteratorGetNext]]").

`tf.errors.OutOfRangeError`, the end of the data Keras waits for, passes
unchanged. An error of the input pipeline (raised at Keras's iterator
node, `IteratorGetNext`, or `IteratorGetNextAsOptional` inside Keras's loop
when steps_per_execution > 1; never a node under the model's scope)
keeps its text only when that text cannot carry a value: a message of
tfdp's own record reads (`tfdp.data.read_failures`: "Reading record 15 of
list failed (ValueError)", "Record 23 has a label outside [0, 2]", which
name records by position), shown as tfdp wrote it, or one declared
value-free (tf.data's count for a pipeline shorter than its
`assert_cardinality`, the fixed-order pipeline's changed order). Any other
pipeline error, such as a `tf.data` pipeline of your own for
`validation_data` or `evaluate` failing on a held-out record, is withheld
naming the iterator node: held-out records are as private as training ones.

To read the full message while debugging on data that is not private, set
the environment variable `TFDP_SHOW_STEP_ERRORS=1`: the message then
prints record values. TensorFlow's C++ log also prints a failing op's
message as a warning unless `TF_CPP_MIN_LOG_LEVEL=2` (or higher) is set
before TensorFlow is imported (docs/faq.md, quieting TensorFlow); it reads
the variable then only. A DP model warns once per process when the value
TensorFlow read (`tfdp.tf_log_level`) was not 2 or higher, including when
it was set after TensorFlow's import (`warn_if_tf_logs_op_errors`), and the
withheld message says so.

Example:

>>> import tensorflow as tf
>>> def step(words):
...     return tf.strings.to_number(words)
>>> private = without_record_values(step)
>>> try:
...     private(tf.constant(["1.5", "patient-4711"]))
... except tf.errors.InvalidArgumentError as error:
...     print("patient-4711" in str(error), error.__context__ is None)
False True
"""

import functools
import os
import re
import warnings

import tensorflow as tf

from tfdp import tf_log_level
from tfdp.data import read_failures
from tfdp.record_values import SHOW_ENV, record_values_shown

tf_log_level.note_after_tensorflow_import()

TF_LOG_ENV = "TF_CPP_MIN_LOG_LEVEL"
_TF_LOG_NOTE = (
    f"TensorFlow's C++ log prints a failing op's message, which can quote a record's value, on "
    f"stderr unless {TF_LOG_ENV}=2 is set before TensorFlow is imported (docs/faq.md)."
)
_warned = False  # warn_if_tf_logs_op_errors: once per process
# TensorFlow appends `[[{{node X}}]]` / `[[X]]` lines after the op's message
# (which can quote a record, even one holding such a line) and `[Op:...]`.
_ANNOTATION_AT_END = re.compile(r"\s*\[\[(?:\{\{node )?([^\[\]{}\s]+?)(?:\}\})?\]\]\s*$")
_OP_AT_END = re.compile(r"\s*\[Op:[^\[\]]*\]\s*$")
# Keras's iterator node: `IteratorGetNext`, or with steps_per_execution > 1
# `IteratorGetNextAsOptional` inside Keras's loop (never under a model's scope).
_ITERATOR = re.compile(r"((while|body|cond|then|else|_\d+|(while|cond)_\d+)/)*"
                       r"IteratorGetNext(AsOptional)?")


def tf_log_prints_op_errors():
    """Whether TensorFlow's C++ log prints an op's error message:
    `TF_CPP_MIN_LOG_LEVEL` was unset, below 2 or not a number when
    TensorFlow was imported (`tfdp.tf_log_level`; it reads it then only)."""
    return tf_log_level.prints_op_errors(tf_log_level.value_tensorflow_read())


def warn_if_tf_logs_op_errors():
    """At a DP model's `fit`, and when its train, test or predict function
    is made: warns, once per process, that TensorFlow's C++ log would print
    the message of an op that fails on a record's value (which the Python
    error withholds), unless record values are shown anyway
    (`TFDP_SHOW_STEP_ERRORS=1`) or the log is quiet. Changes nothing."""
    global _warned  # pylint: disable=global-statement
    if _warned or record_values_shown() or not tf_log_prints_op_errors():
        return
    _warned = True
    then = tf_log_level.value_tensorflow_read() or "unset"
    now = os.environ.get(TF_LOG_ENV)
    changed = (" (a change after TensorFlow's import has no effect)"
               if not tf_log_level.prints_op_errors(now) else "")
    warnings.warn(
        f"{TF_LOG_ENV} is {now or 'unset'} now and was {then} when TensorFlow was imported, "
        f"which is when TensorFlow reads it{changed}: if an op of the private step fails on a "
        "record's value, tfdp withholds TensorFlow's message from the error, but TensorFlow's "
        "C++ log prints it on stderr, where it can quote the record. Set "
        f"{TF_LOG_ENV}=2 before TensorFlow is imported (in the shell, or os.environ at the "
        "top of the script, above every import) to quiet it (docs/faq.md).",
        UserWarning, stacklevel=5)


def annotated_nodes(message):
    """The nodes TensorFlow annotated `message` with, in order: the
    `[[{{node X}}]]` / `[[X]]` lines at its end. Only the last is surely
    TensorFlow's: the op's own text before them can quote a record that
    holds such a line.

    Example:

    >>> annotated_nodes("bad: x [[IteratorGetNext]]\\n\\t [[{{node model/ToNumber}}]] [Op:f]")
    ['IteratorGetNext', 'model/ToNumber']
    """
    return _split_annotations(message)[1]


def _split_annotations(message):
    """`(text, nodes)`: `message` less the annotations at its end, and
    their nodes in order."""
    text = _OP_AT_END.sub("", message or "")
    nodes = []
    while (found := _ANNOTATION_AT_END.search(text)) is not None:
        nodes.insert(0, found.group(1))
        text = text[:found.start()]
    return text.strip(), nodes


def failed_node(error):
    """The node `error` was raised at (its op's name where TensorFlow gives
    it, else its message's last annotation), or None."""
    op = getattr(error, "op", None)
    if getattr(op, "name", None):
        return op.name
    nodes = annotated_nodes(error.message)
    return nodes[-1] if nodes else None


def from_input_pipeline(error):
    """Whether `error` was raised at Keras's iterator node (reading the
    step's data), not at an op of the step."""
    node = failed_node(error)
    return node is not None and _ITERATOR.fullmatch(node) is not None


def withheld_message(error, step="train step"):
    """The text that replaces `error`'s message: the `step` ("train step",
    "test step", "predict step") and the node that failed, and why the rest
    is withheld."""
    node = failed_node(error)
    where = f"in node {node!r}" if node else "in an op of the step"
    return (
        f"The private {step} failed {where} ({type(error).__name__}). TensorFlow's "
        "message is withheld because it can quote values of the batch's private records. "
        "Check the inputs this layer reads (their dtype, range and format) on data that is "
        f"not private, or set {SHOW_ENV}=1 to see the full message (it prints record values)."
        + _log_note()
    )


def pipeline_message(error):
    """The text that replaces the message of `error`, raised reading the
    step's data: TensorFlow's when it is one known to hold no value
    (`tfdp.data.read_failures.is_value_free`), a tfdp record read's own message
    (`tfdp.data.read_failures`, which names records by position), else a
    withheld one naming the iterator node."""
    node = failed_node(error)
    if read_failures.is_value_free(_split_annotations(error.message)[0]):
        return error.message
    kept = read_failures.found_in(error.message or "")
    if kept is not None:
        named = re.search(r"(?<![\w.])([A-Za-z_][\w.]*(Error|Exception|Stopped)): "
                          + re.escape(kept), error.message)  # the exception's class
        return (f"{named.group(1) + ': ' if named else ''}{kept}\n"
                f"(raised reading the step's records, at the input pipeline's node {node!r})")
    return (
        f"The input pipeline failed at node {node!r} ({type(error).__name__}). TensorFlow's "
        "message is withheld because it can quote values of the records it read (a tf.data "
        "pipeline of your own, e.g. validation_data's, is read there). Check the pipeline on "
        f"data that is not private, or set {SHOW_ENV}=1 to see the full message (it prints "
        "record values)." + _log_note()
    )


def _log_note():
    return f" {_TF_LOG_NOTE}" if tf_log_prints_op_errors() else ""


def _same_class(error, message):
    """An error of `error`'s class with `message` (UnknownError for a bare
    OpError, whose constructor also needs a code)."""
    try:
        return type(error)(None, None, message)
    except TypeError:
        return tf.errors.UnknownError(None, None, message)


def without_record_values(function, step="train step"):
    """`function` whose TensorFlow op errors no longer quote record values.

    Args:
        function: a callable, e.g. Keras's `train_function`; None passes.
        step: what `function` runs, for the message ("predict step").

    Returns:
        A callable raising, for a `tf.errors.OpError` (not
        `OutOfRangeError`), the same error class with `withheld_message`
        (an op of the step) or `pipeline_message` (the input pipeline's),
        not chained to the original. `function` itself when it is None,
        already wrapped, or when `TFDP_SHOW_STEP_ERRORS=1`.
    """
    if function is None or getattr(function, "_tfdp_without_record_values", False):
        return function
    warn_if_tf_logs_op_errors()  # predict on a DP model that never ran fit, too
    if record_values_shown():
        return function

    @functools.wraps(function)
    def run(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except tf.errors.OutOfRangeError:
            raise
        except tf.errors.OpError as error:
            message = (pipeline_message(error) if from_input_pipeline(error)
                       else withheld_message(error, step))
            replacement = _same_class(error, message)
        raise replacement  # outside the handler: nothing chains the original

    run._tfdp_without_record_values = True
    return run
