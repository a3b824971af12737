"""Guards found missing by a mutation test of the privacy code (issue 43, item 12).

`calibrate_amplified` (DP-BandMF with cyclic Poisson sampling) was tested only
at one band, where a round is a step: a mutant that calibrated for q / b
instead of q (epsilon 4.56 for a target of 1.0 at 4 bands) passed. Here the
calibrated noise is checked at several bands against an accounting done with
dp_accounting directly, not through tfdp's own event or epsilon code.
"""

import math

import dp_accounting
import pytest

from tfdp.accounting import bandmf

DELTA = 1e-5


def independent_epsilon(noise_multiplier, sampling_probability, rounds, accountant):
    """Epsilon of `rounds` Poisson-sampled Gaussian rounds, from dp_accounting alone."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            sampling_probability, dp_accounting.GaussianDpEvent(noise_multiplier)),
        rounds,
    )
    if accountant == "rdp":
        ledger = dp_accounting.rdp.RdpAccountant(list(range(2, 257)))
    else:
        ledger = dp_accounting.pld.PLDAccountant()
    return ledger.compose(event).get_epsilon(DELTA)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("bands, steps, q", [(4, 1000, 0.05), (8, 600, 0.2), (3, 100, 0.1)])
def test_calibrated_amplified_noise_meets_the_target_at_several_bands(bands, steps, q, accountant):
    """A record's group is active once every b steps and Poisson-sampled
    with rate q there: ceil(n / b) rounds of DP-SGD's event at rate q."""
    target = 1.0
    sigma = bandmf.calibrate_amplified(target, DELTA, steps, bands, q, accountant=accountant)
    rounds = math.ceil(steps / bands)
    reached = independent_epsilon(sigma, q, rounds, accountant)
    # meets the target (up to the orders / discretization the two
    # accountings do not share) ...
    assert reached <= target * 1.01, (bands, sigma, reached)
    # ... and is not looser than it needs to be (a count of n steps, or of
    # n / b rounds at rate q / b, would miss one side or the other)
    assert independent_epsilon(sigma / 1.02, q, rounds, accountant) > target, (bands, sigma)


def test_more_bands_need_less_noise_for_the_same_steps():
    """4 bands: a quarter of the rounds at the same rate q."""
    one = bandmf.calibrate_amplified(1.0, DELTA, 800, 1, 0.05)
    four = bandmf.calibrate_amplified(1.0, DELTA, 800, 4, 0.05)
    assert four < one
    assert four == pytest.approx(bandmf.calibrate_amplified(1.0, DELTA, 200, 1, 0.05))
