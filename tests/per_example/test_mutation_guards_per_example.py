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
* Issue 55, item 8: each term below passed every relevant test when removed
  or shrunk; each test now builds the record at the boundary the term
  covers: the reduced weight's float32-cast margin and the 2^-40 that
  `shrink_weights` absorbs (and `norm_bounds` adds), OFFSET_SPREAD's 8, the
  assembly rounding and the offsets' flush error with weight decay,
  `summation_rounding`'s gamma(S + 2), `row_norm_bounds`' subnormal term,
  `subnormal_reading`'s sqrt(width), and both terms of `flushed_products`.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfdp.mechanisms import dpsgd
from tfdp.per_example import rounding
from tfdp.per_example.grads import (
    LinearGrads,
    MaterializedGrads,
    PerExampleGradients,
    shrink_weights,
)

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


# -- issue 55, item 8: the terms each bound adds, at the records they cover --------
#
# Each test below builds a record at the boundary one term covers and checks
# the bound against that record's exact error (computed in float64 or with
# fractions); removing or shrinking the term is the negative control, which
# fails it (each was a mutant that passed every relevant test).

SUBNORMAL = np.float32(2.0**-126 - 2.0**-149)  # float32's largest subnormal
TINY = rounding.FLOAT32_TINY


def _shrink_promise_excess(weights, norms, absolute):
    """max over examples of what each adds, |w'| n + a (0 at weight 0: the
    sum skips the row), over |w| n (1 + 2^-40), minus 1, exact in fractions:
    shrink_weights promises it is <= 0."""
    from fractions import Fraction
    reduced = shrink_weights(tf.constant(weights, tf.float32), tf.constant(norms, tf.float64),
                             tf.constant(absolute, tf.float64)).numpy()
    worst = -1.0
    for w, n, a, r in zip(weights, norms, absolute, reduced):
        used = 0 if r == 0 else abs(Fraction(float(r))) * Fraction(float(n)) + Fraction(float(a))
        allowed = abs(Fraction(float(w))) * Fraction(float(n)) * (1 + Fraction(2) ** -40)
        worst = max(worst, float(used / allowed - 1))
    return worst


def test_a_reduced_weight_keeps_its_margin_below_the_float32_cast():
    """Absolute errors of 2^-39 to 2^-26 of |w| n are too large to absorb
    and too small to move the float32 weight: cast to nearest, the reduced
    weight rounds back up to w and the example adds |w| n + a."""
    rng = np.random.default_rng(3)
    weights = rng.uniform(0.1, 2.0, 400).astype(np.float32)
    norms = rng.uniform(0.5, 4.0, 400)
    absolute = weights * norms * 2.0 ** rng.uniform(-39.0, -26.0, 400)
    assert _shrink_promise_excess(weights, norms, absolute) <= 0.0


def test_only_errors_below_2_to_the_minus_40_of_the_weight_are_absorbed():
    """Errors from 2^-40 to twice |w| n: the weight must shrink (or go to 0)
    so that the example still adds at most |w| n (1 + 2^-40)."""
    rng = np.random.default_rng(4)
    weights = rng.uniform(0.1, 2.0, 400).astype(np.float32)
    norms = rng.uniform(0.5, 4.0, 400)
    absolute = weights * norms * 2.0 ** rng.uniform(-40.0, 1.0, 400)
    assert _shrink_promise_excess(weights, norms, absolute) <= 0.0
    assert np.mean(shrink_weights(tf.constant(weights), tf.constant(norms),
                                  tf.constant(absolute)).numpy() == 0.0) > 0.02
    # control: the same weights are kept for errors below the margin
    small = weights * norms * 2.0**-41
    kept = shrink_weights(tf.constant(weights), tf.constant(norms), tf.constant(small))
    np.testing.assert_array_equal(kept.numpy(), weights)


def _materialized(rows, offsets=None):
    rows = tf.constant(rows, tf.float32)
    variable = tf.Variable(tf.zeros(rows.shape[1:]))
    offsets = None if offsets is None else [tf.constant(offsets, tf.float32)]
    return PerExampleGradients([variable], [MaterializedGrads([variable], [rows])], offsets)


