"""Row norms from float32 squares (`rounding.row_bounds`, issue 53): each term
of the bound at records built to need it, with the bound less that term as
the negative control; the float64 routes; and the weighted sum that skips
masking x where every row bound is finite."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.per_example import grads, rounding


def _bounds(rows):
    """Row bounds as the compiled step computes them (flush-to-zero holds
    inside tf.function)."""
    return tf.function(rounding.row_bounds)(tf.constant(rows)).numpy()


def _exact(rows):
    return np.sqrt(np.sum(rows.astype(np.float64) ** 2, -1))


def _rounding_rows():
    """Rows whose float32 sums of squares round, some of them down."""
    rng = np.random.default_rng(7)
    rows = 1.0 + rng.random((64, 1, 777)) * 2.0**-6
    return (rows * rng.choice([-1.0, 1.0], rows.shape)).astype(np.float32)


def test_the_relative_term_covers_float32_rounding(without_dot_error_terms):
    rows = _rounding_rows()
    assert np.all(_bounds(rows) >= _exact(rows))
    without_dot_error_terms(relative=True)
    assert np.any(_bounds(rows) < _exact(rows))  # some sum rounded down


def _sequential_worst_case(width):
    """(float32 sum of squares added left to right, exact sum) of a row
    1, 2^-12, ..., 2^-12: every square 2^-24 is half an ulp of the running
    1.0 and rounds away (to even), so the sum loses (width - 1) 2^-24 of 1:
    near gamma(width), the most any order can lose."""
    squares = np.concatenate([[1.0], np.full(width - 1, 2.0**-24)]).astype(np.float32)
    computed = np.cumsum(squares, dtype=np.float32)[-1]  # one left-to-right order
    return float(computed), float(np.sum(squares.astype(np.float64)))


@pytest.mark.parametrize("width", [16, 512, 4096])
def test_the_relative_term_is_gamma_of_the_whole_row(width):
    """TensorFlow's reductions round far from the worst case, so the bound's
    relative term is pinned at a legal order that reaches it: the bound holds
    with gamma(width), and fails with gamma(width / 2) or less."""
    computed, exact = _sequential_worst_case(width)
    assert computed == 1.0 and exact - computed > (width - 1.5) * 2.0**-24
    squares = tf.constant([[computed]], tf.float64)
    bound = rounding.float32_row_bounds(squares, width, chunk=width).numpy()[0, 0]
    assert bound >= np.sqrt(exact)
    halved = rounding.row_norm_bounds(
        squares / (1.0 - rounding.gamma(width // 2, tf.float64)), width).numpy()[0, 0]
    assert halved < np.sqrt(exact)  # the control: half the relative term is not enough


def test_row_bounds_bound_the_whole_row_as_one_chunk():
    """`row_bounds` sums a row's squares in one float32 reduction: its bound
    is `float32_row_bounds` with one chunk of the row's width (a smaller
    chunk would have a smaller relative term than that reduction needs)."""
    rows = _rounding_rows()
    width = rows.shape[-1]
    squares = tf.cast(tf.reduce_sum(tf.square(tf.constant(rows)), -1), tf.float64)
    expected = rounding.float32_row_bounds(squares, width, chunk=width).numpy()
    np.testing.assert_array_equal(rounding.row_bounds(tf.constant(rows)).numpy(), expected)
    shorter = rounding.float32_row_bounds(squares, width, chunk=width // 2).numpy()
    assert np.all(shorter < expected)  # the control: the chunk shows in the bound


def test_flushed_squares_need_the_absolute_term():
    """Squares of 2^-64 (2^-128) flush to 0 in float32: a row of them sums
    to 0, and only the absolute term 2 C tau bounds its norm sqrt(C) 2^-64."""
    width = 256
    exact = np.sqrt(width) * 2.0**-64
    zero = tf.zeros([1, 1], tf.float64)
    assert rounding.float32_row_bounds(zero, width, chunk=width).numpy()[0, 0] >= exact
    relative, _ = rounding.float32_dot_error(width, width)
    assert rounding.row_norm_bounds(zero / (1.0 - relative), width).numpy()[0, 0] < exact


@pytest.mark.parametrize("tiny", [0.0, 1e-20])
def test_rows_whose_squares_may_have_flushed_take_float64(tiny, without_dot_error_terms):
    """Squares of 1e-20 (1e-40) are below 2^-126: flushed to 0 in float32. A
    row whose float32 sum is below the floor takes float64 squares, which
    measure it (and a zero row as 0: float32's absolute term would make it
    about 1e-18, times a huge |x| in a rank-one bound). Under the floor
    float32's absolute term is dominated by its relative one, so no record
    can show it (the proof keeps it)."""
    rows = np.ones((2, 1, 300), np.float32)
    rows[1] = tiny
    without_dot_error_terms(absolute=True)  # float64 squares need no such term
    bounds = _bounds(rows)
    assert np.all(bounds >= _exact(rows))
    assert bounds[1, 0] < 1e-19 * np.sqrt(300)


def test_the_floor_is_what_sends_tiny_rows_to_float64(monkeypatch):
    rows = np.full((1, 1, 300), 1e-20, np.float32)
    monkeypatch.setattr(rounding, "FLOAT32_SQUARES_FLOOR", 0.0)  # the control
    assert _bounds(rows)[0, 0] > 1e-18  # float32's absolute term, sqrt(2 K tau)


def test_overflowing_squares_take_float64():
    # 1e20 squared overflows float32; float64 squares are exact.
    rows = np.full((3, 2, 5), 1e20, np.float32)
    rows[0, 0, 0] = 1.0
    bounds = _bounds(rows)
    assert np.all(np.isfinite(bounds))
    np.testing.assert_allclose(bounds, _exact(rows), rtol=1e-6)
    assert np.all(bounds >= _exact(rows))


@pytest.mark.parametrize("route", ["wide", "setting"])
def test_float64_routes(monkeypatch, route):
    calls = []
    original = rounding._row_squares64
    monkeypatch.setattr(rounding, "_row_squares64", lambda rows: calls.append(1) or original(rows))
    width = rounding.FLOAT32_SQUARES_WIDTH + 1 if route == "wide" else 8
    if route == "setting":  # oneDNN allowed to narrow float32 arithmetic
        monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    rows = np.random.default_rng(0).normal(size=(2, 1, width)).astype(np.float32)
    assert np.all(rounding.row_bounds(tf.constant(rows)).numpy() >= _exact(rows))
    assert calls  # float64 squares
    calls.clear()
    monkeypatch.delenv("ONEDNN_DEFAULT_FPMATH_MODE", raising=False)
    rounding.row_bounds(tf.constant(rows[..., :8]))  # eagerly: only the branch taken runs
    assert not calls  # the control: float32 squares


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_zero_weight_row_that_is_not_finite_adds_nothing(bad):
    x = np.ones((3, 1, 4), np.float32)
    x[1, 0, 2] = bad  # its bound is not finite: x is masked
    g = np.ones((3, 1, 2), np.float32)
    g[1] = bad
    kernel = tf.Variable(tf.zeros([4, 2]))
    part = grads.LinearGrads(tf.constant(x), tf.constant(g), kernel)
    part.sq_norms()
    summed = part.weighted_sum(tf.constant([0.5, 0.0, 0.25]))[0].numpy()
    np.testing.assert_array_equal(summed, np.full((4, 2), 0.75, np.float32))


@pytest.mark.parametrize("positions, width", [(1, 64), (4, 256)], ids=["one", "ghost"])
def test_a_float64_x_beyond_float32_at_zero_weight_adds_nothing(positions, width):
    """Review of a2b925d (CRITICAL, from dba3e60): a rule's float64 x with a
    finite entry of 1e39 has a finite row bound, so x went unmasked into the
    float32 matmul, which cast the entry to inf: 0 times inf put NaN into
    the batch's sum. A float64 x is masked."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, positions, width)) * 1e-2
    x[2, 0, 0] = 1e39
    g = (rng.normal(size=(3, positions, width)) * 1e-2).astype(np.float32)
    kernel = tf.Variable(tf.zeros([width, width]))
    part = grads.LinearGrads(tf.constant(x, tf.float64), tf.constant(g), kernel)
    assert part._factored
    assert np.all(np.isfinite(part._rows()[0].numpy()))
    summed = part.weighted_sum(tf.constant([1.0, 0.5, 0.0]))[0].numpy()
    kept = grads.LinearGrads(tf.constant(x[:2], tf.float64), tf.constant(g[:2]), kernel)
    assert np.all(np.isfinite(summed))
    np.testing.assert_array_equal(summed, kept.weighted_sum(tf.constant([1.0, 0.5]))[0].numpy())


