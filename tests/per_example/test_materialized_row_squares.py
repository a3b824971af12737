"""Materialized per-example tensors measured from float32 row squares
(`rounding.sum_of_squares_by_rows`, issue 53), and their weighted sum that
skips masking where every bound is finite (`grads.finite_or_masked`).

The bound is `row_bounds` (proved in the per-example page's "Row bounds
without Gram matrices", its terms tested in test_float32_row_bounds.py)
over rows cut from each example's entries: these tests check the cut (every
entry in exactly one row, for every shape class), that the bound holds
against the exact sum on crafted entries (rounding, flushed, overflowing),
that an example's bound reads its own entries alone, and that a zero
weight on a non-finite example still adds nothing, with the mask left out
as the negative control.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.auditing.neighbour_step import NeighbourStep
from tfdp.mechanisms import dpsgd
from tfdp.per_example import grads, rounding

CLIP = 1.0


def _bounds(tensor):
    """The bound as the compiled step computes it (flush-to-zero holds
    inside tf.function)."""
    return tf.function(rounding.sum_of_squares_by_rows)(tf.constant(tensor)).numpy()


def _exact(tensor):
    """Each example's sum of squares, correctly rounded from exact float64
    squares (float32 values square exactly in float64)."""
    flat = tensor.reshape(tensor.shape[0], -1).astype(np.float64)
    return np.array([math.fsum(row**2) for row in flat])


def _entries(shape, kind, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "rounding":  # squares that round, some down; sums that round
        values = 1.0 + rng.random(shape) * 2.0**-6
    elif kind == "overflowing":  # finite entries whose float32 squares overflow
        values = rng.uniform(1e19, 1e20, shape)
    elif kind == "flushed":  # squares below 2^-126: flushed in float32
        values = rng.uniform(1e-25, 1e-20, shape)
    else:  # magnitudes from 1e-30 to 1e15 side by side
        values = rng.normal(size=shape) * 10.0 ** rng.integers(-30, 16, shape)
    return (values * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


# (shape, width of the rows it is cut into): trailing axes up to 4096
# entries; a last axis alone wider than that takes float64 squares.
# Fewer than 1024 entries an example keep float64 squares.
SHAPES = [((3, 160, 32), 32), ((3, 8, 8, 1, 16), 1024), ((3, 4096), 4096),
          ((3, 5, 7, 30), 1050), ((3, 5000), None), ((3, 4097, 1), None), ((3, 5, 7), None)]


@pytest.mark.parametrize("kind", ["rounding", "overflowing", "flushed", "mixed"])
@pytest.mark.parametrize("shape, width", SHAPES, ids=[str(s) for s, _ in SHAPES])
def test_the_bound_holds_for_every_shape_class(shape, width, kind):
    tensor = _entries(shape, kind)
    bound, exact = _bounds(tensor), _exact(tensor)
    assert np.all(bound >= exact)
    # Not vacuous: within the row bound's relative term (gamma(4096) < 2.5e-4)
    # and float32's absolute term (about 1e-35 a row of 4096 entries).
    assert np.all(bound <= exact * (1.0 + 5e-4) + 1e-30)


def test_rows_are_cut_from_the_trailing_axes(monkeypatch):
    seen = []
    original = rounding.row_bounds

    def recording(rows, floor=None):
        seen.append((tuple(rows.shape.as_list()), floor))
        return original(rows, floor)

    monkeypatch.setattr(rounding, "row_bounds", recording)
    for shape, width in SHAPES:
        rounding.sum_of_squares_by_rows(tf.zeros(shape))
    expected = [((3, math.prod(s[1:]) // w, w), 0.0) for s, w in SHAPES if w is not None]
    assert seen == expected


@pytest.mark.parametrize("bad", [np.inf, np.nan, 2e19], ids=["inf", "nan", "overflowing"])
def test_an_example_is_bounded_by_its_own_entries_alone(bad):
    tensor = _entries((3, 160, 32), "mixed")
    alone = _bounds(tensor)
    tensor[2, 7, 3] = bad
    beside = _bounds(tensor)
    np.testing.assert_array_equal(beside[:2], alone[:2])
    assert np.isfinite(beside[2]) == np.isfinite(bad)


def _parts(tensor):
    """A materialized linear part (many positions) and a materialized part
    holding `tensor` [B, 64, 16] as their per-example kernels."""
    batch = tensor.shape[0]
    kernel = tf.Variable(tf.zeros([64, 16]))
    # x_s = e_s at position s < 64, g_s = row s of the tensor: X^T G = tensor.
    x = tf.tile(tf.eye(64)[None], [batch, 1, 1])
    linear = grads.LinearGrads(x, tf.constant(tensor), kernel)
    assert not linear._factored
    return [linear, grads.MaterializedGrads([kernel], [tf.constant(tensor)])]


@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("part", [0, 1], ids=["linear", "materialized"])
def test_a_zero_weight_example_that_is_not_finite_adds_nothing(bad, part, monkeypatch):
    tensor = np.ones((3, 64, 16), np.float32)
    tensor[1, 2, 3] = bad

    def summed():
        made = _parts(tensor)[part]
        assert not np.isfinite(made.sq_norm_bounds().numpy()[1])
        return made.weighted_sum(tf.constant([0.5, 0.0, 0.25]))[0].numpy()

    np.testing.assert_array_equal(summed(), np.full((64, 16), 0.75, np.float32))
    # The control: without the mask the zero weight meets the bad entry.
    monkeypatch.setattr(grads, "finite_or_masked", lambda tensor, *args, **kwargs: tensor)
    assert np.isnan(summed()[2, 3])


@pytest.mark.parametrize("part", [0, 1], ids=["linear", "materialized"])
def test_finite_examples_are_summed_unmasked_and_alike(part, monkeypatch):
    rng = np.random.default_rng(3)
    tensor = rng.normal(size=(4, 64, 16)).astype(np.float32) * 1e30
    weights = tf.constant([1.0, 0.0, 2.0, 0.0])
    masks = []
    original = grads.masked
    monkeypatch.setattr(grads, "masked", lambda t, keep: masks.append(t) or original(t, keep))
    made = _parts(tensor)[part]
    made.sq_norm_bounds()
    summed = made.weighted_sum(weights)[0].numpy()  # eager: only the branch taken runs
    assert not masks
    kept = _parts(tensor[[0, 2]])[part].weighted_sum(tf.constant([1.0, 2.0]))[0].numpy()
    np.testing.assert_array_equal(summed, kept)


def test_a_float64_entry_beyond_float32_at_zero_weight_adds_nothing():
    """Review of e047fb8 (CRITICAL): a rule's float64 part with a finite
    entry of 1e39 has a finite bound, but the float32 sum casts the entry
    to inf: unmasked, its zero weight put a NaN into the batch's sum."""
    tensor = np.ones((3, 64, 16))
    tensor[2, 5, 5] = 1e39
    kernel = tf.Variable(tf.zeros([64, 16]))
    part = grads.MaterializedGrads([kernel], [tf.constant(tensor, tf.float64)])
    assert np.all(np.isfinite(part.sq_norm_bounds().numpy()))
    summed = part.weighted_sum(tf.constant([0.5, 0.25, 0.0]))[0].numpy()
    np.testing.assert_array_equal(summed, np.full((64, 16), 0.75, np.float32))


