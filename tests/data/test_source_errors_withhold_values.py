"""A RecordSource's reading and transform errors name the record's position
and the exception's type, never its text (review 8, G4).

Python's own messages quote values: `float("SECRET-ID-4711")` raises
"could not convert string to float: 'SECRET-ID-4711'". The source re-raised
it as "Reading record 15 of list failed: <that message>", chained to the
original, and the step's error wrapper passes input-pipeline errors
unchanged, so a private record's raw field reached the error of `fit`.
`TFDP_SHOW_STEP_ERRORS=1` shows the text (and chains the original) for
debugging on data that is not private.
"""

import traceback

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.data import RecordSource
from tfdp.models import step_errors

CANARY = "SECRET-ID-4711"
ROWS = [("1.5", 0)] * 15 + [(CANARY, 0)]


def to_float(row):
    return np.array([float(row[0])], "float32"), np.int64(row[1])


def full_text(error):
    """Everything a handler or a log would print of `error`."""
    return "".join(traceback.format_exception(error)) + repr(error.args)


class SecretBatches(list):
    """A tfds-like source whose batch read fails quoting a record's bytes."""

    def __getitems__(self, indices):
        if 15 in indices:
            raise OSError(f"cannot decode {CANARY!r}")
        return [self[i] for i in indices]


def test_fit_on_a_record_the_transform_rejects_names_it_without_its_value():
    inputs = keras.Input((1,))
    model = tfdp.DPModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(tf.errors.OpError) as caught:
        model.fit(RecordSource(ROWS, transform=to_float), batch_size=16, epochs=1, verbose=0)
    text = full_text(caught.value)
    assert CANARY not in text and "4711" not in text
    assert "Reading record 15 of list failed (ValueError" in str(caught.value)
    assert step_errors.SHOW_ENV in str(caught.value)


def batch_read(source):
    return source.read_batch(np.array([3, 15]), source.empty_batch(2))


@pytest.mark.parametrize("read", [
    lambda: RecordSource(ROWS, transform=to_float)[15],
    lambda: RecordSource([ROWS[-1]] + ROWS, transform=to_float),  # record 0, read when made
    lambda: batch_read(RecordSource(SecretBatches(ROWS), transform=to_float)),
    lambda: RecordSource(SecretBatches(ROWS), transform=to_float)._leaves(15, ROWS[15]),
    lambda: batch_read(RecordSource(ROWS, batch_transform=lambda items: (
        np.stack([to_float(i)[0] for i in items]), np.zeros(len(items), "int64")))),
], ids=["transform", "record_0", "getitems", "transform_of_batch_read", "batch_transform"])
def test_each_read_withholds_the_exception_text(read):
    with pytest.raises(Exception) as caught:
        read()
    text = full_text(caught.value)
    assert CANARY not in text and "4711" not in text, text
    assert caught.value.__cause__ is None and caught.value.__context__ is None
    assert step_errors.SHOW_ENV in str(caught.value)


def test_with_show_step_errors_the_text_and_the_original_are_kept(monkeypatch):
    monkeypatch.setenv(step_errors.SHOW_ENV, "1")
    with pytest.raises(ValueError) as caught:
        RecordSource(ROWS, transform=to_float)[15]
    assert CANARY in str(caught.value)
    assert isinstance(caught.value.__cause__, ValueError)


# -- review 9, H2: the structure outline and the dtype of a record that differs from record 0


GOOD = ({"a": np.array([1.0], "float32")}, np.int64(0))


def test_a_record_with_other_keys_is_outlined_without_them():
    """A JSON record whose keys are data: the outline showed every key."""
    rows = [GOOD] * 3 + [({"a": np.array([1.0], "float32"), CANARY: np.array([1.0], "float32")},
                          np.int64(0))]
    with pytest.raises(ValueError, match=r"Record 3 .* it is \(\{'a': \., 1 key not in record 0\}, \.\)") as raised:
        RecordSource(rows)[3]
    assert CANARY not in full_text(raised.value)


def test_a_text_leaf_is_named_text_not_by_its_length():
    """NumPy's dtype `<U14` gives the text's length."""
    rows = [GOOD] * 3 + [({"a": np.array([CANARY])}, np.int64(0))]
    with pytest.raises(ValueError, match=r"Record 3 does not match record 0.*dtype text$") as raised:
        RecordSource(rows)[3]
    assert f"U{len(CANARY)}" not in full_text(raised.value)


def test_record_zeros_own_keys_are_outlined():
    """Control: the keys record 0 has (the data's schema) are named."""
    rows = [({"a": np.zeros(1, "float32"), "b": np.zeros(1, "float32")}, np.int64(0))] * 3
    rows.append(({"a": np.zeros(1, "float32")}, np.int64(0)))
    with pytest.raises(ValueError, match=r"it is \(\{'a': \.\}, \.\), record 0 is \(\{'a': \., 'b': \.\}, \.\)"):
        RecordSource(rows)[3]


class RecordError(Exception):
    """A user's exception class whose text adds context: the record parsed."""

    parsing = ""

    def __str__(self):
        return f"{self.args[0]} [while parsing {RecordError.parsing}]"


def parse_with_context(row):
    RecordError.parsing = row[0]
    if row[0] == CANARY:
        raise RecordError("bad record")
    return to_float(row)


def test_a_user_exception_class_that_adds_the_record_to_its_text_is_not_rebuilt():
    """Review 10, I3: the error was rebuilt from the user's class, whose
    `__str__` appended the record, and tfdp's read kept that text."""
    source = RecordSource(ROWS, transform=parse_with_context)
    with pytest.raises(RuntimeError, match=r"Reading record 15 of list failed \(RecordError\)") as caught:
        source[15]
    assert CANARY not in full_text(caught.value)


def test_with_the_escape_hatch_the_user_class_is_kept(monkeypatch):
    """Negative control: with values shown the user's class and its text stay."""
    monkeypatch.setenv(step_errors.SHOW_ENV, "1")
    with pytest.raises(RecordError) as caught:
        RecordSource(ROWS, transform=parse_with_context)[15]
    assert CANARY in str(caught.value)