def test_finite_rows_at_zero_weight_are_multiplied_by_zero_rows():
    # Unmasked x (every bound finite): the zero-weight example adds 0.
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 1, 6)).astype(np.float32) * 1e30
    g = rng.normal(size=(4, 1, 3)).astype(np.float32)
    kernel = tf.Variable(tf.zeros([6, 3]))
    weights = tf.constant([1.0, 0.0, 2.0, 0.0])
    summed = grads.LinearGrads(tf.constant(x), tf.constant(g), kernel).weighted_sum(weights)[0]
    # The same sum with those examples' rows zero: one shape, so one order
    # of summation whatever kernel TensorFlow's matmul runs (oneDNN's or
    # Eigen's, which block a batch of 4 and one of 2 differently).
    zeroed = x.copy()
    zeroed[[1, 3]] = 0.0
    expected = grads.LinearGrads(tf.constant(zeroed), tf.constant(g), kernel).weighted_sum(
        weights)[0]
    np.testing.assert_array_equal(summed.numpy(), expected.numpy())
    assert np.isfinite(summed.numpy()).all() and np.abs(summed.numpy()).max() > 1e28


@pytest.mark.parametrize("other", [2.05e19, np.inf, np.nan], ids=["overflowing", "inf", "nan"])
def test_a_row_is_bounded_by_its_own_values_alone(other):
    """Review 11, C1: with one route for the batch, a row whose float32
    squares overflow sent every row to float64 squares, whose bound is
    smaller: one record raised every other clipped example's weight (an
    update moved 1.122 times the bound with 1000 clipped examples)."""
    rows = np.ones((3, 1, 4096), np.float32)
    alone = _bounds(rows)
    rows[2] = other
    beside = _bounds(rows)
    np.testing.assert_array_equal(beside[:2], alone[:2])


