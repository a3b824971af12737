"""Non-finite records in the private channel statistics (issue 25, item 4).

A NaN or Inf record must contribute nothing to the released sums (as a
non-finite gradient contributes nothing to DP-SGD's), never turn a released
statistic into NaN: the ledger charges a finite epsilon for the release.
"""

import numpy as np
import pytest

from tfdp.accounting import PrivacyLedger
from tfdp.layers.private_normalization import private_channel_statistics

SETTINGS = dict(mean_clip=1.0, square_clip=2.0, noise_multiplier=0.5, seed=7)


def features(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(loc=[0.3, -0.2, 0.1], scale=0.5, size=(n, 2, 2, 3))


def release(x):
    stats = private_channel_statistics(x, PrivacyLedger(), **SETTINGS)
    return np.concatenate([stats.mean, stats.variance])


@pytest.mark.parametrize(
    "bad",
    [np.nan, np.inf, -np.inf, "nan_in_one_channel", "inf_in_one_position"],
)
def test_a_non_finite_record_is_released_as_if_it_contributed_nothing(bad):
    """The release with record 3 non-finite equals (same seed, same N) the
    release with record 3 all zeros, which contributes 0 to both clipped sums.

    Broken variant caught: summing the rows as they come (the old code), where
    one NaN made every released mean NaN and one Inf made its channel NaN.
    """
    x = features()
    zeroed = x.copy()
    zeroed[3] = 0.0
    poisoned = x.copy()
    if bad == "nan_in_one_channel":
        poisoned[3, 0, 0, 1] = np.nan
    elif bad == "inf_in_one_position":
        poisoned[3, 1, 0, 2] = np.inf
    else:
        poisoned[3] = bad
    released = release(poisoned)
    assert np.all(np.isfinite(released)), released
    np.testing.assert_allclose(released, release(zeroed), rtol=1e-6, atol=1e-7)


def test_control_the_record_does_count_when_finite():
    """Negative control: with its finite values record 3 changes the release,
    so the equality above is not one that holds for any record."""
    x = features()
    zeroed = x.copy()
    zeroed[3] = 0.0
    assert np.max(np.abs(release(x) - release(zeroed))) > 1e-3


def test_a_finite_record_whose_square_overflows_is_clipped_not_poisoned():
    """A record of 1e200 is finite but its square overflows float64: both
    releases stay finite, and its mean vector counts clipped to mean_clip
    (the mean moves from the zeroed-record release by mean_clip / N).

    Broken variant caught: the old code, where the overflowed square row
    clipped to inf * 0 = NaN and every released variance was NaN.
    """
    x = features()
    zeroed = x.copy()
    zeroed[3] = 0.0
    huge = x.copy()
    huge[3] = 1e200
    a, b = release(huge), release(zeroed)
    assert np.all(np.isfinite(a)), a
    shift = np.linalg.norm(a[:3] - b[:3]) * len(x)
    assert shift == pytest.approx(SETTINGS["mean_clip"], rel=1e-4)
