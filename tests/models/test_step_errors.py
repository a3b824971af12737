"""An op that fails on a private record's value does not quote it (review 7, F5).

`tf.strings.to_number` on a crafted record's field raises an
InvalidArgumentError whose message holds the field; a DP model's train
function re-raises it naming the node only, not chained to the original.
"""

import os
import traceback
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import tf_log_level
from tfdp.data import read_failures
from tfdp.models import step_errors
from tests.record_canary import CANARY, dp_parsing_model as parsing_model


RECORDS = np.array([["1.5"]] * 15 + [[CANARY]])
LABELS = np.zeros(16, "int64")


def test_a_failing_step_names_the_node_and_not_the_record(capfd):
    model = parsing_model()
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        model.fit(RECORDS, LABELS, batch_size=16, epochs=1, verbose=0)
    error = raised.value
    shown = "".join(traceback.format_exception(error)) + repr(error.args)
    assert CANARY not in shown and CANARY not in str(error.message)
    assert error.__cause__ is None and error.__context__ is None
    assert "to_number" in str(error) and "TFDP_SHOW_STEP_ERRORS" in str(error)
    out, err = capfd.readouterr()
    assert CANARY not in out + err


def test_the_end_of_the_data_passes_unchanged():
    def ends():
        raise tf.errors.OutOfRangeError(None, None, "End of sequence")

    with pytest.raises(tf.errors.OutOfRangeError, match="End of sequence"):
        step_errors.without_record_values(ends)()


def test_with_the_escape_hatch_the_message_quotes_the_record(monkeypatch):
    """Negative control: TensorFlow's own message, which the default
    withholds, holds the canary (the variable is read when fit makes the
    train function)."""
    monkeypatch.setenv(step_errors.SHOW_ENV, "1")
    with pytest.raises(tf.errors.InvalidArgumentError, match=CANARY):
        parsing_model().fit(RECORDS, LABELS, batch_size=16, epochs=1, verbose=0)


ITERATOR_NODES = [
    "IteratorGetNext", "{{node IteratorGetNext}}", "IteratorGetNextAsOptional",
    # steps_per_execution > 1: the read runs inside Keras's while loop (CI, stop 57)
    "while/body/_1/while/cond_1/then/_114/while/cond_1/IteratorGetNextAsOptional"]


def pipeline_error(text, iterator_node):
    """A function raising TensorFlow's error for `text` raised in the input
    pipeline (a numpy_function) and annotated with `iterator_node`."""
    def reads():
        raise tf.errors.InvalidArgumentError(
            None, None, f"ValueError: {text}\nTraceback (most recent call last):\n\n"
                        f"ValueError: {text}\n\t [[{{{{node PyFuncStateless}}}}]]"
                        f"\n\t [[{iterator_node}]] [Op:__inference_multi_step_on_iterator_1]")
    return reads


def tfdp_read_failure():
    """The message of a real tfdp record read that failed (kept by
    `tfdp.data.read_failures`, as the reader keeps it)."""
    source = tfdp.data.RecordSource([(np.zeros(1, "float32"), 0), (np.zeros(2, "float32"), 0)])
    with pytest.raises(ValueError) as raised:
        read_failures.remembering(source.__getitem__)(1)
    return str(raised.value)


@pytest.mark.parametrize("iterator_node", ITERATOR_NODES)
def test_the_input_pipelines_own_errors_pass_unchanged(iterator_node):
    """tfdp's data sources name a bad record by position; their error, raised
    at IteratorGetNext (or its optional form, at any depth of the step's
    loop), keeps its message."""
    message = tfdp_read_failure()
    assert message.startswith("Record 1 does not match record 0")
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        step_errors.without_record_values(pipeline_error(message, iterator_node))()
    assert f"ValueError: {message}" in str(raised.value)


@pytest.mark.parametrize("iterator_node", ITERATOR_NODES)
def test_a_pipeline_error_that_tfdp_did_not_word_is_withheld(iterator_node):
    """Review 9, H8: a tf.data pipeline of the user's own (validation_data)
    fails on a held-out record and its message quotes it."""
    text = f"StringToNumberOp could not correctly convert string: {CANARY}"
    with pytest.raises(tf.errors.InvalidArgumentError, match="input pipeline failed") as raised:
        step_errors.without_record_values(pipeline_error(text, iterator_node))()
    assert CANARY not in "".join(traceback.format_exception(raised.value))
    assert step_errors.SHOW_ENV in str(raised.value)


