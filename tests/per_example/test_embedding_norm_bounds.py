"""An embedding's per-example norm from float32 squares of its merged rows
(`rounding.row_bounds` with no floor, squared and summed in float64): an
upper bound of the true squared norm on records built to need each term,
with the bound less that term as the negative control."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.per_example import rounding
from tfdp.per_example.rules.embedding import EmbeddingGrads


def _bounds(ids, g):
    """Each example's squared-norm bound as the compiled step computes it
    (flush-to-zero holds inside tf.function)."""
    table = tf.Variable(tf.zeros([int(np.max(ids)) + 1, g.shape[-1]]))
    return tf.function(lambda i, r: EmbeddingGrads(i, r, table).sq_norm_bounds())(
        tf.constant(ids, tf.int32), tf.constant(g)).numpy()


def _exact(ids, g):
    """Each example's true squared norm: its rows of one id added first,
    in extended precision."""
    out = []
    for row_ids, rows in zip(np.asarray(ids), np.asarray(g, np.longdouble)):
        merged = {}
        for token, row in zip(row_ids, rows):
            merged[token] = merged.get(token, 0) + row
        out.append(sum(float(np.sum(r * r)) for r in merged.values()))
    return np.array(out)


def _rounding_rows():
    """Rows whose float32 sums of squares round, some down, with repeated
    ids (so merged and zero rows)."""
    rng = np.random.default_rng(7)
    g = 1.0 + rng.random((64, 6, 777)) * 2.0**-6
    ids = rng.integers(0, 4, (64, 6))
    return ids, (g * rng.choice([-1.0, 1.0], g.shape)).astype(np.float32)


def test_the_relative_term_covers_float32_rounding(without_dot_error_terms):
    ids, g = _rounding_rows()
    assert np.all(_bounds(ids, g) >= _exact(ids, g))
    without_dot_error_terms(relative=True)
    assert np.any(_bounds(ids, g) < _exact(ids, g))  # the control: some sums rounded down


def test_flushed_squares_are_bounded_by_the_absolute_term(without_dot_error_terms):
    """Entries of 1e-20 square to 1e-40, flushed to 0 in float32: with no
    floor such a row keeps float32's bound, which only its absolute term
    makes an upper bound."""
    ids = np.array([[0, 1, 1]])
    g = np.full((1, 3, 300), 1e-20, np.float32)
    assert _bounds(ids, g)[0] >= _exact(ids, g)[0] > 0
    without_dot_error_terms(absolute=True)
    assert _bounds(ids, g)[0] < _exact(ids, g)[0]


def test_zero_rows_of_repeated_ids_keep_float32s_bound(monkeypatch):
    """The merged-away rows are zero: they keep float32's bound, its absolute
    term only (about 1.7e-18 for 128 entries), instead of sending the batch
    to float64 squares (the floor of 0): the bound of an example of zero
    rows is that term squared, tiny; with the floor (the control) float64
    measures them, far below it."""
    ids = np.array([[3, 3, 3, 3], [1, 2, 1, 0]])
    g = np.ones((2, 4, 128), np.float32)
    g[0] = 0.0
    bounds, exact = _bounds(ids, g), _exact(ids, g)
    assert exact[0] == 0 and 1e-36 < bounds[0] < 1e-34
    assert exact[1] <= bounds[1] < exact[1] * (1 + 1e-5)
    row_bounds = rounding.row_bounds
    monkeypatch.setattr(rounding, "row_bounds", lambda rows, floor=None: row_bounds(rows))
    assert _bounds(ids, g)[0] < 1e-60


def test_the_squared_sum_is_rounded_up():
    """Bounds whose float64 squares are lost in the sum (a quarter ulp of the
    first each): gamma64(T + 2) covers them, the plain sum (the control)
    falls short."""
    from fractions import Fraction

    values = [1.0] + [2.0**-27] * 999
    exact = sum(Fraction(b) ** 2 for b in values)
    bounds = tf.constant([values], tf.float64)
    assert Fraction(float(rounding.sum_of_squared_bounds(bounds)[0])) >= exact
    assert Fraction(float(tf.reduce_sum(bounds * bounds, 1)[0])) < exact


def test_overflowing_squares_take_float64():
    ids = np.array([[0, 1], [2, 2]])
    g = np.full((2, 2, 5), 1e20, np.float32)
    g[0, 0, 0] = 1.0
    bounds = _bounds(ids, g)
    assert np.all(np.isfinite(bounds)) and np.all(bounds >= _exact(ids, g))
    np.testing.assert_allclose(bounds, _exact(ids, g), rtol=1e-5)


@pytest.mark.parametrize("bad", [np.inf, np.nan, 2e19])
def test_a_row_that_is_not_finite_is_not_bounded_and_moves_no_other(bad):
    """A record whose row is not finite (or whose squares overflow float32)
    takes its own route; the other records' bounds do not move by a bit
    (the control: the same batch with that record finite)."""
    ids = np.array([[0, 1], [0, 1]])
    g = np.random.default_rng(3).normal(size=(2, 2, 3)).astype(np.float32)
    clean = _bounds(ids, g)
    g[0, 1, 2] = bad
    bounds = _bounds(ids, g)
    assert np.isfinite(bounds[0]) == (bad == 2e19)
    assert bounds[1].tobytes() == clean[1].tobytes()
