"""DP-BandMF's math against dense matrices: the error the coefficients
minimise, their optimality, and the noise recurrence C w = z."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.mechanisms import bandmf


def dense_strategy(coefficients, n):
    """The n x n lower-triangular banded Toeplitz matrix C."""
    matrix = np.zeros((n, n))
    for lag, value in enumerate(coefficients):
        matrix += value * np.eye(n, k=-lag)
    return matrix


def dense_error(coefficients, n):
    """||c||^2 ||A C^{-1}||_F^2 with explicit matrices."""
    prefix = np.tril(np.ones((n, n)))
    inverse = np.linalg.inv(dense_strategy(coefficients, n))
    return float(np.dot(coefficients, coefficients) * np.linalg.norm(prefix @ inverse) ** 2)


@pytest.mark.parametrize("bands", [1, 2, 3, 5])
def test_prefix_sum_error_and_gradient_match_dense_matrices(bands):
    n = 20
    rng = np.random.default_rng(bands)
    coefficients = np.abs(rng.normal(size=bands)) + np.eye(1, bands)[0] * 2.0
    loss, grad = bandmf.prefix_sum_error(coefficients, n)
    assert loss == pytest.approx(dense_error(coefficients, n), rel=1e-10)
    step = 1e-6
    numeric = np.array([
        (dense_error(coefficients + step * e, n) - dense_error(coefficients - step * e, n))
        / (2 * step)
        for e in np.eye(bands)
    ])
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-6 * abs(loss))


def test_inverse_impulse_response_is_the_first_column_of_the_dense_inverse():
    coefficients = [0.7, 0.5, 0.3]
    dense = np.linalg.inv(dense_strategy(coefficients, 12))
    np.testing.assert_allclose(bandmf.inverse_impulse_response(coefficients, 12), dense[:, 0],
                               rtol=1e-12, atol=1e-14)


def test_one_band_is_dp_sgd():
    np.testing.assert_array_equal(bandmf.optimal_coefficients(1, 500), [1.0])


# (4, 1160) and (8, 2000): L-BFGS's first step from a unit-norm start left
# the region where 1/c is stable and it stopped at the start (17% and 24%
# more error than the minimum); the Fashion-MNIST runs' amplified setting.
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("bands,n", [(2, 20), (4, 20), (8, 200), (16, 1000), (4, 1160),
                                     (8, 2000)])
def test_optimal_coefficients_are_a_local_minimum_of_the_dense_error(bands, n):
    c = bandmf.optimal_coefficients(bands, n)
    assert np.linalg.norm(c) == pytest.approx(1.0, abs=1e-12) and c[0] > 0
    best = bandmf.prefix_sum_error(c, n)[0]
    if n <= 20:
        assert best == pytest.approx(dense_error(c, n), rel=1e-10)
    rng = np.random.default_rng(0)
    for _ in range(20):  # no nearby strategy does better
        other = c + 1e-3 * rng.normal(size=bands)
        assert bandmf.prefix_sum_error(other, n)[0] >= best * (1 - 1e-9)
    # and it beats DP-SGD and the starting point (sqrt(A) truncated)
    start = bandmf.check_coefficients(bandmf._square_root_coefficients(bands))
    assert best < bandmf.prefix_sum_error(start, n)[0] < bandmf.prefix_sum_error([1.0], n)[0]


def test_optimal_coefficients_give_a_stable_noise_filter():
    """The roots of c(z) lie outside the unit circle, so the recurrence for
    w does not blow up over a long run."""
    c = bandmf.optimal_coefficients(32, 5000)
    assert np.min(np.abs(np.roots(c[::-1]))) > 1.0


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="bands"):
        bandmf.optimal_coefficients(0, 10)
    with pytest.raises(ValueError, match="bands"):
        bandmf.optimal_coefficients(11, 10)
    with pytest.raises(ValueError, match="c_0 > 0"):
        bandmf.check_coefficients([0.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        bandmf.check_coefficients([1.0, float("nan")])


def run_recurrence(coefficients, draws):
    """The optimizer's ring-buffer recurrence over all rows of `draws`."""
    bands = len(coefficients)
    c = tf.constant(coefficients, tf.float32)
    history = tf.Variable(tf.zeros((max(bands - 1, 1),) + draws.shape[1:]))
    out = []
    for t, draw in enumerate(draws):
        w, slot = bandmf.correlated_noise(
            tf.constant(draw, tf.float32), history if bands > 1 else None, c,
            tf.constant(t, tf.int64))
        if slot is not None:
            history.scatter_update(tf.IndexedSlices(w[None], slot[None]))
        out.append(w.numpy())
    return np.stack(out)


@pytest.mark.parametrize("bands", [1, 2, 3, 6])
def test_recurrence_equals_dense_inverse_times_draws(bands):
    n = 24
    coefficients = bandmf.optimal_coefficients(bands, n)
    draws = np.random.default_rng(bands).normal(size=(n, 3, 2))
    expected = np.linalg.solve(dense_strategy(coefficients, n), draws.reshape(n, -1))
    got = run_recurrence(coefficients, draws).reshape(n, -1)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_recurrence_negative_control_a_wrong_slot_order_fails():
    """Weights applied to the wrong slots (reversed) do not give C^{-1} z."""
    n, bands = 16, 4
    coefficients = bandmf.optimal_coefficients(bands, n)
    draws = np.random.default_rng(1).normal(size=(n, 5))
    expected = np.linalg.solve(dense_strategy(coefficients, n), draws)
    reversed_weights = lambda c, t: tf.reverse(original(c, t), [0])  # noqa: E731
    original = bandmf.noise_slot_weights
    bandmf.noise_slot_weights = reversed_weights
    try:
        got = run_recurrence(coefficients, draws)
    finally:
        bandmf.noise_slot_weights = original
    assert np.max(np.abs(got - expected)) > 1e-2
