"""Clopper-Pearson bounds and the epsilon lower bound: known values, properties, coverage."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfdp.auditing import clopper_pearson_upper, epsilon_from_scores, epsilon_lower_bound
from tfdp.auditing import audit as audit_module

PROPERTIES = settings(max_examples=150, deadline=None, derandomize=True, database=None)


def exact_binomial_cdf(k, n, p):
    """P(Binomial(n, p) <= k), summed exactly in log space (the test's oracle)."""
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        for i in range(k + 1)
    ]
    top = max(terms)
    return math.exp(top) * sum(math.exp(t - top) for t in terms)


# -- known values ------------------------------------------------------------------


def test_known_clopper_pearson_values():
    # One-sided 95% upper bound for 5/100 (tables: 0.1023), for 0/n the
    # closed form 1 - (1 - c)^(1/n), and n/n is 1.
    assert clopper_pearson_upper(5, 100, 0.95) == pytest.approx(0.10225, abs=5e-5)
    for n in (1, 10, 1000, 10**6):
        assert clopper_pearson_upper(0, n, 0.975) == pytest.approx(1 - 0.025 ** (1 / n), rel=1e-9)
    assert clopper_pearson_upper(7, 7, 0.95) == 1.0


@pytest.mark.parametrize("k, n, c", [(0, 50, 0.9), (3, 40, 0.95), (50, 1000, 0.975), (400, 500, 0.99), (9, 10, 0.5)])
def test_clopper_pearson_solves_its_defining_equation(k, n, c):
    upper = clopper_pearson_upper(k, n, c)
    assert exact_binomial_cdf(k, n, upper) == pytest.approx(1 - c, rel=1e-6)


def test_known_epsilon_lower_bounds():
    u = 1 - 0.025 ** (1 / 1000)  # each rate's bound at (1 + 0.95) / 2
    assert epsilon_lower_bound(0, 1000, 0, 1000, delta=1e-5) == pytest.approx(math.log((1 - 1e-5 - u) / u))
    # Errors at chance level prove nothing.
    assert epsilon_lower_bound(500, 1000, 500, 1000, delta=1e-5) == 0.0
    assert epsilon_lower_bound(1000, 1000, 1000, 1000, delta=0.0) == 0.0
    # Asymmetric: only the FNR side is informative.
    fpr, fnr = clopper_pearson_upper(900, 1000, 0.975), clopper_pearson_upper(1, 1000, 0.975)
    assert epsilon_lower_bound(900, 1000, 1, 1000, delta=1e-5) == pytest.approx(math.log((1 - 1e-5 - fpr) / fnr))


# -- monotonicity ----------------------------------------------------------------------


def test_clopper_pearson_is_monotone():
    ks = [clopper_pearson_upper(k, 200, 0.95) for k in range(0, 201, 10)]
    assert all(a < b for a, b in zip(ks, ks[1:]))
    ns = [clopper_pearson_upper(5, n, 0.95) for n in (10, 20, 100, 1000, 10**5)]
    assert all(a > b for a, b in zip(ns, ns[1:]))
    cs = [clopper_pearson_upper(5, 100, c) for c in (0.5, 0.9, 0.95, 0.99, 0.999999)]
    assert all(a < b for a, b in zip(cs, cs[1:]))
    assert 5 / 100 < cs[0]


def test_epsilon_bound_is_monotone():
    by_errors = [epsilon_lower_bound(fp, 10000, 100, 10000, 1e-5) for fp in (0, 1, 10, 100, 1000)]
    assert all(a > b for a, b in zip(by_errors, by_errors[1:]))
    by_trials = [epsilon_lower_bound(n // 100, n, n // 2, n, 1e-5) for n in (1000, 10000, 100000)]
    assert all(a < b for a, b in zip(by_trials, by_trials[1:]))
    by_confidence = [epsilon_lower_bound(10, 10000, 5000, 10000, 1e-5, c) for c in (0.5, 0.9, 0.95, 0.999)]
    assert all(a > b for a, b in zip(by_confidence, by_confidence[1:]))
    by_delta = [epsilon_lower_bound(10, 10000, 5000, 10000, d) for d in (0.0, 1e-3, 0.1)]
    assert all(a > b for a, b in zip(by_delta, by_delta[1:]))


# -- properties ---------------------------------------------------------------------


@st.composite
def counts(draw):
    n = draw(st.integers(1, 10**6))
    return draw(st.integers(0, n)), n


@PROPERTIES
@given(fp=counts(), fn=counts(), delta=st.floats(0.0, 0.5), confidence=st.floats(0.01, 0.999999))
def test_bound_is_finite_nonnegative_and_below_the_point_estimate(fp, fn, delta, confidence):
    (false_positives, negatives), (false_negatives, positives) = fp, fn
    bound = epsilon_lower_bound(false_positives, negatives, false_negatives, positives, delta, confidence)
    assert isinstance(bound, float) and math.isfinite(bound) and bound >= 0.0
    estimate = audit_module._point_estimate(false_positives, negatives, false_negatives, positives, delta)
    assert bound <= estimate + 1e-12
    # More confidence never gives a larger bound.
    assert epsilon_lower_bound(false_positives, negatives, false_negatives, positives, delta, 0.9999999) <= bound + 1e-12


@PROPERTIES
@given(kn=counts(), confidence=st.floats(0.5, 0.999999))
def test_clopper_pearson_is_a_probability_above_the_estimate(kn, confidence):
    k, n = kn
    upper = clopper_pearson_upper(k, n, confidence)
    assert k / n <= upper <= 1.0 and (upper > 0.0)


hostile = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda v: not (v.is_integer() and 0 <= v <= 10)),
    st.integers(-(10**20), -1),
    st.text(max_size=3),
    st.none(),
    st.booleans(),
    st.just([3]),
)


