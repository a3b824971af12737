"""Private per-channel statistics: values, clipping, noise scale, ledger."""

import dp_accounting
import numpy as np
import pytest

from tfdp.accounting import PrivacyLedger
from tfdp.layers.private_normalization import private_channel_statistics


def features(n=2000, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(loc=[0.5, -1.0, 2.0], scale=[1.0, 0.5, 0.1], size=(n, 3, 3, 3))


def test_small_noise_and_loose_clips_give_the_exact_statistics():
    x = features()
    stats = private_channel_statistics(x, PrivacyLedger(), 1e3, 1e3, 1e-6, seed=0)
    np.testing.assert_allclose(stats.mean, x.mean(axis=(0, 1, 2)), atol=1e-4)
    # variance of the per-channel values (mean square minus squared mean)
    np.testing.assert_allclose(stats.variance, x.var(axis=(0, 1, 2)), rtol=1e-3)
    normalized = np.asarray(stats.layer()(x.astype(np.float32)))
    np.testing.assert_allclose(normalized.mean(axis=(0, 1, 2)), 0.0, atol=1e-3)
    np.testing.assert_allclose(normalized.std(axis=(0, 1, 2)), 1.0, rtol=1e-3)


def test_one_outlier_moves_the_mean_by_at_most_the_clip_over_n():
    """Sensitivity: the released sum changes by at most mean_clip when one
    example is replaced by an outlier (same noise seed). A variant without
    clipping moves it by about 1e6 / N."""
    x = features(n=100)
    outlier = x.copy()
    outlier[0] = 1e6
    kwargs = dict(mean_clip=1.0, square_clip=1.0, noise_multiplier=1.0, seed=3)
    a = private_channel_statistics(x, PrivacyLedger(), **kwargs)
    b = private_channel_statistics(outlier, PrivacyLedger(), **kwargs)
    assert np.linalg.norm(b.mean - a.mean) <= 2 * 1.0 / 100 + 1e-6
    assert np.linalg.norm(b.mean - a.mean) > 0.005  # the outlier does count, clipped


def test_noise_has_the_stated_scale():
    """Released mean minus clipped mean, over 400 seeds: std sigma * C / N."""
    x = features(n=50)
    sigma, clip = 2.0, 0.5
    exact = private_channel_statistics(x, PrivacyLedger(), clip, clip, 1e-9, seed=0).mean
    errors = np.stack([
        private_channel_statistics(x, PrivacyLedger(), clip, clip, sigma, seed=s).mean - exact
        for s in range(400)
    ])
    stated = sigma * clip / 50
    # 4 standard errors of a sample std over errors.size draws (3,600 here).
    tolerance = 4 / np.sqrt(2 * errors.size)
    assert errors.std() == pytest.approx(stated, rel=tolerance)
    assert abs(errors.mean()) < 3 * stated / np.sqrt(errors.size)
    # Negative control: the same draws at half or 1.2x the stated noise (the
    # noise is linear in sigma for a fixed seed) fall outside the band.
    for factor in (0.5, 1.2):
        assert (factor * errors).std() != pytest.approx(stated, rel=tolerance)


def test_release_is_charged_to_the_ledger():
    ledger = PrivacyLedger()
    stats = private_channel_statistics(features(n=10), ledger, 1.0, 1.0, 8.0, seed=0)
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(8.0), 2)
    assert ledger.epsilon(delta=1e-5) == pytest.approx(accountant.get_epsilon(1e-5))
    assert stats.event == dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(8.0)] * 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="noise_multiplier"):
        private_channel_statistics(features(n=10), PrivacyLedger(), 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="features"):
        private_channel_statistics(np.zeros([0, 3]), PrivacyLedger(), 1.0, 1.0, 1.0)
