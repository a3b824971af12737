"""write_records names an element that it refuses by position, array and
dtype, never by its values (review 9, H10): an element of the stream it
converts is a private record. With `TFDP_SHOW_STEP_ERRORS=1` the values show.
"""

import traceback

import numpy as np
import pytest

from tfdp.data import write_records

CANARY_ID = 98765432101  # a person's id


def full_text(error):
    return "".join(traceback.format_exception(error)) + repr(error.args)


def ids_beyond_int32():
    return [(np.array([1], "int32"), np.int64(0)),
            (np.array([CANARY_ID], "int64"), np.int64(0))]


def another_key_set():
    return [({"a": np.array([1.0], "float32")}, np.int64(0)),
            ({"a": np.array([4711.0], "float32"), "SECRET-ID-4711": np.array([CANARY_ID], "float64")},
             np.int64(0))]


def scalar_in_a_batch():
    return [(np.zeros((2, 1), "float32"), np.zeros(2, "int64")),
            (np.zeros((2, 1), "float32"), np.int64(CANARY_ID))]


CASES = [(ids_beyond_int32, False, "does not fit element 0's dtype at x"),
         (another_key_set, False, r"structure of element 0: it is \(\{'a': \., 1 key not in element 0\}"),
         (scalar_in_a_batch, True, "element 1 at y is a scalar")]


@pytest.mark.parametrize("records, batched, match", CASES)
def test_a_refused_element_is_named_without_its_values(tmp_path, records, batched, match):
    with pytest.raises(ValueError, match=match) as raised:
        write_records(records(), tmp_path / "r", batched=batched)
    text = full_text(raised.value)
    assert str(CANARY_ID) not in text and "4711" not in text


@pytest.mark.parametrize("records, batched, match", CASES)
def test_with_the_escape_hatch_the_values_show(tmp_path, monkeypatch, records, batched, match):
    """Negative control: the values were in the message before."""
    monkeypatch.setenv("TFDP_SHOW_STEP_ERRORS", "1")
    with pytest.raises(ValueError, match=match) as raised:
        write_records(records(), tmp_path / "r", batched=batched)
    assert str(CANARY_ID) in str(raised.value) or "98765432101" in str(raised.value) \
        or "9.87654321e+10" in str(raised.value)