@PROPERTIES
@given(value=hostile, position=st.integers(0, 5))
def test_hostile_arguments_get_a_clear_error(value, position):
    args = [3, 10, 4, 10, 1e-5, 0.95]
    names = ["false_positives", "negatives", "false_negatives", "positives", "delta", "confidence"]
    args[position] = value
    try:
        result = epsilon_lower_bound(*args)
    except (TypeError, ValueError) as error:
        message = str(error)
        assert f"`{names[position]}`" in message and "Received" in message, message
    else:  # a valid value slipped through (e.g. delta=0.3): the answer must be sane
        assert math.isfinite(result) and result >= 0


def test_count_above_total_is_refused_with_its_name():
    with pytest.raises(ValueError, match=r"`false_negatives` <= positives \(10\). Received: false_negatives=11"):
        epsilon_lower_bound(0, 10, 11, 10, 1e-5)
    with pytest.raises(ValueError, match="Received: confidence=1"):
        clopper_pearson_upper(1, 10, 1.0)


# -- coverage (statistical, fixed seeds, with negative controls) ---------------------------


def test_clopper_pearson_covers_the_true_rate():
    rng = np.random.default_rng(0)
    p, n = 0.03, 400
    draws = rng.binomial(n, p, size=2000)
    covered = np.mean([clopper_pearson_upper(int(k), n, 0.95) >= p for k in draws])
    naive = np.mean(draws / n >= p)  # negative control: the point estimate is no bound
    assert covered >= 0.95
    assert naive < 0.7


def test_epsilon_bound_holds_for_an_exactly_private_mechanism():
    """Randomized response is exactly epsilon-DP: the bound may exceed epsilon <= 5% of the time."""
    epsilon, n = 1.0, 2000
    p_in = math.exp(epsilon) / (1 + math.exp(epsilon))  # P(say "in") with the record
    rng = np.random.default_rng(1)
    over, estimate_over = 0, 0
    for _ in range(300):
        false_positives = rng.binomial(n, 1 - p_in)
        false_negatives = rng.binomial(n, 1 - p_in)
        over += epsilon_lower_bound(false_positives, n, false_negatives, n, delta=0.0) > epsilon
        estimate_over += audit_module._point_estimate(false_positives, n, false_negatives, n, 0.0) > epsilon
    assert over <= 0.05 * 300
    assert estimate_over > 0.3 * 300  # negative control: without intervals, half the runs "prove" too much


def test_threshold_chosen_on_held_out_trials_keeps_the_guarantee():
    """Identical distributions (epsilon 0): the split audit stays at 0, choosing on the evaluation data does not."""
    split_positive, overfit_positive = 0, 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        out, inn = rng.normal(size=2000), rng.normal(size=2000)
        split_positive += epsilon_from_scores(out, inn, delta=1e-5, seed=seed).epsilon_lower_bound > 0
        threshold, direction = audit_module._select_threshold(out, inn, 1e-5, 0.95)
        fp, fn = audit_module._counts(np.sort(out), np.sort(inn), np.asarray([threshold]), direction)
        overfit_positive += epsilon_lower_bound(int(fp[0]), 2000, int(fn[0]), 2000, 1e-5) > 0
    assert split_positive <= 2  # at most 5% of 40
    assert overfit_positive >= 4  # the invalid procedure breaks its 95% promise