def test_a_setting_that_narrows_matmuls_always_masks(monkeypatch):
    from tfdp.per_example import gram_precision

    masks = []
    original = grads.masked
    monkeypatch.setattr(grads, "masked", lambda t, keep: masks.append(t) or original(t, keep))
    part = _parts(np.ones((2, 64, 16), np.float32))[1]
    part.weighted_sum(tf.constant([1.0, 0.0]))
    assert not masks  # the control: finite, no setting
    monkeypatch.setattr(gram_precision, "reduced_precision_settings", lambda: ["a setting"])
    part = _parts(np.ones((2, 64, 16), np.float32))[1]
    part.weighted_sum(tf.constant([1.0, 0.0]))
    assert len(masks) == 1


@pytest.mark.parametrize("kind", ["overflowing", "flushed", "mixed"])
def test_crafted_examples_stay_clipped(kind):
    tensor = _entries((4, 160, 32), kind, seed=5)
    kernel = tf.Variable(tf.zeros([160, 32]))

    @tf.function
    def clipped():
        part = grads.MaterializedGrads([kernel], [tf.constant(tensor)])
        per_example = grads.PerExampleGradients(part.variables, [part])
        return dpsgd.clip_factors(per_example.sq_norms(), CLIP)

    factors = clipped().numpy().astype(np.float64)
    exact = _exact(tensor)
    assert np.all(factors * np.sqrt(exact) <= CLIP * (1.0 + 1e-6))
    # Not vacuous: each weight is min(1, C / |g|), or 0 where |g|^2 is beyond
    # float32 (clip_factors' rule for a non-finite squared norm).
    expected = np.where(exact < 3e38, np.minimum(1.0, CLIP / np.sqrt(exact)), 0.0)
    np.testing.assert_allclose(factors, expected, rtol=1e-3)


def test_a_record_whose_kernel_squares_overflow_stays_clipped_in_the_step():
    """Through the compiled train step (noise 0): a Conv1D whose per-example
    kernel is materialized (60 positions of 40 inputs, 32 filters) and a
    record whose kernel gradient entries are about 2.6e16 (a norm near 1e18,
    clipped by a weight near 1e-18)."""
    model = tfdp.DPSequential([
        keras.Input((64, 8)),
        keras.layers.Conv1D(32, 5, use_bias=False,
                            kernel_initializer=keras.initializers.Constant(1e-3)),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1, use_bias=False, kernel_initializer="ones"),
    ])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=CLIP, noise_multiplier=1.0),
                  loss="mse")
    n = 20
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(n, 64, 8)).astype(np.float32) * 10.0, np.zeros((n, 1), np.float32))
    record = (np.full((64, 8), 1e8, np.float32), np.zeros(1, np.float32))
    with NeighbourStep(model, data, records=n, batch_size=n + 1, physical_batch_size=None) as step:
        assert step.ratio(record, "add") <= 1.0 + 1e-5
        assert step.ratio(record, "add") >= 0.5  # the record moved the update: not zeroed
