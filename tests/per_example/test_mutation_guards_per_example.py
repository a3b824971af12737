"""Guards found missing by a mutation test of the privacy code (issue 43, item 12).

* Weight decay before clipping with a cancelling-positions record: the norm
  bound of an example with offsets must still add the rounding of the
  factored weighted sum (`summation_errors`); dropping it there passed every
  test while such a record moved the update 1.01 to 1.04 C (seeds below).
* The margins of the float64 bounds in `tfdp.per_example.rounding` (gamma,
  the terms it is taken over, the round-up to float32, the sum of squares,
  the factored norm's gamma * mass^2) were unpinned: each test below fails
  if its margin is removed or reduced. They pin lower bounds, so a larger
  margin (an added error term) still passes.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfdp.mechanisms import dpsgd
from tfdp.per_example import rounding
from tfdp.per_example.grads import LinearGrads, PerExampleGradients

CLIP = 1.0
TOLERANCE = 1.0 + 1e-5
U32, U64 = 2.0**-24, 2.0**-53


def _clipped_norm(per_example):
    """float64 norm of the clipped contribution the weighted sum adds."""
    factors = dpsgd.clip_factors(per_example.sq_norms(), CLIP, None)
    sums = per_example.weighted_sum(factors)
    return float(np.sqrt(sum(np.sum(np.square(s.numpy().astype(np.float64))) for s in sums)))


def cancelling_record(seed, gap, offset_size, magnitude=1e8, width=8):
    """rounding.py's docstring record in random directions: two equal input
    positions whose output gradients g and -g + delta (|g| = magnitude,
    |delta| = gap) cancel, and weight-decay offsets of norm `offset_size`."""
    rng = np.random.default_rng(seed)

    def unit(n, size=1.0):
        v = rng.normal(size=n)
        return v * size / np.linalg.norm(v)

    position = unit(width)
    x = np.stack([position, position])[None]
    g = unit(width, magnitude)
    g = np.stack([g, -g + unit(width, gap)])[None]
    offset = unit(width * width, offset_size).reshape(width, width)
    return x.astype(np.float32), g.astype(np.float32), offset.astype(np.float32)


@pytest.mark.parametrize("seed, gap, offset_size",
                         [(34, 30.0, 1e-3), (34, 100.0, 1e-3), (28, 100.0, 1e-3),
                          (24, 100.0, 1e-3), (1, 100.0, 0.1)])
def test_weight_decay_before_clipping_keeps_a_cancelling_record_within_c(seed, gap, offset_size):
    """The clipped contribution (gradient plus offsets) stays within C; the
    float32 matmul over the record's two positions rounds by up to
    u |x| |g| (about 6 here against a true norm of 30 to 100), which the
    bound must add even when offsets take the expansion branch."""
    x, g, offset = cancelling_record(seed, gap, offset_size)
    kernel = tf.Variable(tf.zeros([8, 8]))
    part = LinearGrads(tf.constant(x), tf.constant(g), kernel)
    assert part._ghost  # the factored sum, whose rounding is at stake
    per_example = PerExampleGradients([kernel], [part], offsets=[tf.constant(offset)])
    assert _clipped_norm(per_example) <= CLIP * TOLERANCE


# -- the margins of the bounds ---------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 10, 1000, 10**6])
def test_gamma_is_n_u_over_one_minus_n_u(n):
    for dtype, unit in ((tf.float32, U32), (tf.float64, U64)):
        exact = n * unit / (1.0 - n * unit)
        assert rounding.gamma(n, dtype) == exact
        assert rounding.gamma(n, dtype) > n * unit  # the 1 / (1 - n u) is kept
        assert float(rounding.gamma(tf.constant(n), dtype)) == pytest.approx(exact, rel=1e-15)
    assert rounding.gamma(n) == rounding.gamma(n, tf.float32)


def test_gamma_refuses_a_bound_that_is_too_loose():
    with pytest.raises(ValueError, match="too loose"):
        rounding.gamma(2**23)
    assert math.isinf(float(rounding.gamma(tf.constant(2**23))))


def test_terms_per_example_adds_the_axes_lengths_and_one():
    assert rounding.terms_per_example(tf.zeros([2, 3, 5])) == 9
    assert rounding.terms_per_example(tf.zeros([4, 7])) == 8


@pytest.mark.parametrize("value", [1.0, 3.0, 0.1, 1e-30, 123456.789, 3e37, 2.0**20 + 0.5])
def test_round_up_to_float32_keeps_a_relative_margin_of_2_to_the_minus_20(value):
    values = np.array([value * (1.0 + k * 2.0**-30) for k in range(64)], np.float64)
    rounded = rounding.round_up_to_float32(tf.constant(values)).numpy().astype(np.float64)
    # value (1 + 2^-20) rounded to nearest float32: at least (1 + 2^-20)(1 - 2^-24)
    assert np.all(rounded / values - 1.0 >= 2.0**-20 - 2.0**-23)


def test_round_up_to_float32_covers_the_clip_factor_that_follows():
    """What the margin is for: a norm rounded up and then clipped in float32
    (sqrt, division) scales the true norm to at most C."""
    rng = np.random.default_rng(0)
    sq = np.exp(rng.uniform(-60.0, 60.0, 20000))
    rounded = rounding.round_up_to_float32(tf.constant(sq))
    for clip in (1.0, 0.1, 3.0):
        factor = tf.minimum(1.0, clip / tf.sqrt(rounded)).numpy().astype(np.float64)
        assert np.all(factor * np.sqrt(sq) <= clip)


def test_sum_of_squares_adds_gamma_of_its_terms_plus_one():
    """Sums of squares that are powers of two: the float64 result is exactly
    sum * fl(1 + gamma(n + 1)), n = 64 + 1 + 1 the terms of [B, 64, 1],
    and fl(1 + gamma(66)) = 1 + 66 u is below fl(1 + gamma(67)) = 1 + 68 u."""
    assert float(rounding.sum_of_squares(tf.constant([[3.0, 4.0]]))[0]) >= 25.0 * (
        1.0 + rounding.gamma(4, tf.float64))
    entries = np.stack([np.ones((64, 1)), np.full((64, 1), 2.0)])       # sums 64 and 256
    got = rounding.sum_of_squares(tf.constant(entries, tf.float32)).numpy()
    margin = 1.0 + rounding.gamma(64 + 1 + 1 + 1, tf.float64)
    assert margin == 1.0 + 68 * U64
    assert got[0] >= 64.0 * margin and got[1] >= 256.0 * margin


def _cancelling_pair():
    """x rows equal, g rows [2^20, 0], [-2^20, 1]: Gram products exact in
    float64, true squared norm exactly 1, mass 2^20 + sqrt(2^40 + 1)."""
    x = np.zeros((1, 2, 2), np.float32)
    x[0, :, 0] = 1.0
    g = np.array([[[2.0**20, 0.0], [-(2.0**20), 1.0]]], np.float32)
    mass = 2.0**20 + math.sqrt(2.0**40 + 1.0)
    return x, g, mass


def test_factored_norm_bounds_add_gamma_times_mass_squared():
    x, g, mass = _cancelling_pair()
    sq = rounding.factored_norm_bounds(tf.constant(x), tf.constant(g))[0].numpy()[0]
    terms = 2 + 2 + 2 * 2 + 4  # K + O + 2 S + 4
    # sq = 1 (exact here) + gamma(terms) mass^2 (about 0.006), mass >= the exact one
    assert (sq - 1.0) / (rounding.gamma(terms, tf.float64) * mass**2) >= 1.0 - 1e-6