def test_norm_bounds_cover_an_absorbed_absolute_error():
    """A gradient of norm 2e-24 over 4 entries: its flush error (2 TINY, about
    1e-14 of it, below 2^-40) is absorbed (the weight is kept), so the
    example adds up to its core bound plus that error, which norm_bounds'
    (1 + 2^-40) covers (compared exactly: the error is above float64's
    resolution of the norm)."""
    from fractions import Fraction
    per_example = _materialized(np.full((3, 4), 1e-24))
    core = per_example._core_norm_bounds()
    absolute = per_example.absolute_errors()
    weights = tf.ones([3])
    np.testing.assert_array_equal(shrink_weights(weights, core, absolute).numpy(),
                                  weights.numpy())  # absorbed
    for bound, c, a in zip(per_example.norm_bounds().numpy(), core.numpy(), absolute.numpy()):
        assert a > 2.0**-50 * c  # float64 sees it
        assert Fraction(float(bound)) >= Fraction(float(c)) + Fraction(float(a))


def test_a_gradient_cancelling_the_weight_decay_is_bounded_by_an_eighth_of_both():
    """g = -o: the sums of w g and of w o are added apart, so the bound keeps
    (|g| + |o|) / OFFSET_SPREAD, OFFSET_SPREAD = 8 (64 let the batch's
    separate sums grow 8x larger than the clipped contributions allow for)."""
    offset = np.array([3.0, -4.0, 1.0, 2.0], np.float32)
    per_example = _materialized(np.stack([-offset, -offset]), offsets=offset)
    size = float(np.linalg.norm(offset.astype(np.float64)))
    assert np.all(per_example.norm_bounds().numpy() >= 2.0 * size / 8.0)
    # control: the same gradient without offsets is bounded by its own norm
    assert np.all(_materialized(np.stack([-offset, -offset])).norm_bounds().numpy()
                  == pytest.approx(size, rel=1e-6))


def test_norm_bounds_with_offsets_add_the_assembly_rounding():
    """g and o orthogonal (every term exact): the bound is |g + o| plus
    3 gamma(1) (|g| + |o|), the rounding of assembling g and o apart."""
    per_example = _materialized(np.array([[1.0, 0.0, 0.0, 0.0]]),
                                offsets=np.array([0.0, 1.0, 0.0, 0.0]))
    bound = float(per_example.norm_bounds().numpy()[0])
    assembly = 3.0 * rounding.gamma(1) * 2.0
    assert bound - math.sqrt(2.0) >= assembly * (1.0 - 1e-6)


def test_absolute_errors_add_the_flushes_of_the_weight_decay_offsets():
    """(sum of weights) * o is cast to float32 entry by entry: each of o's
    1024 entries can flush (below TINY), an absolute error up to
    TINY sqrt(1024) = 32 TINY whatever the weights."""
    rows = np.full((2, 32, 32), 0.5, np.float32)
    offsets = np.full((32, 32), SUBNORMAL, np.float32)
    plain = _materialized(rows).absolute_errors().numpy()
    decayed = _materialized(rows, offsets=offsets).absolute_errors().numpy()
    lost = math.sqrt(1024) * float(SUBNORMAL)  # every entry of 1 * o flushed
    assert np.all(decayed - plain >= lost)


def test_a_one_position_record_keeps_the_rounding_of_w_g_and_of_its_product():
    """x, g, w in float32 for which the sum's x (w g), two roundings, is
    1.92 u off the exact product: gamma(1) per unit weight does not cover it,
    summation_rounding's gamma(S + 2) does."""
    from fractions import Fraction
    x, g, w = 1.9729582071304321, 1.0997570753097534, 1.8811959028244019
    part = LinearGrads(tf.constant([[[x]]]), tf.constant([[[g]]]), tf.Variable(tf.zeros([1, 1])))
    summed = float(part.weighted_sum(tf.constant([w]))[0].numpy()[0, 0])
    error = abs(Fraction(summed) - Fraction(x) * Fraction(g) * Fraction(w))
    assert float(error) > 1.9 * U32 * x * g * w  # the crafted record's rounding
    assert float(error) <= w * float(part.summation_errors().numpy()[0])


