"""Adaptive clipping's math (tfdp.mechanisms.quantile_clipping) against the
published formulas (Andrew et al. 2021), on crafted norms."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfdp.mechanisms import quantile_clipping as qc

SEED = tf.constant([3, 4], tf.int64)
# Crafted squared norms: inside, on and outside C = 1, negative (a rounded
# expansion), subnormal, huge, NaN and infinities.
CRAFTED = [0.25, 1.0, 1.01, 4.0, -1e-7, 1e-45, 3e38, float("nan"), float("inf"),
           float("-inf")]
UNCLIPPED = [True, True, False, False, True, True, False, False, False, False]


def test_centred_count_and_geometric_update_match_the_formulas():
    mask = np.array([1.0] * len(CRAFTED) + [0.0, 0.0], np.float32)  # two padding rows
    sq = tf.constant(CRAFTED + [0.0, 1e30], tf.float32)
    count = float(qc.centred_unclipped_count(sq, 1.0, mask))
    expected = sum(u - 0.5 for u in UNCLIPPED)
    assert count == expected
    batch = 16.0
    fraction = float(qc.unclipped_fraction(count, 0.0, batch, SEED))
    b = expected / batch + 0.5
    assert fraction == pytest.approx(b, abs=1e-7)
    for gamma in (0.1, 0.5, 0.9):
        geometric = float(qc.next_clip_norm(2.0, fraction, gamma, 0.2, "geometric", 1e30))
        assert geometric == pytest.approx(2.0 * math.exp(-0.2 * (b - gamma)), rel=1e-6)
        linear = float(qc.next_clip_norm(2.0, fraction, gamma, 0.2, "linear", 1e30))
        assert linear == pytest.approx(2.0 - 0.2 * (b - gamma), rel=1e-6)
    # The fraction is clamped to [0, 1] and C kept within [1e-30, ceiling].
    assert float(qc.unclipped_fraction(-100.0, 0.0, 4.0, SEED)) == 0.0
    assert float(qc.next_clip_norm(0.1, 1.0, 0.0, 10.0, "linear", 1e30)) == pytest.approx(1e-30)
    assert float(qc.next_clip_norm(1e29, 0.0, 1.0, 10.0, "geometric", 1e30)) == pytest.approx(1e30)


def test_one_crafted_unit_moves_the_count_by_exactly_one_half():
    base = tf.constant([0.25, 4.0, 0.5], tf.float32)
    before = float(qc.centred_unclipped_count(base, 1.0, tf.ones([3])))
    for value in CRAFTED:
        after = float(qc.centred_unclipped_count(
            tf.concat([base, [value]], 0), 1.0, tf.ones([4])))
        assert abs(after - before) == 0.5, value
        # The same unit drawn as padding adds nothing.
        padded = float(qc.centred_unclipped_count(
            tf.concat([base, [value]], 0), 1.0, tf.constant([1.0, 1.0, 1.0, 0.0])))
        assert padded == before


def test_noise_split_costs_one_gaussian_of_the_users_multiplier():
    for z, sigma_b in ((1.0, 0.6), (1.1, 12.8), (4.0, 2.5)):
        sigma_grad = qc.gradient_noise_multiplier(z, sigma_b)
        assert sigma_grad == pytest.approx((z ** -2 - (2 * sigma_b) ** -2) ** -0.5)
        # Sensitivities C (sum, noise sigma_grad C) and 1/2 (count, noise sigma_b):
        # the pair's squared L2 sensitivity over unit noise is 1 / z^2.
        assert sigma_grad ** -2 + (0.5 / sigma_b) ** 2 == pytest.approx(z ** -2)
        assert sigma_grad > z
    with pytest.raises(ValueError, match=r"2 sigma_b = 0.8 and z = 1.*clipped_count_stddev=0.4"):
        qc.check_noise_split(1.0, 0.4, "noise_multiplier=1, clipped_count_stddev=0.4")
    with pytest.raises(ValueError, match="2 sigma_b = 1 and z = 1"):
        qc.check_noise_split(1.0, 0.5, "x")


def test_count_noise_has_stddev_sigma_b():
    """The fraction's noise is sigma_b / B (fixed seeds); 0.8 sigma_b must fail."""
    sigma_b, batch = 3.0, 1000.0
    draw = tf.function(lambda s: qc.unclipped_fraction(
        0.0, sigma_b, batch, tf.stack([tf.constant(7, tf.int64), s])))
    draws = tf.map_fn(draw, tf.range(800, dtype=tf.int64), fn_output_signature=tf.float32)
    measured = float(np.std((draws.numpy() - 0.5) * batch))
    assert abs(measured / sigma_b - 1.0) < 0.1
    assert not abs(measured / (0.8 * sigma_b) - 1.0) < 0.1  # negative control
