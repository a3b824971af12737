"""The bias of a map at one position (every Dense on [B, K]): its gradient is
g's row, bounded by the row bound the kernel's rank-one bound already holds,
and summed from the w g the kernel's sum forms (issue 53), at crafted rows,
with the bound less the bias term as the negative control."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.per_example import grads


def _part(x, g):
    kernel = tf.Variable(tf.zeros([x.shape[2], g.shape[2]]))
    bias = tf.Variable(tf.zeros([g.shape[2]]))
    return grads.LinearGrads(tf.constant(x), tf.constant(g), kernel, bias)


def _crafted_g():
    """Rows of g: ordinary, squares that overflow float32 (1e20), subnormal
    entries (flushed squares), and one large entry beside tiny ones."""
    rng = np.random.default_rng(3)
    g = rng.normal(size=(4, 1, 300)).astype(np.float32)
    g[1] = 1e20
    g[2] = 1e-40
    g[3] = 1e-30
    g[3, 0, 7] = 5.0
    return g


def test_the_bias_bound_holds_the_rows_of_g():
    g = _crafted_g()
    x = np.zeros((4, 1, 5), np.float32)  # no kernel gradient: the bias is all
    part = _part(x, g)
    bound = tf.function(part.sq_norm_bounds)().numpy()  # flush-to-zero as in the step
    exact = np.sum(g.astype(np.float64) ** 2, (1, 2))
    assert np.all(np.isfinite(bound)) and np.all(bound >= exact)
    kernel_only = grads.LinearGrads(tf.constant(x), tf.constant(g), part.variables[0])
    assert np.all(tf.function(kernel_only.sq_norm_bounds)().numpy() < exact)  # the control


def test_the_bias_bound_rounds_the_square_of_the_row_bound_up():
    """q^2 in float64 rounds to nearest, below the exact square of the row
    bound q for about half the rows: gamma64(2) raises it above."""
    from fractions import Fraction

    rng = np.random.default_rng(5)
    g = rng.normal(size=(64, 1, 33)).astype(np.float32)
    part = _part(np.ones((64, 1, 2), np.float32), g)
    rows_g = part._rows()[1][:, 0].numpy()  # pylint: disable=protected-access
    bound = part._bias_sq_bounds().numpy()  # pylint: disable=protected-access
    exact = [Fraction(float(q)) ** 2 for q in rows_g]
    assert all(Fraction(float(b)) >= e for b, e in zip(bound, exact))
    assert any(Fraction(float(q) * float(q)) < e for q, e in zip(rows_g, exact))  # the control


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_zero_weight_bias_row_that_is_not_finite_adds_nothing(bad):
    x = np.ones((3, 1, 4), np.float32)
    g = np.ones((3, 1, 2), np.float32)
    g[1] = bad
    _, bias = _part(x, g).weighted_sum(tf.constant([0.5, 0.0, 0.25]))
    np.testing.assert_array_equal(bias.numpy(), np.full(2, 0.75, np.float32))


def test_the_bias_sum_is_the_weighted_rows_of_g():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, 1, 8)).astype(np.float32)
    g = rng.normal(size=(64, 1, 16)).astype(np.float32)
    weights = rng.random(64).astype(np.float32) * (rng.random(64) > 0.3)
    _, bias = _part(x, g).weighted_sum(tf.constant(weights))
    expected = np.sum(weights[:, None].astype(np.float64) * g[:, 0], 0)
    np.testing.assert_allclose(bias.numpy(), expected, rtol=1e-5, atol=1e-6)
    _, in_float64 = _part(x, g).weighted_sum(tf.constant(weights), tf.float64)
    np.testing.assert_allclose(in_float64.numpy(), expected, rtol=1e-12)


def _linear_loss(y_true, y_pred):
    """Gradient -y_true at the outputs: a record chooses g."""
    return -tf.reduce_sum(y_true * y_pred, -1)


@pytest.mark.parametrize("target", [1e3, 1e19], ids=["large", "near the float32 limit"])
def test_a_bias_only_record_moves_the_update_at_most_the_bound(target):
    """A record of zero input: its whole gradient is the bias's, clipped by
    the bias bound alone (NeighbourStep, the compiled step, noise 0). A
    squared norm past float32's range (|g| > 1.8e19) is not clipped but
    dropped: the step's squared norms are float32."""
    import keras

    import tfdp
    from tfdp.auditing.neighbour_step import NeighbourStep

    width, n = 16, 20
    model = tfdp.DPSequential([keras.Input((width,)),
                               keras.layers.Dense(3, kernel_initializer="zeros")])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=_linear_loss)
    data = (np.ones((n, width), np.float32), np.full((n, 3), 1000.0, np.float32))
    record = (np.zeros(width, np.float32), np.full(3, target, np.float32))
    with NeighbourStep(model, data, records=n, batch_size=n + 1, physical_batch_size=None) as step:
        ratio = step.ratio(record, "add")
    assert 0.99 <= ratio <= 1.0 + 1e-5  # clipped to the bound, not dropped