def test_one_overflowing_record_does_not_raise_the_others_weights():
    """Review 11, C1, through the compiled step (noise 0): 50 clipped
    records and one whose float32 squares overflow, clipped the same way.
    With one route for the batch, adding it moved the update 1.0061 times
    lr C / b."""
    import keras

    import tfdp
    from tfdp.auditing.neighbour_step import NeighbourStep

    width, n = 4096, 50
    model = tfdp.DPSequential([keras.Input((width,)),
                               keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    data = (np.ones((n, width), np.float32), np.full((n, 1), -1000.0, np.float32))
    scale = np.float32(2.05e19 / np.sqrt(width))  # |x| = 2.05e19: float32 squares overflow
    record = (np.full(width, scale, np.float32), np.full(1, -0.1, np.float32))
    with NeighbourStep(model, data, records=n, batch_size=n + 1, physical_batch_size=None) as step:
        assert step.ratio(record, "add") <= 1.0 + 1e-5


def test_x_is_masked_where_a_setting_lets_the_matmul_read_it_narrower(monkeypatch):
    """Under a reduced-precision setting a finite 3e38 could be read as inf
    by the matmul (inf times a zero row of w g adds NaN), so x is masked
    whatever its bounds (review 12, m2): the zero-weight row never reaches
    the matmul."""
    from tfdp.per_example import gram_precision

    monkeypatch.setattr(gram_precision, "reduced_precision_settings", lambda: ["a setting"])
    seen = []
    original = tf.matmul

    def recording(a, b, **kwargs):
        seen.append(a)
        return original(a, b, **kwargs)

    monkeypatch.setattr(grads.tf, "matmul", recording)
    x = np.ones((2, 1, 3), np.float32)
    x[1] = 3e38
    part = grads.LinearGrads(tf.constant(x), tf.ones([2, 1, 2]), tf.Variable(tf.zeros([3, 2])))
    part.weighted_sum(tf.constant([1.0, 0.0]))
    np.testing.assert_array_equal(seen[-1].numpy()[1], 0.0)
    monkeypatch.setattr(gram_precision, "reduced_precision_settings", lambda: [])  # the control
    part.weighted_sum(tf.constant([1.0, 0.0]))
    assert seen[-1].numpy()[1, 0] == np.float32(3e38)
