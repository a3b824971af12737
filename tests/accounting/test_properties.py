"""Property tests: any input gives a clear error or a correct answer, never a crash.

A "clear error" is a ValueError or TypeError whose message names the
offending argument (Keras style: "... Received: name=value"). Hypothesis is
derandomized so the suite is reproducible and its run time stable.
"""

import json
import math
import re
import sys

import dp_accounting
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tfdp.accounting._engine import pld_discretization

from tfdp.accounting import (
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_dpsgd_epsilon,
    compute_epsilon,
    dpsgd_event,
    event_from_dict,
    privacy_statement,
)

FAST = settings(max_examples=60, deadline=None, derandomize=True, database=None)
SLOW = settings(max_examples=8, deadline=None, derandomize=True, database=None)

junk = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(10**30), 10**30),
    st.text(max_size=4),
    st.none(),
    st.booleans(),
    st.just([1.0]),
    st.just({"a": 1}),
)


def maybe(valid):
    """Mostly valid values, sometimes anything."""
    return st.one_of(valid, valid, junk)


sigmas = maybe(st.floats(1e-6, 1e6))
probabilities = maybe(st.floats(1e-9, 1.0))
deltas = maybe(st.floats(1e-12, 0.5))
step_counts = maybe(st.integers(0, 10**7))
epsilons = maybe(st.floats(0.0, 1e3))


def clear_error_or(call, names, check):
    try:
        result = call()
    except (ValueError, TypeError) as error:
        message = str(error)
        assert any(f"`{name}`" in message for name in names), message
        assert "Received: " in message, message
        return
    check(result)


def is_epsilon(value):
    assert isinstance(value, float)
    assert value >= 0.0 and not math.isnan(value)


@FAST
@given(sigma=sigmas, q=probabilities, steps=step_counts, delta=deltas,
       conversion=st.sampled_from(["tight", "classic", "other"]))
def test_compute_epsilon(sigma, q, steps, delta, conversion):
    clear_error_or(
        lambda: compute_epsilon(sigma, q, steps, delta, conversion=conversion),
        ["noise_multiplier", "sampling_probability", "steps", "delta", "conversion"],
        is_epsilon,
    )


@FAST
@given(sigma=st.floats(0.3, 50.0), q=st.floats(1e-5, 1.0), steps=st.integers(1, 10**5),
       delta=st.floats(1e-12, 0.1))
def test_valid_epsilon_is_dp_accountings_and_monotone(sigma, q, steps, delta):
    """Valid settings: exactly dp_accounting's RDP epsilon, which grows with
    the steps and falls with the noise (a wrong answer fails, not just NaN)."""
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    epsilon = compute_epsilon(sigma, q, steps, delta)
    assert epsilon == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)
    assert compute_epsilon(sigma, q, 2 * steps, delta) >= epsilon
    assert compute_epsilon(2 * sigma, q, steps, delta) <= epsilon


# Every positive float, subnormals and the largest double included.
any_noise = st.floats(min_value=5e-324, max_value=sys.float_info.max)
WIDE = settings(max_examples=12, deadline=None, derandomize=True, database=None)


@WIDE
@given(a=any_noise, b=any_noise, q=st.sampled_from([1.0, 0.01]), steps=st.sampled_from([1, 1000, 2**53]),
       conversion=st.sampled_from(["tight", "classic"]))