def test_row_norm_bounds_cover_subnormal_entries_read_as_zero():
    """A row of 16 entries just below TINY whose squares a cast read as 0
    (denormals-are-zero): its true norm is 4 * SUBNORMAL."""
    bound = float(rounding.row_norm_bounds(tf.zeros([1, 1], tf.float64), 16).numpy()[0, 0])
    assert bound >= 4.0 * float(SUBNORMAL)


def test_a_subnormal_input_row_read_as_zero_by_the_norm_is_covered():
    """x rows of 16 subnormal entries, which the Gram matrix may read as 0
    and the sum uses: the contribution moves by |x_s| |g_s| = 4 SUBNORMAL
    |g_s| per position, covered by subnormal_reading's sqrt(width)."""
    x = np.full((1, 2, 16), SUBNORMAL, np.float32)
    g = np.array([[[3.0] * 16, [4.0] * 16]], np.float32)
    part = LinearGrads(tf.constant(x), tf.constant(g), tf.Variable(tf.zeros([16, 16])))
    assert part._factored
    moved = sum(4.0 * float(SUBNORMAL) * float(np.linalg.norm(g[0, s].astype(np.float64)))
                for s in range(2))  # the two positions' rows, in the worst direction
    assert float(part.summation_errors().numpy()[0]) >= moved


def _factored(x, g):
    part = LinearGrads(tf.constant(x), tf.constant(g), tf.Variable(tf.zeros([8, 8])))
    assert part._factored
    return float(part.absolute_errors().numpy()[0])


def test_flushed_gradient_rows_times_large_inputs_are_covered():
    """w g_s with 8 entries just below TINY (flushed), then multiplied by
    |x_s| = 1e30 at 2 equal positions: the lost contribution is
    2 |x_s| sqrt(8) SUBNORMAL, which needs flushed_products' sqrt(width)."""
    x = np.zeros((1, 2, 8), np.float32)
    x[0, :, 0] = 1e30
    g = np.full((1, 2, 8), SUBNORMAL, np.float32)
    lost = 2.0 * float(np.float32(1e30)) * math.sqrt(8) * float(SUBNORMAL)
    assert _factored(x, g) >= lost


def test_products_flushed_in_every_partial_sum_are_covered():
    """x entries 2^-60 and g entries just below 2^-66: every product
    x_k (w g_o) is just below TINY and flushed, so each of the 64 result
    entries loses up to 2 (positions) x TINY: 16 TINY in norm, with
    |x_s| sqrt(8) TINY negligible (the per-partial-sum term is needed)."""
    x = np.full((1, 2, 8), 2.0**-60, np.float32)
    g = np.full((1, 2, 8), np.float32(2.0**-66) * np.float32(1 - 2.0**-23), np.float32)
    product = 2.0**-60 * float(g[0, 0, 0])
    assert product < TINY
    lost = math.sqrt(64) * 2 * product
    assert _factored(x, g) >= lost


def _all_subnormal_parts():
    """A [1, 16, 16] gradient of subnormal entries: an Embedding's 16 rows
    (distinct ids: its merged rows are the rows) and a materialized one."""
    from tfdp.per_example.rules.embedding import EmbeddingGrads

    g = tf.constant(np.full((1, 16, 16), SUBNORMAL, np.float32))
    ids = tf.constant([list(range(16))])
    return [EmbeddingGrads(ids, g, tf.Variable(tf.zeros([16, 16]))),
            MaterializedGrads([tf.Variable(tf.zeros([16, 16]))], [g])]


@pytest.mark.parametrize("index", [0, 1], ids=["embedding", "materialized"])
def test_summed_as_measured_counts_every_entry(index):
    """Review 14, m2: a part that sums what it measured can have each of its
    T D entries read as 0 by the norm and as subnormal by the sum, or
    flushed in w g: sqrt(T D) SUBNORMAL in norm. The terms counted the
    rounding's T + D + 1 instead (sqrt(33) against 16 here)."""
    part = _all_subnormal_parts()[index]
    moved = 16.0 * float(SUBNORMAL)  # sqrt(256) entries of SUBNORMAL
    assert float(part.summation_errors().numpy()[0]) >= moved
    assert float(part.absolute_errors().numpy()[0]) >= moved
