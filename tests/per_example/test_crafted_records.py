"""Clipping holds for crafted records, not only for ordinary data.

Every per-example form whose norm is an expansion (factored "ghost" norms
sum_{s,t} (x_s.x_t)(g_s.g_t), the tied embedding's |L|^2 + 2<L,P> + |P|^2,
weight decay's |g|^2 + 2<g,o> + |o|^2) or whose sum adds pieces apart (an
embedding's repeated rows) can cancel in float32: a record built so that its
terms cancel had a norm that was rounding noise, and moved the update up to
10,000 times the clipping bound. Each test crafts such a record and checks
the clipped contribution that the weighted sum really adds, against the bound.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.mechanisms import dpsgd
from tfdp.per_example.grads import LinearGrads, MaterializedGrads, PerExampleGradients
from tfdp.per_example.rules.embedding import EmbeddingGrads
from tfdp.per_example.rules.reversible_embedding import TiedGrads

sys.path.insert(0, __file__.rsplit("/per_example/", 1)[0])
from noiseless import NoiselessDPSGD  # noqa: E402

CLIP = 1.0
TOLERANCE = 1.0 + 1e-5


def _clipped_norm(per_example, weights=None):
    """float64 norm of what the weighted sum adds for a batch of clipped
    examples (one example: its clipped contribution)."""
    factors = dpsgd.clip_factors(per_example.sq_norms(), CLIP, weights)
    sums = per_example.weighted_sum(factors)
    return float(np.sqrt(sum(np.sum(np.square(s.numpy().astype(np.float64))) for s in sums)))


def _unit(rng, size, scale=1.0):
    v = rng.normal(size=size)
    return v * scale / np.linalg.norm(v)


@pytest.mark.parametrize("magnitude, gap", [(1e6, 100.0), (1e8, 1e4)])
@pytest.mark.parametrize("seed", range(5))
def test_cancelling_positions_stay_clipped_through_fit(seed, magnitude, gap):
    """The review's reproduction: a Dense layer on a [2, 64] input whose two
    positions are the same unit vector, targets chosen so that the output
    gradients are [g, -g + delta] (loss mse, no noise, N = batch = 1): the
    update may move by at most lr * C / b. Before the fix it moved 1.4x and
    up to 14,000x the bound."""
    keras.utils.set_random_seed(seed)
    model = tfdp.DPSequential([keras.Input((2, 64)), keras.layers.Dense(8)])
    model.compile(optimizer=NoiselessDPSGD(1.0, l2_norm_clip=CLIP, noise_multiplier=1.0),
                  loss="mse")
    rng = np.random.default_rng(seed)
    position = _unit(rng, 64)
    x = np.stack([position, position])[None].astype(np.float32)
    prediction = model.predict(x, verbose=0).astype(np.float64)
    g = _unit(rng, 8, magnitude)
    gradients = np.stack([g, -g + _unit(rng, 8, gap)])[None]
    y = (prediction - gradients * 8).astype(np.float32)  # mse's gradient: 2 (p - y) / 16
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    model.fit(x, y, batch_size=1, epochs=1, verbose=0)
    moved = np.sqrt(sum(np.sum((v.numpy() - b) ** 2) for v, b in zip(model.trainable_variables, before)))
    assert moved <= CLIP * TOLERANCE


def _cancelling_rows(rng, positions, width, magnitude, gap):
    """[positions, width] rows summing to a vector of norm `gap` whose
    entries are of size `magnitude`: g, g, ..., -(positions - 1) g + delta."""
    g = _unit(rng, width, magnitude)
    rows = [g] * (positions - 1) + [-(positions - 1) * g + _unit(rng, width, gap)]
    return np.stack(rows)


@pytest.mark.parametrize("positions", [2, 3, 7])
def test_factored_norm_bounds_a_crafted_sequence(positions):
    rng = np.random.default_rng(positions)
    x_row = _unit(rng, 16)
    x = np.tile(x_row, (1, positions, 1)).astype(np.float32)
    g = _cancelling_rows(rng, positions, 32, 1e12, 1.0)[None].astype(np.float32)
    kernel = tf.Variable(tf.zeros([16, 32]))
    part = LinearGrads(tf.constant(x), tf.constant(g), kernel)
    assert part._ghost
    exact = np.einsum("bsk,bso->bko", x.astype(np.float64), g.astype(np.float64))
    assert part.sq_norms().numpy()[0] >= np.sum(exact**2)
    per_example = PerExampleGradients([kernel], [part])
    assert _clipped_norm(per_example) <= CLIP * TOLERANCE


def test_factored_norm_is_tight_on_ordinary_data():
    """The bound costs ordinary data nothing measurable: within 1e-5 of the
    exact norm (a negative control for a bound that is merely huge)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5, 16)).astype(np.float32)
    g = rng.normal(size=(8, 5, 32)).astype(np.float32)
    part = LinearGrads(tf.constant(x), tf.constant(g), tf.Variable(tf.zeros([16, 32])))
    exact = np.sum(np.einsum("bsk,bso->bko", x.astype(np.float64), g.astype(np.float64)) ** 2, (1, 2))
    np.testing.assert_allclose(part.sq_norms().numpy(), exact, rtol=1e-5)
    assert np.all(part.sq_norms().numpy() >= exact)


