"""padded_batch_size: the binomial tail above P is within the target, P-1's is not."""

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfdp.data import padded_batch_size


def exact_tail(n, q, p):
    """P(Binomial(n, q) > p), exactly, for a float q (taken at its exact value)."""
    q = Fraction(q)
    return sum(
        math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(max(p + 1, 0), n + 1)
    )


def float_log_tail(n, q, p):
    """log P(Binomial(n, q) > p) over the whole support, in float64 log space."""
    k = np.arange(p + 1, n + 1, dtype=np.float64)
    if k.size == 0:
        return -math.inf
    lg = np.vectorize(math.lgamma)
    log_pmf = (
        lg(n + 1.0) - lg(k + 1.0) - lg(n - k + 1.0)
        + k * math.log(q) + (n - k) * math.log1p(-q)
    )
    top = log_pmf.max()
    return top + math.log(np.exp(log_pmf - top).sum())


@pytest.mark.parametrize("n", [1, 2, 7, 30, 100])
@pytest.mark.parametrize("q", [0.01, 0.1, 1 / 3, 0.5, 0.9])
@pytest.mark.parametrize("eps", [0.3, 1e-3, 1e-6, 1e-12])
def test_minimal_against_exact_tail(n, q, eps):
    p = padded_batch_size(n, q, overflow_probability=eps, multiple=1)
    target = Fraction(eps)
    assert exact_tail(n, q, p) <= target
    # Minimal: one row fewer would overflow too often (p == 1 may be the floor).
    if p > 1 or exact_tail(n, q, 0) > target:
        assert exact_tail(n, q, p - 1) > target


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 80),
    q=st.floats(1e-3, 0.999),
    log10_eps=st.floats(-14, -0.5),
)
def test_minimal_property(n, q, log10_eps):
    eps = 10.0**log10_eps
    p = padded_batch_size(n, q, overflow_probability=eps, multiple=1)
    target = Fraction(eps)
    assert exact_tail(n, q, p) <= target
    if p > 1 or exact_tail(n, q, 0) > target:
        assert exact_tail(n, q, p - 1) > target


@pytest.mark.parametrize(
    "n,q", [(60000, 256 / 60000), (60000, 2048 / 60000), (2000, 0.3), (5000, 0.999)]
)
def test_large_n_against_full_support_sum(n, q):
    eps = 1e-12
    p = padded_batch_size(n, q, overflow_probability=eps, multiple=1)
    assert float_log_tail(n, q, p) <= math.log(eps) + 1e-6
    assert float_log_tail(n, q, p - 1) > math.log(eps) - 1e-6
    # Sanity: a few standard deviations above the mean.
    mean, sd = n * q, math.sqrt(n * q * (1 - q))
    assert mean < p < mean + 10 * sd + 10


def test_rounds_up_to_multiple():
    for n, q in [(60000, 256 / 60000), (1797, 64 / 1797), (100, 0.5)]:
        exact = padded_batch_size(n, q, multiple=1)
        for multiple in (1, 8, 32):
            got = padded_batch_size(n, q, multiple=multiple)
            assert got % multiple == 0
            assert got == max(multiple, -(-exact // multiple) * multiple)


def test_full_sampling_probability():
    assert padded_batch_size(100, 1.0, multiple=1) == 100
    assert padded_batch_size(100, 1.0) == 104


def test_huge_n_is_fast_and_sane():
    p = padded_batch_size(10**12, 1e-6, multiple=1)
    # mean 1e6, sd ~1000: the 1e-12 tail sits about 7 sd above the mean.
    assert 1_006_000 < p < 1_008_500


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_examples=0, sampling_probability=0.1), "num_examples"),
        (dict(num_examples=10, sampling_probability=0.0), "sampling_probability"),
        (dict(num_examples=10, sampling_probability=1.5), "sampling_probability"),
        (dict(num_examples=10, sampling_probability=0.1, overflow_probability=0.0),
         "overflow_probability"),
        (dict(num_examples=10, sampling_probability=0.1, overflow_probability=1.0),
         "overflow_probability"),
        (dict(num_examples=10, sampling_probability=0.1, multiple=0), "multiple"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        padded_batch_size(**kwargs)


def test_num_examples_type():
    with pytest.raises(TypeError, match="num_examples"):
        padded_batch_size(10.5, 0.1)