def test_epsilon_never_increases_with_noise_over_the_whole_float_range(a, b, q, steps, conversion):
    """More noise never gives a larger epsilon, from 5e-324 to 1.8e308 (dp_accounting's
    float arithmetic overflows past sigma ~1e154; that once turned 0.0 into inf)."""
    low, high = sorted((a, b))
    more_noise = compute_epsilon(high, q, steps, 1e-5, conversion=conversion)
    less_noise = compute_epsilon(low, q, steps, 1e-5, conversion=conversion)
    is_epsilon(more_noise)
    assert more_noise <= less_noise


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("q", [1.0, 0.01])
def test_huge_noise_gives_the_limit_of_no_information(accountant, q):
    """Past dp_accounting's overflow (sigma > ~1e154) epsilon stays the limit reached
    before it: 0.0 (tight conversion), never inf or an error."""
    limit = compute_epsilon(1e150, q, 1000, 1e-5, accountant=accountant)
    assert limit == 0.0
    for sigma in (1e155, 1e200, 1e308, sys.float_info.max):
        assert compute_epsilon(sigma, q, 1000, 1e-5, accountant=accountant) == limit
    classic = compute_epsilon(1e150, q, 1000, 1e-5, conversion="classic")
    assert classic == pytest.approx(math.log(1e5) / 63)  # rdp 0 at order 64
    assert compute_epsilon(1e308, q, 1000, 1e-5, conversion="classic") == classic


@FAST
@given(n=maybe(st.integers(1, 10**6)), batch=maybe(st.integers(1, 10**4)), sigma=sigmas,
       epochs=maybe(st.floats(0, 100)), delta=deltas)
def test_compute_dpsgd_epsilon(n, batch, sigma, epochs, delta):
    clear_error_or(
        lambda: compute_dpsgd_epsilon(n, batch, sigma, epochs, delta),
        ["num_examples", "batch_size", "noise_multiplier", "epochs", "delta"],
        is_epsilon,
    )


@FAST
@given(sigma=sigmas, q=probabilities)
def test_dpsgd_event(sigma, q):
    def check(event):
        gaussian = dp_accounting.GaussianDpEvent(float(sigma))
        expected = gaussian if q == 1 else dp_accounting.PoissonSampledDpEvent(float(q), gaussian)
        assert event == expected

    clear_error_or(lambda: dpsgd_event(sigma, q), ["noise_multiplier", "sampling_probability"], check)


@FAST
@given(delta=deltas, extra=step_counts, epsilon=epsilons, max_steps=maybe(st.integers(0, 10**7)))
def test_ledger_questions(delta, extra, epsilon, max_steps):
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(1.1, 0.01))
    ledger.advance(100)
    clear_error_or(lambda: ledger.epsilon(delta, extra_steps=extra), ["delta", "extra_steps"], is_epsilon)
    clear_error_or(lambda: ledger.delta(epsilon), ["epsilon"], lambda d: 0.0 <= d <= 1.0)

    def check_budget(k):
        assert 0 <= k <= max_steps
        if k > 0:  # 0 also means "already over budget"
            assert ledger.epsilon(delta, extra_steps=k) <= epsilon
        if k < max_steps:
            assert ledger.epsilon(delta, extra_steps=k + 1) > epsilon

    clear_error_or(
        lambda: ledger.steps_within_budget(epsilon, delta, max_steps=max_steps),
        ["epsilon", "delta", "max_steps"],
        check_budget,
    )


@SLOW
@given(target=maybe(st.floats(0.01, 100.0)), delta=deltas, q=probabilities, steps=maybe(st.integers(1, 10**5)))
def test_calibration(target, delta, q, steps):
    def check(sigma):
        assert compute_epsilon(sigma, q, steps, delta) <= target

    try:
        clear_error_or(
            lambda: calibrate_noise_multiplier(target, delta, q, steps, tolerance=1e-2),
            ["target_epsilon", "delta", "sampling_probability", "steps"],
            check,
        )
    except AssertionError:
        # The one argument-free error: a target no noise reaches.
        try:
            calibrate_noise_multiplier(target, delta, q, steps, tolerance=1e-2)
        except ValueError as error:
            assert "cannot be reached" in str(error) and "Received: target_epsilon=" in str(error)
        else:
            raise