def test_a_record_holding_the_iterators_annotation_is_withheld():
    """Review 9, H1: the record's text "... [[IteratorGetNext]]" comes before
    TensorFlow's own annotation of the failing node, which decides."""
    records = np.array([["1.5"]] * 15 + [[CANARY + " [[IteratorGetNext]]"]])
    with pytest.raises(tf.errors.InvalidArgumentError, match="failed in node") as raised:
        parsing_model().fit(records, LABELS, batch_size=16, epochs=1, verbose=0)
    assert CANARY not in "".join(traceback.format_exception(raised.value))
    assert "to_number" in str(raised.value)


def test_a_validation_pipeline_error_does_not_quote_the_held_out_record():
    """Review 9, H8, end to end: validation_data as a tf.data pipeline of the
    user's own whose map fails on a held-out record."""
    inputs = keras.Input((1,))
    model = tfdp.DPModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    validation = tf.data.Dataset.from_tensor_slices((RECORDS[:, 0], LABELS)).map(
        lambda text, label: (tf.strings.to_number(text, tf.float32)[None], label)).batch(16)
    with pytest.raises(tf.errors.InvalidArgumentError, match="input pipeline failed") as raised:
        model.fit(np.ones((8, 1), "float32"), LABELS[:8], batch_size=8, epochs=1, verbose=0,
                  validation_data=validation)
    assert CANARY not in "".join(traceback.format_exception(raised.value))


@pytest.mark.parametrize("node", ["dp_model_1/to_number_1/IteratorGetNext",
                                  "compile_loss/loss/IteratorGetNextAsOptional"])
def test_a_model_op_named_as_the_iterator_is_withheld(node):
    """Review 9, H1: a user's op named `IteratorGetNext` under the model's
    (or the loss's) scope, on the batched path, is an op of the step."""
    with pytest.raises(tf.errors.InvalidArgumentError, match="failed in node") as raised:
        step_errors.without_record_values(pipeline_error(CANARY, node))()
    assert CANARY not in "".join(traceback.format_exception(raised.value))


def test_a_node_only_named_like_the_iterator_is_withheld():
    """Negative control: a step node whose name merely contains the
    iterator's (a layer called `my_IteratorGetNext_copy`) is the step's."""
    def fails():
        raise tf.errors.InvalidArgumentError(
            None, None, "StringToNumberOp could not correctly convert string: SECRET\n\t "
                        "[[{{node model/my_IteratorGetNext_copy/StringToNumber}}]]")

    with pytest.raises(tf.errors.InvalidArgumentError, match="failed in node") as raised:
        step_errors.without_record_values(fails)()
    assert "SECRET" not in str(raised.value)


def test_predict_on_a_private_record_does_not_quote_it():
    """Review 8, G10: predict's function was not wrapped."""
    model = parsing_model()
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="The private predict step failed in node") as raised:
        model.predict(tf.constant(RECORDS), batch_size=16, verbose=0)
    assert CANARY not in "".join(traceback.format_exception(raised.value))


# -- TensorFlow's C++ log prints the op's message unless TF_CPP_MIN_LOG_LEVEL >= 2 (review 8, G3)


def read_by_tensorflow(monkeypatch, level):
    """TensorFlow imported after tfdp, at `level`: the value it read is known."""
    monkeypatch.setattr(tf_log_level, "tensorflow_was_imported_first", False)
    monkeypatch.setattr(tf_log_level, "_values", [level])


def tiny_fit():
    inputs = keras.Input((2,))
    model = tfdp.DPModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=0), loss="mse")
    model.fit(np.ones((8, 2), "float32"), np.zeros(8, "float32"), batch_size=4,
              steps_per_epoch=1, verbose=0)


@pytest.mark.parametrize("level", [None, "1"])
def test_fit_warns_once_when_tensorflows_log_would_print_the_message(monkeypatch, level):
    monkeypatch.setattr(step_errors, "_warned", False, raising=False)
    read_by_tensorflow(monkeypatch, level)
    if level is None:
        monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", level)
    with pytest.warns(UserWarning, match=r"TF_CPP_MIN_LOG_LEVEL=2 before TensorFlow is imported"):
        tiny_fit()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_errors.warn_if_tf_logs_op_errors()  # once per process: fit's call again
    assert not caught
    withheld = step_errors.withheld_message(tf.errors.InvalidArgumentError(None, None, "x"))
    assert "TF_CPP_MIN_LOG_LEVEL=2" in withheld


