"""Argument checks shared by `tfdp.accounting` (Keras-style error messages).

Every check names the argument and shows the value received, e.g.
"Expected `delta` in (0, 1). Received: delta=2". Wrong types raise
`TypeError`, wrong values raise `ValueError`; nothing here uses `assert`.

Example:

>>> check_real("delta", 1e-5, low=0.0, high=1.0)
1e-05
>>> check_int("steps", 6000)
6000
"""

import math
import numbers
import operator
import warnings

import numpy as np


def show(value):
    """`repr` of a received value, with NumPy scalars shown as plain numbers."""
    if isinstance(value, np.generic):
        value = value.item()
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return text


def _is_real(value):
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, numbers.Real):
        return True
    return isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf"


def _interval(low, high, low_inclusive, high_inclusive):
    left = "[" if low_inclusive else "("
    right = "]" if high_inclusive else ")"
    return f"{left}{low:g}, {high:g}{right}"


def check_real(
    name,
    value,
    low=None,
    high=None,
    low_inclusive=False,
    high_inclusive=False,
    allow_inf=False,
):
    """Returns `float(value)` if it is a real number in the given range.

    Args:
        name: the argument's name, used in the error message.
        value: the value received.
        low: lower bound, or None for none.
        high: upper bound, or None for none.
        low_inclusive: whether `low` itself is allowed.
        high_inclusive: whether `high` itself is allowed.
        allow_inf: whether +inf is allowed (NaN never is).

    Returns:
        The value as a Python float.

    Raises:
        TypeError: if `value` is not a real number (bools are refused).
        ValueError: if `value` is NaN, infinite (unless allowed) or out of range.
    """
    if not _is_real(value):
        raise TypeError(
            f"Expected `{name}` to be a number. Received: {name}={show(value)} "
            f"(of type {type(value).__name__})"
        )
    number = float(value)
    if low is not None and high is not None:
        requirement = "in " + _interval(low, high, low_inclusive, high_inclusive)
    elif low is not None:
        requirement = f"to be a {'' if allow_inf else 'finite '}number {'>=' if low_inclusive else '>'} {low:g}"
    elif high is not None:
        requirement = f"to be a finite number {'<=' if high_inclusive else '<'} {high:g}"
    else:
        requirement = "to be a finite number"
    bad = math.isnan(number) or (math.isinf(number) and not (allow_inf and number > 0))
    if low is not None and not bad:
        bad = number < low or (number == low and not low_inclusive)
    if high is not None and not bad:
        bad = number > high or (number == high and not high_inclusive)
    if bad:
        raise ValueError(f"Expected `{name}` {requirement}. Received: {name}={show(value)}")
    return number


# Counts above 2^53 are not exactly representable as floats; no training runs that long.
MAX_COUNT = 2**53


def check_int(name, value, minimum=0, maximum=MAX_COUNT):
    """Returns `value` as a Python int if it is an integer in [minimum, maximum].

    Integral floats (e.g. `6000.0`) are accepted; bools are not.

    Raises:
        TypeError: if `value` is not an integer.
        ValueError: if `value` is not integral or outside [minimum, maximum].
    """
    if isinstance(value, (bool, np.bool_)):
        number = None
    else:
        try:
            number = operator.index(value)
        except TypeError:
            number = None
            if _is_real(value) and math.isfinite(float(value)) and float(value).is_integer():
                number = int(float(value))
    if number is None:
        if _is_real(value):
            raise ValueError(f"Expected `{name}` to be an integer. Received: {name}={show(value)}")
        raise TypeError(
            f"Expected `{name}` to be an integer. Received: {name}={show(value)} "
            f"(of type {type(value).__name__})"
        )
    if number < minimum:
        raise ValueError(f"Expected `{name}` to be an integer >= {minimum}. Received: {name}={show(value)}")
    if maximum is not None and number > maximum:
        raise ValueError(
            f"Expected `{name}` to be an integer <= {maximum}. Received: {name}={show(value)}"
        )
    return int(number)


def check_choice(name, value, choices):
    """Returns `value` if it is one of `choices` (strings), else raises ValueError."""
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"Expected `{name}` to be one of {options}. Received: {name}={show(value)}")
    return value


def check_delta(delta, name="delta"):
    """A target delta: a number in (0, 1)."""
    return check_real(name, delta, low=0.0, high=1.0)


class LargeDeltaWarning(UserWarning):
    """A target delta above 1/N, where N is the number of training records."""


def warn_if_delta_exceeds_one_over_n(delta, num_examples):
    """Warns (`LargeDeltaWarning`) when `delta` > 1/`num_examples`.

    An (epsilon, delta) guarantee allows anything with probability delta: a
    mechanism that publishes each record in full with probability delta is
    (0, delta)-DP, and above 1/N it publishes more than one record on
    average. 1/N itself is allowed (`fit`'s default delta is min(1e-5, 1/N)).

    Args:
        delta: the target delta, already checked to be in (0, 1).
        num_examples: N, the number of training records.

    Example:

    >>> warn_if_delta_exceeds_one_over_n(1e-5, 60000)  # nothing to say
    """
    if delta * num_examples > 1:
        warnings.warn(
            f"delta={delta:g} is larger than 1/N = {1 / num_examples:.3g} for N = "
            f"{num_examples} training records: a guarantee with such a delta allows "
            "publishing a whole record (each one with probability delta), so it protects "
            "no one. Choose delta well below 1/N (1e-5 or less is common). Received: "
            f"delta={delta:g}, num_examples={num_examples}",
            LargeDeltaWarning,
            stacklevel=3,
        )
