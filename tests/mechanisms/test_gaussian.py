"""The vectorised Box-Muller generator draws N(0, 1): moments, KS, tails."""

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tfdp.mechanisms.gaussian import standard_normal

SEED = tf.constant([11, 3], tf.int64)


def test_draws_are_standard_normal_with_a_negative_control():
    z = standard_normal([1_000_001], SEED).numpy()  # odd size: the last pair is cut
    assert z.shape == (1_000_001,) and np.all(np.isfinite(z))
    # Sampling sd of the mean ~0.001, of the variance ~0.0014: 5-6 sigma margins.
    assert abs(z.mean()) < 0.006 and abs(z.var() - 1) < 0.008
    assert abs(stats.kurtosis(z)) < 0.03
    assert stats.kstest(z, "norm").pvalue > 1e-4
    # Tails: P(|z| > 4) = 6.3e-5, about 63 draws; the 1/1000 quantiles too.
    assert 30 < np.sum(np.abs(z) > 4) < 100
    # Negative control: the radius without its square root is not Gaussian.
    u = tf.random.stateless_uniform([2, 500_000], seed=SEED).numpy()
    wrong = -2 * np.log1p(-u[0]) * np.cos(2 * np.pi * u[1])
    assert stats.kstest(wrong / wrong.std(), "norm").pvalue < 1e-10


def test_halves_are_independent_and_seeds_give_fresh_streams():
    z = standard_normal([400_000], SEED).numpy()
    cos_half, sin_half = z[:200_000], z[200_000:]
    assert abs(np.corrcoef(cos_half, sin_half)[0, 1]) < 0.01  # sd ~0.0022
    assert abs(np.corrcoef(cos_half**2, sin_half**2)[0, 1]) < 0.01
    other = standard_normal([400_000], SEED + 1).numpy()
    assert abs(np.corrcoef(z, other)[0, 1]) < 0.01
    np.testing.assert_array_equal(z, standard_normal([400_000], SEED).numpy())


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.bfloat16])
def test_shape_and_dtype(dtype):
    z = standard_normal(tf.constant([3, 5, 2]), SEED, dtype=dtype)
    assert z.shape == (3, 5, 2) and z.dtype == dtype
