"""DP-SGD's clipping and noise against a NumPy reference."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.mechanisms import dpsgd

SEED = tf.constant([12, 34], tf.int64)


def numpy_clipped_sum(per_example, clip, mask):
    total = np.zeros(per_example.shape[1:])
    for g, m in zip(per_example, mask):
        norm = np.linalg.norm(g)
        if not np.isfinite(norm):
            continue
        total += m * g * min(1.0, clip / max(norm, 1e-30))
    return total


def test_clipped_sum_matches_numpy():
    rng = np.random.default_rng(0)
    per_example = rng.normal(size=(16, 7)).astype(np.float32) * rng.uniform(0.1, 5, size=(16, 1)).astype(np.float32)
    per_example[3] = np.nan
    per_example[5, 2] = np.inf
    mask = np.ones(16, np.float32)
    mask[-2:] = 0.0
    factors = dpsgd.clip_factors(tf.constant((per_example**2).sum(1)), 1.5, tf.constant(mask))
    safe = np.where(factors.numpy()[:, None] > 0, per_example, 0.0)
    got = (factors.numpy()[:, None] * safe).sum(0)
    np.testing.assert_allclose(got, numpy_clipped_sum(per_example, 1.5, mask), rtol=1e-5)
    assert factors.numpy()[3] == 0.0 and factors.numpy()[5] == 0.0


def test_zero_noise_and_huge_clip_reproduce_the_plain_mean_exactly():
    grads = tf.constant(np.random.default_rng(1).normal(size=(8, 5)), tf.float32)
    factors = dpsgd.clip_factors(tf.reduce_sum(grads**2, 1), 1e30)
    np.testing.assert_array_equal(factors.numpy(), np.ones(8, np.float32))
    (mean,) = dpsgd.noisy_mean([tf.reduce_sum(grads, 0)], 0.0, 8.0, SEED)
    np.testing.assert_array_equal(mean.numpy(), (tf.reduce_sum(grads, 0) / 8.0).numpy())


def noise_std(stddev, seed_word):
    sums = [tf.zeros([200_000])]
    (noisy,) = dpsgd.noisy_mean(sums, stddev, 1.0, tf.constant([seed_word, 7], tf.int64))
    return float(np.std(noisy.numpy()))


def test_noise_std_matches_and_half_noise_is_caught():
    # Sampling std of the std over 200k draws is ~0.16%; 1% tolerance is ~6 sigma.
    claimed = 2.15 * 0.1
    assert abs(noise_std(claimed, 3) / claimed - 1) < 0.01
    # Negative control: a mechanism adding half the noise must fail the check.
    assert abs(noise_std(claimed / 2, 3) / claimed - 1) > 0.4


def test_noise_is_fresh_per_step_and_per_tensor():
    key = tf.constant([5, 6], tf.int64)
    a = dpsgd.gaussian_noise_like([tf.zeros([64]), tf.zeros([64])], 1.0, dpsgd.step_seed(key, 0))
    b = dpsgd.gaussian_noise_like([tf.zeros([64])], 1.0, dpsgd.step_seed(key, 1))
    assert not np.allclose(a[0].numpy(), a[1].numpy())
    assert not np.allclose(a[0].numpy(), b[0].numpy())
    zeros = [tf.zeros([64]), tf.zeros([64])]
    again = dpsgd.gaussian_noise_like(zeros, 1.0, dpsgd.step_seed(key, 0))
    np.testing.assert_array_equal(a[0].numpy(), again[0].numpy())
    np.testing.assert_array_equal(a[1].numpy(), again[1].numpy())


@pytest.mark.parametrize("expected", [4.0, 10.0])
def test_divides_by_expected_not_realised_batch_size(expected):
    (mean,) = dpsgd.noisy_mean([tf.ones([3]) * 6.0], 0.0, expected, SEED)
    np.testing.assert_allclose(mean.numpy(), 6.0 / expected)


@pytest.mark.parametrize("clip", [1e-30, 1e-20, 2.0**-63, 1e-10, 1.0, 1e30])
def test_a_squared_norm_that_underflows_float32_is_still_clipped(clip):
    # Norms around 2^-63 ~ 1e-19, whose squares are subnormal or 0 in float32,
    # bounded as the per-example gradients bound them (rounded up to float32).
    from tfdp.per_example.rounding import round_up_to_float32

    norms = np.concatenate([np.geomspace(1e-30, 1e-15, 301), [0.0]])
    factors = dpsgd.clip_factors(round_up_to_float32(tf.constant(norms**2)), clip).numpy()
    assert np.all(factors.astype(np.float64) * norms <= clip)
    # Negative control: the old floor of 1e-30 on the norm let n ~ 1e-20 through at C = 1e-30.
    if clip < 1e-25:
        assert np.any(np.minimum(1.0, clip / np.maximum(np.sqrt(np.float32(norms**2)), 1e-30)) * norms > clip)


def test_clip_factors_refuses_an_integer_norm():
    with pytest.raises(ValueError, match=r"sq_norms.*Received: sq_norms dtype=int32"):
        dpsgd.clip_factors(tf.constant([4]), 1.0)


def round_up_to(values, dtype):
    """The smallest `dtype` number >= each positive float64 value (an upper
    bound of a squared norm in a half type, as its caller would give it)."""
    nearest = tf.cast(tf.constant(values, tf.float64), dtype).numpy()
    below = nearest.astype(np.float64) < values
    bits = nearest.view(np.uint16) + below.astype(np.uint16)  # next number up
    return bits.view(nearest.dtype)


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_half_type_norms_never_let_a_contribution_exceed_the_clip(dtype):
    """C and C / norm rounded to nearest in the half type let factor * norm
    exceed C by up to 0.8% (bfloat16); clipping must hold for every
    half-type upper bound of the squared norm, below its smallest normal too."""
    from fractions import Fraction

    rng = np.random.default_rng(0)
    top = 2.5 if dtype == tf.float16 else 10.0  # (100 C)^2 below float16's max
    clips = np.concatenate([rng.uniform(0.01, top, 1500), [1.0039, 0.1003, 3e-5, 6.2e-5, 1e-3]])
    clips = clips.astype(np.float32).astype(np.float64)  # C as the optimizer holds it
    norms = clips * np.concatenate([rng.uniform(1.0, 100.0, len(clips) - 1), [5.0]])
    sq = round_up_to(norms**2, dtype)
    assert np.all(sq.astype(np.float64) >= norms**2)
    # One C per row (broadcast), to try many in one call.
    factors = dpsgd.clip_factors(tf.constant(sq), tf.constant(clips, tf.float32)).numpy()
    assert all(Fraction(float(f)) * Fraction(n) <= Fraction(c)
               for f, n, c in zip(factors, norms, clips))
    assert factors.dtype == np.float32
    assert np.all(factors > 0)  # clipped, not zeroed
    # Negative control: the same arithmetic in the half type exceeds C.
    half = tf.minimum(1.0, tf.cast(clips, dtype) / tf.sqrt(tf.constant(sq)))
    assert np.any(half.numpy().astype(np.float64) * norms > clips)