@SLOW
@given(sigma=st.floats(0.5, 50.0), q=st.floats(1e-3, 1.0), steps=st.integers(1, 1000))
def test_pld_is_dp_accountings_pld_and_below_rdp(sigma, q, steps):
    """Two-sided: tfdp's PLD epsilon is PLDAccountant's (at the interval tfdp picks)."""
    pld = compute_epsilon(sigma, q, steps, 1e-5, accountant="pld")
    is_epsilon(pld)
    event = dpsgd_event(sigma, q)
    accountant = dp_accounting.pld.PLDAccountant(
        value_discretization_interval=pld_discretization([(event, steps)]))
    accountant.compose(event, steps)
    assert pld == pytest.approx(max(0.0, accountant.get_epsilon(1e-5)), rel=1e-9, abs=1e-12)
    rdp = compute_epsilon(sigma, q, steps, 1e-5)
    # Both are upper bounds; PLD is the tighter (up to its discretization).
    assert pld <= rdp * 1.01 + 1e-3


def check_statement(epsilon, delta, steps):
    """The statement states epsilon, e^epsilon and delta rounded up (never
    promising more than the ledger holds), to 3 significant digits, and the steps."""

    def check(text):
        epsilon_value, delta_value, steps_value = float(epsilon), float(delta), int(steps)
        if math.isinf(epsilon_value):
            assert text.startswith("This model has NO finite") and f"({steps_value} private" in text
            return
        match = re.match(r"This model was trained with \(epsilon=(\S+), delta=(\S+)\)-differential "
                         r"privacy at the record level, over (\d+) private training steps\.", text)
        assert match, text
        stated_epsilon, stated_delta = float(match.group(1)), float(match.group(2))
        assert epsilon_value <= stated_epsilon <= epsilon_value * (1 + 1e-2)
        assert delta_value <= stated_delta <= delta_value * (1 + 1e-2)
        assert int(match.group(3)) == steps_value
        factor = re.search(r"by at most a factor e\^epsilon = (.+?), except with probability at most "
                           r"delta = (\S+)\.\n", text)
        assert factor, text
        assert float(factor.group(2)) == stated_delta
        if factor.group(1) != "more than 1e300":
            assert math.exp(epsilon_value) <= float(factor.group(1)) <= math.exp(epsilon_value) * (1 + 1e-2)

    return check


@FAST
@given(epsilon=epsilons, delta=maybe(st.floats(0.0, 0.99)), steps=step_counts)
@example(epsilon=0.7242, delta=1.2345e-5, steps=6000)  # delta once shown rounded down: 1.23e-05
def test_privacy_statement(epsilon, delta, steps):
    clear_error_or(lambda: privacy_statement(epsilon, delta, steps), ["epsilon", "delta", "steps"],
                   check_statement(epsilon, delta, steps))


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.integers(), st.text(max_size=5),
              st.sampled_from(["GaussianDpEvent", "PoissonSampledDpEvent", "SelfComposedDpEvent",
                               "ComposedDpEvent", "Infinity", "NaN"])),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.sampled_from(["type", "event", "events", "count", "noise_multiplier",
                                         "sampling_probability", "x"]), children, max_size=4),
    ),
    max_leaves=12,
)


@FAST
@given(data=json_values)
def test_event_from_dict_never_crashes(data):
    try:
        event = event_from_dict(data)
    except ValueError as error:
        assert str(error)
        return
    assert type(event).__module__ == "dp_accounting.dp_event"


def _mutations(text):
    data = json.loads(text)
    return st.one_of(
        st.text(max_size=30),
        st.just(text[: len(text) // 2]),
        st.builds(lambda key, value: json.dumps({**data, key: value}),
                  st.sampled_from(sorted(data)), json_values),
    )


def _saved_ledger():
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(1.1, 0.01))
    ledger.advance(10)
    ledger.record(dpsgd_event(2.0, 1.0))
    return ledger.to_json()


@FAST
@given(text=_mutations(_saved_ledger()))
def test_from_json_never_crashes(text):
    try:
        ledger = PrivacyLedger.from_json(text)
    except ValueError as error:
        assert "privacy ledger" in str(error)
        return
    is_epsilon(ledger.epsilon(1e-5))