@pytest.mark.parametrize("seed", [0, 4, 19])
def test_repeated_embedding_ids_stay_clipped(seed):
    """One id looked up three times with row gradients of size 1e8 that sum
    to a vector of norm 20: the merged row is clipped by 1/20, but the table
    summed the rows apart, each scaled and rounded (up to 1.7 C before)."""
    rng = np.random.default_rng(seed)
    g = _unit(rng, 4, 1e8)
    rows = np.stack([g, 0.7 * g, -1.7 * g + _unit(rng, 4, 20.0)])[None].astype(np.float32)
    table = tf.Variable(tf.zeros([7, 4]))
    part = EmbeddingGrads(tf.constant([[3, 3, 3]]), tf.constant(rows), table)
    assert _clipped_norm(PerExampleGradients([table], [part])) <= CLIP * TOLERANCE


def test_tied_embedding_lookup_and_projection_cancel():
    """A table used as lookup (rows L) and projection (G_z^T h) whose two
    gradients cancel: |L|^2 + |P|^2 + 2<L, P> is rounding noise."""
    rng = np.random.default_rng(0)
    vocabulary, dim = 6, 4
    h = np.zeros((1, 1, dim)); h[0, 0] = _unit(rng, dim, 1e4)
    g_z = np.zeros((1, 1, vocabulary)); g_z[0, 0, 2] = 1e4
    projection_row = g_z[0, 0, 2] * h[0, 0]                  # P's row 2, size 1e8
    lookup_g = (-projection_row + _unit(rng, dim, 1e3))[None, None]
    table = tf.Variable(tf.zeros([vocabulary, dim]))
    lookup = EmbeddingGrads(tf.constant([[2]]), tf.constant(lookup_g, tf.float32), table)
    projection = LinearGrads(tf.constant(h, tf.float32), tf.constant(g_z, tf.float32), table,
                             kernel_perm=[1, 0])
    per_example = PerExampleGradients([table], [TiedGrads(lookup, projection)])
    assert _clipped_norm(per_example) <= CLIP * TOLERANCE


def test_weight_decay_offsets_cancel_a_crafted_gradient():
    """Weight decay before clipping adds lambda * theta to every example's
    gradient; an example whose gradient is -lambda * theta + delta has norm
    |delta|, while |g|^2 + 2<g, o> + |o|^2 cancels."""
    rng = np.random.default_rng(0)
    variable = tf.Variable(tf.zeros([8]))
    offset = _unit(rng, 8, 1e6).astype(np.float32)
    gradient = (-offset.astype(np.float64) + _unit(rng, 8, 10.0))[None].astype(np.float32)
    per_example = PerExampleGradients(
        [variable], [MaterializedGrads([variable], [tf.constant(gradient)])], offsets=[tf.constant(offset)])
    assert _clipped_norm(per_example) <= CLIP * TOLERANCE


@pytest.mark.parametrize("seed", [2, 3, 7])
def test_weight_decay_offsets_cancel_a_factored_gradient(seed):
    """The same through a factored (two-position) part: the dot products
    <g, o> of size 1e12 cancel (up to 10 C before)."""
    rng = np.random.default_rng(seed)
    kernel = tf.Variable(tf.zeros([4, 8]))
    x = np.stack([_unit(rng, 4), _unit(rng, 4)])[None]
    g = np.stack([_unit(rng, 8, 1e6), _unit(rng, 8, 1e6)])[None]
    exact = np.einsum("bsk,bso->ko", x, g)
    offset = (-exact + _unit(rng, 32, 10.0).reshape(4, 8)).astype(np.float32)
    part = LinearGrads(tf.constant(x, tf.float32), tf.constant(g, tf.float32), kernel)
    per_example = PerExampleGradients([kernel], [part], offsets=[tf.constant(offset)])
    assert _clipped_norm(per_example) <= CLIP * TOLERANCE


@pytest.mark.parametrize("records", [2, 5])
def test_a_users_cancelling_records_stay_clipped(records):
    """User-level DP clips a user's summed gradient: its records play the
    positions of the factored form, and records crafted to cancel (each of
    size 1e12, summing to a vector of norm 10) must not escape clipping."""
    rng = np.random.default_rng(records)
    kernel = tf.Variable(tf.zeros([16, 32]))
    x = np.tile(_unit(rng, 16), (records, 1, 1)).astype(np.float32)         # [records, 1, 16]
    g = _cancelling_rows(rng, records, 32, 1e12, 10.0)[:, None].astype(np.float32)
    per_record = PerExampleGradients([kernel], [LinearGrads(tf.constant(x), tf.constant(g), kernel)])
    per_user = per_record.grouped(records)
    exact = np.einsum("bsk,bso->ko", x.astype(np.float64), g.astype(np.float64))
    assert per_user.sq_norms().numpy()[0] >= np.sum(exact**2)
    assert _clipped_norm(per_user) <= CLIP * TOLERANCE
