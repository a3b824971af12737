"""Factored norms from float32 Gram matrices (issue 53, item 2): each term
of `rounding.float32_gram_error` and its fallbacks, at records built to need
it. The negative control of each test is the bound with that term removed
(`float32_dot_error` patched), which the same record breaks.

The float64 summation term and the 3 a b cross terms of
`float32_gram_error` have no such record: on every record they are smaller
than what the relative terms leave over (the proof on the per-example page,
step 4, needs them; no test can tell them apart)."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.per_example import gram_precision, rounding


def _exact(x, g):
    """Exact-enough ||sum_s x_s g_s^T||^2 in float64 (products of float32
    values are exact there; the sums are within 1e-16 relative)."""
    m = np.einsum("bsk,bso->bko", x.astype(np.float64), g.astype(np.float64))
    return np.sum(m**2, (1, 2))


def _bound(x, g):
    """The squared-norm bound as the compiled step computes it (flush-to-zero
    holds inside tf.function)."""
    return tf.function(rounding.factored_norm_bounds)(tf.constant(x), tf.constant(g))[0].numpy()


def _without(monkeypatch, relative=True, absolute=True, width=None):
    """Patch `float32_dot_error` to drop its relative and/or absolute term
    (for rows of `width` only, or all)."""
    original = rounding.float32_dot_error

    def mutant(n, chunk=rounding.FLOAT32_GRAM_CHUNK):
        rel, abs_ = original(n, chunk)
        if width is None or n == width:
            return (0.0 if relative else rel), (0.0 if absolute else abs_)
        return rel, abs_

    monkeypatch.setattr(rounding, "float32_dot_error", mutant)


@pytest.mark.parametrize("width", [256, 300])  # one chunk; two, the last padded
def test_every_gram_entry_is_within_its_dot_error(width):
    """|A^_st - A_st| <= ga |x_s||x_t| + ea for every entry; the records'
    entries do round (the control: without ga the check fails)."""
    rng = np.random.default_rng(width)
    x = (1.0 + rng.random((4, 8, width)) * 2.0**-6).astype(np.float32)
    x *= rng.choice([-1.0, 1.0], size=x.shape).astype(np.float32)
    computed = tf.function(rounding.float32_gram)(tf.constant(x)).numpy()
    x64 = x.astype(np.float64)
    exact = np.einsum("bsk,btk->bst", x64, x64)
    rows = np.sqrt(np.einsum("bsk,bsk->bs", x64, x64))
    relative, absolute = rounding.float32_dot_error(width)
    error = np.abs(computed - exact)
    assert np.all(error <= relative * rows[:, :, None] * rows[:, None, :] + absolute)
    assert np.max(error) > 1e-3 * relative * np.max(rows) ** 2  # rounding happened
    assert np.any(error > absolute)  # so relative = 0 fails the check


def _cancelling_record(seed):
    """Two nearly equal x rows (entries about 1, 2^-14 apart) with
    g = (1, -1): the true norm is |x_1 - x_2| (about 3e-4), below the float32
    Gram matrices' rounding (about 256 u |x|^2 = 1.5e-5 in the squared norm)."""
    rng = np.random.default_rng(seed)
    x1 = 1.0 + rng.random(256) * 2.0**-6
    x2 = x1 + rng.choice([-1.0, 1.0], 256) * 2.0**-14
    x = np.stack([x1, x2])[None].astype(np.float32)
    g = np.array([[[1.0], [-1.0]]], np.float32)
    return x, g


def test_a_cancelling_record_needs_the_relative_terms(monkeypatch):
    """Records whose float32 double sum comes out below the truth: the bound
    holds; without ga and gb it does not, on at least one of them."""
    records = [_cancelling_record(seed) for seed in range(12)]
    x = np.concatenate([r[0] for r in records])  # one example each
    g = np.concatenate([r[1] for r in records])
    truth = _exact(x, g)
    assert np.all(_bound(x, g) >= truth)
    _without(monkeypatch, absolute=False)
    assert np.any(_bound(x, g) < truth)


