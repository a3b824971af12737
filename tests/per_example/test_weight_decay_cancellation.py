"""Weight decay before clipping with a batch whose gradients cancel the decay.

The weighted sum adds sum_i w_i g_i and (sum_i w_i) o apart. When every
example's gradient is -o (a Dense kernel of 2^23 with lambda = 0.5 and mse
targets on the decay's far side), the norms |g_i + o| are rounding noise,
the weights grew to about C / (6 u |o|), and the float32 rounding of the two
huge sums across examples moved one added record's effect to 8x (63
records) and 32x (255 records) the bound (found by the review of the
flush-to-zero change). Each example's separate pieces are now kept within
OFFSET_SPREAD * C.
"""

import keras
import numpy as np
import pytest

import tfdp
from tfdp.auditing.neighbour_step import NeighbourStep
from tfdp.per_example.grads import OFFSET_SPREAD, MaterializedGrads, PerExampleGradients

THETA, DECAY = float(2**23), 0.5
TOLERANCE = 1.0 + 1e-5


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("records", [63, 255])
def test_a_batch_cancelling_the_decay_keeps_an_added_record_within_the_bound(jit_compile, records):
    model = tfdp.DPSequential([keras.Input((1,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(THETA))])
    model.compile(optimizer=tfdp.optimizers.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0,
                                                  weight_decay=DECAY),
                  loss="mse", jit_compile=jit_compile)
    target = THETA + DECAY * THETA / 2   # mse's gradient 2 (theta - y) = -lambda theta
    x = np.ones((4, 1), np.float32)
    y = np.full((4, 1), target, np.float32)
    with NeighbourStep(model, (x, y), records=records, batch_size=records + 1,
                       physical_batch_size=None) as step:
        ratios = [step.ratio((np.ones(1), np.array([target + d])), "add")
                  for d in (0.0, 0.3, 1.0, 2.0, -0.6)]
    assert max(ratios) <= TOLERANCE, ratios


@pytest.mark.parametrize("records", [1023, 4095])
def test_the_residual_rounding_between_examples_does_not_grow_with_the_batch(records):
    """With values that are not powers of two the pieces w|g| and w|o| (up to
    8 C each) still rounded across the batch in float32: 1 + 2^-9 of the bound
    at 4,095 records, growing with B (found by review). The two sums are
    accumulated in float64 now."""
    theta, decay = 3141592.7, 0.37
    model = tfdp.DPSequential([keras.Input((1,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(theta))])
    model.compile(optimizer=tfdp.optimizers.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0,
                                                  weight_decay=decay), loss="mse")
    kernel = float(np.float32(theta))
    target = kernel + decay * kernel / 2          # every record cancels the decay
    x = np.ones((4, 1), np.float32)
    y = np.full((4, 1), target, np.float32)
    added = [kernel - 1.0, kernel - 1000.0, kernel + decay * kernel, 0.0, 2 * kernel,
             target + 3.0, target - 3.0]           # ordinary records, clipped to C
    with NeighbourStep(model, (x, y), records=records, batch_size=records + 1,
                       physical_batch_size=None) as step:
        ratios = [step.ratio((np.ones(1), np.array([value], np.float32)), "add")
                  for value in added]
    assert max(ratios) <= TOLERANCE, ratios   # 1.00024 at 1,023 records before


def test_the_spread_limit_leaves_ordinary_decay_alone():
    """Negative control: where the gradient does not cancel the decay, the
    bound is the expansion's, the same as before the limit."""
    rng = np.random.default_rng(0)
    variable = keras.Variable(np.zeros(16, np.float32))
    grads = rng.normal(size=(8, 16)).astype(np.float32)
    offsets = [0.1 * rng.normal(size=16).astype(np.float32)]
    per_example = PerExampleGradients([variable], [MaterializedGrads([variable], [grads])],
                                      offsets=offsets)
    exact = np.linalg.norm(grads.astype(np.float64) + offsets[0], axis=1)
    np.testing.assert_allclose(per_example.norm_bounds().numpy(), exact, rtol=1e-6)
    # A gradient cancelling the decay is bounded by (|g| + |o|) / OFFSET_SPREAD.
    cancelling = PerExampleGradients(
        [variable], [MaterializedGrads([variable], [-np.stack([offsets[0]] * 2)])], offsets=offsets)
    size = 2 * np.linalg.norm(offsets[0].astype(np.float64))
    assert np.all(cancelling.norm_bounds().numpy() >= size / OFFSET_SPREAD)


def test_tied_tables_cancelling_each_other_keep_their_pieces_within_the_spread():
    """The tied embedding's lookup and projection tables are summed apart
    across examples too: a record whose two gradients cancel (L = -P) is
    bounded by (|L| + |P|) / OFFSET_SPREAD, not by rounding noise."""
    import tensorflow as tf

    from tfdp.per_example.grads import LinearGrads
    from tfdp.per_example.rules.embedding import EmbeddingGrads
    from tfdp.per_example.rules.reversible_embedding import TiedGrads

    table = tf.Variable(tf.zeros([3, 2]))
    h = np.array([[[1e4, 0.0]]], np.float32)
    g_z = np.zeros((1, 1, 3), np.float32)
    g_z[0, 0, 1] = 1e4
    lookup = EmbeddingGrads(tf.constant([[1]]), tf.constant(-g_z[0, 0, 1] * h), table)
    projection = LinearGrads(tf.constant(h), tf.constant(g_z), table, kernel_perm=[1, 0])
    bound = np.sqrt(TiedGrads(lookup, projection).sq_norm_bounds().numpy()[0])
    assert bound >= 2e8 / OFFSET_SPREAD * (1 - 1e-6)
