"""fit's checks before the first step name a record by position, never by
value (review 9, H9).

`check_validation_data_fits` runs validation_data's first example through
the model; its error re-raised the model's message (which
`tf.strings.to_number` words with the held-out record's field) chained to
the original. `check_embedding_ids` named an out-of-range id by value (an id
can be a person's). With `TFDP_SHOW_STEP_ERRORS=1` both show the value.
"""

import traceback

import keras
import numpy as np
import pytest

from tfdp.models import input_checks, step_errors
from tests.record_canary import CANARY, ToNumber, dp_parsing_model


@pytest.fixture(scope="module")
def parsing_model():
    words = keras.Input((1,), dtype="string")
    model = keras.Model(words, keras.layers.Dense(3)(ToNumber(name="to_number")(words)))
    model(np.array([["1.5"]]))
    return model


@pytest.fixture(scope="module")
def embedding_model():
    return keras.Sequential([keras.Input((2,), dtype="int32"),
                             keras.layers.Embedding(50, 2, name="tokens")])


def full_text(error):
    return "".join(traceback.format_exception(error)) + repr(error.args)


VALIDATION = (np.array([[CANARY]] + [["1.5"]] * 3), np.zeros(4, "int64"))


def test_a_failing_first_validation_example_is_named_without_its_value(parsing_model):
    with pytest.raises(ValueError, match="first example fails") as raised:
        input_checks.check_validation_data_fits(parsing_model, VALIDATION, 3)
    text = full_text(raised.value)
    assert CANARY not in text and "4711" not in text
    assert raised.value.__cause__ is None and raised.value.__context__ is None
    assert "InvalidArgumentError" in str(raised.value)
    assert step_errors.SHOW_ENV in str(raised.value)


def test_with_the_escape_hatch_the_validation_error_shows_the_value(parsing_model, monkeypatch):
    monkeypatch.setenv(step_errors.SHOW_ENV, "1")
    with pytest.raises(ValueError, match=CANARY) as raised:
        input_checks.check_validation_data_fits(parsing_model, VALIDATION, 3)
    assert raised.value.__cause__ is not None


def test_an_id_out_of_range_is_named_by_its_record_not_its_value(embedding_model):
    ids = np.ones((20, 2), "int32")
    ids[14, 1] = 4711
    with pytest.raises(ValueError, match=r"record 14, which gives it an id outside") as raised:
        input_checks.check_embedding_ids(embedding_model, ids)
    assert "4711" not in full_text(raised.value)


def test_with_the_escape_hatch_the_id_is_shown(embedding_model, monkeypatch):
    monkeypatch.setenv(step_errors.SHOW_ENV, "1")
    ids = np.ones((20, 2), "int32")
    ids[14, 1] = 4711
    with pytest.raises(ValueError, match=r"record 14, which gives it id 4711$"):
        input_checks.check_embedding_ids(embedding_model, ids)


def test_fit_with_the_crafted_first_validation_record_does_not_quote_it():
    """The reproducer's case end to end: a DP model's fit, before its first step."""
    model = dp_parsing_model()
    with pytest.raises(ValueError, match="first example fails") as raised:
        model.fit(np.array([["1.5"]] * 8), np.zeros(8, "int64"), batch_size=8, epochs=1,
                  verbose=0, validation_data=VALIDATION)
    assert CANARY not in full_text(raised.value)
    assert model.privacy.steps == 0
