"""Tests for tfdp.accounting.privacy_statement."""

import math

import pytest

from tfdp.accounting import privacy_statement
from tfdp.accounting.statement import _round_up


def test_statement_says_validation_data_and_loss_driven_callbacks_are_not_covered():
    """Broken variant caught: a statement silent on validation data (held-out
    records get no protection) and on callbacks steering training from the
    private logged loss (the old text)."""
    not_covered = privacy_statement(1.0, 1e-5, 10).split("Not covered:")[1]
    for words in ("validation_split", "validation_data", "no protection", "ReduceLROnPlateau",
                  "EarlyStopping on the training loss"):
        assert words in not_covered, words


def test_statement_says_what_is_and_is_not_covered():
    text = privacy_statement(2.93, 1e-5, 14040)
    assert text.startswith(
        "This model was trained with (epsilon=2.93, delta=1e-05)-differential privacy at the "
        "record level, over 14040 private training steps."
    )
    assert "factor e^epsilon = 18.8" in text  # e^2.93 = 18.73, rounded up
    assert "except with probability at most delta = 1e-05" in text
    for covered in ("trained weights", "privacy ledger"):
        assert covered in text
    for not_covered in ("hyperparameters tuned", "training-set loss and metrics shown in the logs", "data-independent choices",
                        "size N (treated as public"):
        assert not_covered in text.split("Not covered:")[1]
    assert "Mechanism: DP-SGD" in text
    assert "Mechanism: my mechanism." in privacy_statement(1.0, 1e-5, 3, mechanism_description="my mechanism")


@pytest.mark.parametrize(
    "value, text",
    [(2.931, "2.94"), (2.93, "2.93"), (0.7242234, "0.725"), (12.31, "12.4"), (123.4, "124"),
     (9.9999, "10.0"), (0.0001234, "1.24e-4"), (5e6, "5.00e+6"), (0.0, "0"), (5e-324, "5.00e-324"), (1e300, "1.00e+300"), (999999.9, "1.00e+6")],
)
def test_numbers_are_rounded_up_never_down(value, text):
    assert _round_up(value) == text
    assert float(text) >= value


def test_extreme_epsilons():
    assert "NO finite differential privacy guarantee" in privacy_statement(math.inf, 1e-5, 10)
    assert "more than 1e300" in privacy_statement(1000.0, 1e-5, 10)
    assert "(epsilon=0, delta=1e-05)" in privacy_statement(0.0, 1e-5, 0)


@pytest.mark.parametrize(
    "args, name",
    [((-1.0, 1e-5, 1), "epsilon"), ((math.nan, 1e-5, 1), "epsilon"), ((1.0, 1.0, 1), "delta"), ((1.0, 1e-5, -2), "steps"), (("1", 1e-5, 1), "epsilon")],
)
def test_bad_arguments(args, name):
    with pytest.raises((ValueError, TypeError), match=f"`{name}`.*Received: {name}="):
        privacy_statement(*args)
