"""The threshold is sized for the noise generator's tail, not an exact Gaussian's (review 7, F12).

`numpy_normal` takes E = -ln V at the bottom of V's 2^-32 cell, so a lone
token passes up to 2^-32 more often than under an exact Gaussian: +19.7% of
p at (s, k, delta_T) = (6.604, 2, 5e-10). The threshold leaves that room.
"""

import math

import numpy as np
import pytest
from scipy import stats

from tfdp.preprocessing import partition_selection

WORD = 2.0**-32
ANGLES = 2**22  # a sub-grid of the generator's 2^32 angles, midpoints as the generator's


def rounding_excess(z):
    """P(Z > z) under the generator's rounded radius minus under the exact radius,
    on the same angles (the reviewer's integration, isolating the rounding)."""
    theta = 2 * math.pi * (np.arange(ANGLES) + 0.5) / ANGLES
    cos = np.cos(theta)
    x = z * z / (2 * cos[cos > 0] ** 2)  # the radius passes z iff E >= x
    shallow = x <= 32 * math.log(2)
    rounded = np.empty_like(x)
    rounded[shallow] = np.minimum(1.0, (np.floor(np.exp(-x[shallow]) / WORD) + 1) * WORD)
    deep = x[~shallow] - 32 * math.log(2)  # w0 = 0: E = 32 ln 2 + a fresh E'
    rounded[~shallow] = WORD * np.minimum(1.0, (np.floor(np.exp(-deep) / WORD) + 1) * WORD)
    return (rounded.sum() - np.exp(-x).sum()) / ANGLES


def generator_pass_probability(cut, noise_std):
    z = (cut - 1) / noise_std
    return stats.norm.sf(z) + rounding_excess(z)


@pytest.mark.parametrize("noise_std, k, delta", [(6.604, 2, 5e-10), (4.669, 1, 5e-9)])
def test_a_lone_token_passes_at_most_p_under_the_generator(noise_std, k, delta):
    p = partition_selection.pass_probability(k, delta)
    cut = partition_selection.threshold(noise_std, k, delta)
    assert generator_pass_probability(cut, noise_std) <= p
    # Negative control: a threshold sized for an exact Gaussian lets it pass more often.
    exact = 1 + noise_std * stats.norm.isf(p)
    assert generator_pass_probability(exact, noise_std) > p * (1 + 1e-3)


def test_a_delta_below_the_generators_resolution_is_refused():
    with pytest.raises(ValueError, match=r"too small for the noise generator.*delta_threshold=1e-10"):
        partition_selection.threshold(5.0, 1, 1e-10)