def test_a_level_set_after_tensorflows_import_still_warns(monkeypatch):
    """Review 9, H5: TensorFlow reads the variable at its import only; set
    later (a notebook's later cell) it silenced the warning, not the log."""
    monkeypatch.setattr(step_errors, "_warned", False, raising=False)
    read_by_tensorflow(monkeypatch, None)  # unset when TensorFlow was imported
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    with pytest.warns(UserWarning, match=r"is 2 now and was unset when TensorFlow was imported, "
                                         r".*a change after TensorFlow's import has no effect"):
        tiny_fit()
    assert "TF_CPP_MIN_LOG_LEVEL=2" in step_errors.withheld_message(
        tf.errors.InvalidArgumentError(None, None, "x"))


@pytest.mark.parametrize("at_start", [None, "0"])
def test_a_level_set_between_tensorflows_import_and_tfdps_warns(monkeypatch, at_start):
    """Review 10, I5: TensorFlow imported, then the level set to 2, then
    tfdp imported (a notebook's later cell): the value at tfdp's import was
    taken as TensorFlow's, and the log printed a record with no warning."""
    monkeypatch.setattr(step_errors, "_warned", False, raising=False)
    monkeypatch.setattr(tf_log_level, "tensorflow_was_imported_first", True)
    monkeypatch.setattr(tf_log_level, "_values", ["2", "2"])
    monkeypatch.setattr(tf_log_level, "_at_start", at_start, raising=False)  # the process's start
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    with pytest.warns(UserWarning, match=r"is 2 now and was unknown \(not the value the process "
                                         r"started with\) when TensorFlow was imported"):
        step_errors.warn_if_tf_logs_op_errors()


def test_a_level_the_process_started_with_is_what_tensorflow_read(monkeypatch):
    """The control: set in the shell, the same at the start and at tfdp's import."""
    monkeypatch.setattr(step_errors, "_warned", False, raising=False)
    monkeypatch.setattr(tf_log_level, "tensorflow_was_imported_first", True)
    monkeypatch.setattr(tf_log_level, "_values", ["2", "2"])
    monkeypatch.setattr(tf_log_level, "_at_start", "2", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step_errors.warn_if_tf_logs_op_errors()


def test_the_start_value_is_read_from_the_start_environment(monkeypatch, tmp_path):
    start = tmp_path / "environ"
    start.write_bytes(b"HOME=/root\0TF_CPP_MIN_LOG_LEVEL=3\0PATH=/bin\0")
    assert tf_log_level.value_at_start(str(start)) == "3"
    start.write_bytes(b"HOME=/root\0")
    assert tf_log_level.value_at_start(str(start)) is None
    if os.path.exists("/proc/self/environ"):  # Linux: later changes do not reach it
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "set-after-start-4711")
        assert tf_log_level.value_at_start() != "set-after-start-4711"


def test_predict_without_fit_warns_too(monkeypatch):
    """Review 9, H5: a DP model used to predict on private records, never fit."""
    monkeypatch.setattr(step_errors, "_warned", False, raising=False)
    read_by_tensorflow(monkeypatch, None)
    with pytest.warns(UserWarning, match=r"TF_CPP_MIN_LOG_LEVEL=2 before TensorFlow is imported"):
        with pytest.raises(tf.errors.InvalidArgumentError):
            parsing_model().predict(tf.constant(RECORDS), batch_size=16, verbose=0)


def test_fit_does_not_warn_when_the_log_is_quiet(monkeypatch):
    """Negative control: level 2 when TensorFlow was imported (the tests'
    own), even if lowered since: the error text says nothing of it."""
    monkeypatch.setattr(step_errors, "_warned", False, raising=False)
    read_by_tensorflow(monkeypatch, "2")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_fit()
    assert not [w for w in caught if "TF_CPP_MIN_LOG_LEVEL" in str(w.message)]
    assert "TF_CPP" not in step_errors.withheld_message(
        tf.errors.InvalidArgumentError(None, None, "x"))