@pytest.mark.parametrize("side", ["x", "g"])
def test_flushed_gram_products_need_the_absolute_term(monkeypatch, side):
    """Rows of 1e-20 behind rows of 1e10: the tiny rows' products (1e-40)
    are flushed to zero, so their Gram matrix is 0 and the double sum is 0;
    the true squared norm is about 5e-19. ea (eb) bounds what was flushed."""
    tiny = np.full((1, 2, 4), 1e-20, np.float32)
    large = np.full((1, 2, 3), 1e10, np.float32)
    x, g = (tiny, large) if side == "x" else (large, tiny)
    truth = _exact(x, g)[0]
    assert tf.function(rounding.float32_gram)(tf.constant(tiny)).numpy().max() == 0.0
    assert _bound(x, g)[0] >= truth
    _without(monkeypatch, relative=False, width=tiny.shape[-1])  # the tiny rows' side only
    assert _bound(x, g)[0] < truth


def test_an_overflowing_gram_falls_back_to_float64():
    """Rows of 1e25 cancelling across positions: the float32 Gram entries
    (1e52) overflow; the norm takes the float64 route and still bounds the
    truth, while the float32 route alone gives no number."""
    rng = np.random.default_rng(0)
    row = (rng.random(16) * 1e25).astype(np.float32)
    x = np.stack([row, row])[None]
    g = np.array([[[1.0, 2.0], [-1.0, -2.0 + 2.0**-20]]], np.float32)
    gram = tf.function(rounding.float32_gram)(tf.constant(x)).numpy()
    assert not np.all(np.isfinite(gram))
    bound = _bound(x, g)[0]
    assert np.isfinite(bound) and bound >= _exact(x, g)[0]
    reference = tf.function(rounding._float64_factored)(tf.constant(x), tf.constant(g))[0]
    assert bound == max(float(reference.numpy()[0]), 0.0)


def test_one_position_is_bounded_by_its_row_norms():
    """One position: |x|^2 |g|^2 from the rows' bounds, subnormal to huge."""
    x = np.array([[[3e38, 1e-45, -2e-38]]], np.float32)
    g = np.array([[[1e-30, 0.0, 4e-39]]], np.float32)
    assert _bound(x, g)[0] >= _exact(x, g)[0]


@pytest.mark.parametrize("where,value", [(2, 1e25), (2, np.nan), (0, np.nan)],
                         ids=["overflowing", "nan", "nan_first_entry"])
def test_an_example_is_bounded_by_its_own_gram_alone(where, value):
    """Review 11, C2: one route for the batch let one record's overflowing
    (or NaN) Gram entries send every example to float64, whose bound is
    smaller (1.0086 times the allowed update with 1000 clipped examples);
    and the canaries read the batch's first entry, so a NaN there did the
    same. Now each example's route is its own."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 2, 256)).astype(np.float32)
    g = rng.normal(size=(3, 2, 16)).astype(np.float32)
    if not gram_precision.gram_rounds_as_float32(x.shape, g.shape):
        pytest.skip(f"no float32 Gram route here: {gram_precision.gram_path()}")
    alone = _bound(x, g)
    if where == 0:
        x[0, 0, 0] = value
    else:
        x[where] = value
    others = [i for i in range(3) if i != where]
    np.testing.assert_array_equal(_bound(x, g)[others], alone[others])


@pytest.mark.parametrize("value", [1e25, np.nan], ids=["overflowing", "nan"])
def test_an_examples_row_bounds_are_its_own_too(value):
    """The row bounds (which feed the summation, decay and cross-term
    errors) are chosen per example with the squared norm (review 12, m1)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 2, 256)).astype(np.float32)
    g = rng.normal(size=(3, 2, 16)).astype(np.float32)
    if not gram_precision.gram_rounds_as_float32(x.shape, g.shape):
        pytest.skip(f"no float32 Gram route here: {gram_precision.gram_path()}")
    bounds = tf.function(rounding.factored_norm_bounds)
    alone = [t.numpy() for t in bounds(tf.constant(x), tf.constant(g))]
    x[2] = value
    beside = [t.numpy() for t in bounds(tf.constant(x), tf.constant(g))]
    for before, after in zip(alone, beside):
        np.testing.assert_array_equal(after[:2], before[:2])
