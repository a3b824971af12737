"""Privacy of DP-BandMF (banded matrix-factorization noise), in rounds.

DP-BandMF (`tfdp.mechanisms.bandmf`) releases the clipped gradient sums x_t
plus correlated noise w = C^{-1} z with C banded (b bands, ||c||_2 = 1), which
is as private as releasing C x + z. A record's clipped gradient g at step t
enters rows t ... t + b - 1 of C x with weights c_0 ... c_{b-1}: squared norm
at most ||c||^2 C_clip^2 = C_clip^2. Two participations at least b steps
apart touch disjoint rows, so k participations, each b or more steps apart,
compose exactly as k Gaussian mechanisms of noise multiplier sigma (the rows
are released one step at a time and a later gradient may depend on earlier
releases: each participation's rows are still a Gaussian mechanism given the
past, so adaptive composition applies; Denisov et al. 2022 show the same for
any lower-triangular C). Closer participations share rows: then the
sensitivity is max ||C u|| over participation patterns u, more than sqrt(k)
for positive coefficients, and tfdp refuses such settings.

Two participation patterns are accounted here, in rounds of P steps:

- Fixed order (no sampling): the data is read in the same order every epoch
  of P steps, P >= b, each record in exactly one step of each epoch. A
  record then takes part at most ceil(n / P) times in any n consecutive
  steps, so n steps release `SelfComposedDpEvent(GaussianDpEvent(sigma),
  ceil(n / P))`. Positions in a fixed-order stream shift when a record is
  added or removed, so the guarantee holds under the ZERO-OUT relation (one
  record replaced by one that contributes nothing), not add-or-remove.
- Amplified (cyclic Poisson sampling, data with random access): every
  record is assigned to one of b groups independently at random; step t
  Poisson-samples group t mod b with probability q. A record's group is
  active once every b steps, so n steps release `SelfComposedDpEvent(
  PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), ceil(n / b))`, under
  add-or-remove (the groups are independent of the other records), as
  jax-privacy's `amplified_bandmf_event` with its INDEPENDENT partition.
  With b = 1 it is DP-SGD's event, step for step.

Example:

>>> round(fixed_order_epsilon(2.0, steps=300, steps_per_epoch=30, bands=8, delta=1e-5), 4)
8.0794
>>> sigma = calibrate_fixed_order(3.0, 1e-5, steps=300, steps_per_epoch=30, bands=8)
>>> fixed_order_epsilon(sigma, 300, 30, 8, 1e-5) <= 3.0
True
"""

import math

import dp_accounting

from tfdp.accounting import _engine
from tfdp.accounting._validation import check_choice, check_delta, check_int, check_real
from tfdp.accounting.calibration import calibrate_noise_multiplier
from tfdp.accounting.events import dpsgd_event


def check_separation(steps_per_round, bands):
    """Refuses rounds shorter than the band: participations would share rows.

    Args:
        steps_per_round: P, the fewest steps between two participations of
            a record (steps per epoch in a fixed order).
        bands: b, the strategy's number of bands.

    Raises:
        ValueError: if P < b (the factorization's sensitivity would then
            exceed sqrt(participations), which tfdp does not account).

    Example:

    >>> check_separation(30, 8)
    >>> check_separation(5, 8)
    Traceback (most recent call last):
    ...
    ValueError: DP-BandMF needs each record's participations at least `bands` = 8 steps apart, ...
    """
    steps_per_round = check_int("steps_per_round", steps_per_round, minimum=1)
    bands = check_int("bands", bands, minimum=1)
    if steps_per_round < bands:
        raise ValueError(
            f"DP-BandMF needs each record's participations at least `bands` = {bands} "
            f"steps apart, but a record returns every {steps_per_round} steps: the "
            "banded noise of two participations would overlap and their sensitivity "
            "exceed what tfdp accounts. Use bands <= steps per epoch, or a smaller "
            "batch size. Received: steps_per_epoch="
            f"{steps_per_round}, bands={bands}"
        )


def fixed_order_round_event(noise_multiplier):
    """One participation of a record in fixed order: `GaussianDpEvent(sigma)`.

    Example:

    >>> fixed_order_round_event(1.5)
    GaussianDpEvent(noise_multiplier=1.5)
    """
    sigma = check_real("noise_multiplier", noise_multiplier, low=0.0)
    return dp_accounting.GaussianDpEvent(sigma)


def amplified_round_event(noise_multiplier, sampling_probability):
    """One round of cyclic Poisson sampling: DP-SGD's step event.

    Example:

    >>> amplified_round_event(1.1, 0.01)
    PoissonSampledDpEvent(sampling_probability=0.01, event=GaussianDpEvent(noise_multiplier=1.1))
    """
    return dpsgd_event(noise_multiplier, sampling_probability)


def participations(steps, steps_per_round):
    """ceil(steps / steps_per_round): a record's most participations.

    Example:

    >>> participations(301, 30), participations(300, 30), participations(0, 30)
    (11, 10, 0)
    """
    steps = check_int("steps", steps, minimum=0)
    steps_per_round = check_int("steps_per_round", steps_per_round, minimum=1)
    return -(-steps // steps_per_round)


def fixed_order_event(noise_multiplier, steps, steps_per_epoch, bands):
    """The event of `steps` DP-BandMF steps in a fixed order (zero-out).

    Args:
        noise_multiplier: sigma > 0 (noise std sigma * C_clip on C x).
        steps: n, an int >= 0.
        steps_per_epoch: P, steps between two visits of a record (>= bands).
        bands: b >= 1.

    Returns:
        `SelfComposedDpEvent(GaussianDpEvent(sigma), ceil(n / P))`.

    Example:

    >>> fixed_order_event(2.0, 100, 30, 4)
    SelfComposedDpEvent(event=GaussianDpEvent(noise_multiplier=2.0), count=4)
    """
    check_separation(steps_per_epoch, bands)
    return dp_accounting.SelfComposedDpEvent(
        fixed_order_round_event(noise_multiplier), participations(steps, steps_per_epoch)
    )


def amplified_event(noise_multiplier, steps, bands, sampling_probability):
    """The event of `steps` DP-BandMF steps with cyclic Poisson sampling.

    Args:
        noise_multiplier: sigma > 0.
        steps: n, an int >= 0.
        bands: b >= 1, also the number of groups (a record's group is
            sampled every b steps).
        sampling_probability: q, the Poisson rate within the active group
            (expected batch size q * N / b).

    Returns:
        `SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)),
        ceil(n / b))` (add-or-remove).

    Example:

    >>> amplified_event(1.0, 10, 1, 0.01).count     # one band: DP-SGD's 10 steps
    10
    """
    bands = check_int("bands", bands, minimum=1)
    return dp_accounting.SelfComposedDpEvent(
        amplified_round_event(noise_multiplier, sampling_probability),
        participations(steps, bands),
    )


def _epsilon(event, count, delta, accountant):
    delta = check_delta(delta)
    check_choice("accountant", accountant, _engine.ACCOUNTANTS)
    return _engine.epsilon([(event, count)], delta, accountant)


def fixed_order_epsilon(noise_multiplier, steps, steps_per_epoch, bands, delta, accountant="rdp"):
    """Epsilon (zero-out) of `steps` DP-BandMF steps in a fixed order.

    Args:
        noise_multiplier, steps, steps_per_epoch, bands: see
            `fixed_order_event`.
        delta: target delta in (0, 1).
        accountant: "rdp" (default) or "pld".

    Returns:
        Epsilon as a float.

    Example:

    >>> fixed_order_epsilon(2.0, 100, 30, 4, 1e-5) == fixed_order_epsilon(1.0, 1, 30, 4, 1e-5)
    True
    """
    event = fixed_order_event(noise_multiplier, steps, steps_per_epoch, bands)
    return _epsilon(event.event, event.count, delta, accountant)


def amplified_epsilon(noise_multiplier, steps, bands, sampling_probability, delta,
                      accountant="rdp"):
    """Epsilon (add-or-remove) of `steps` DP-BandMF steps, cyclic Poisson.

    Example:

    >>> from tfdp.accounting import compute_epsilon
    >>> amplified_epsilon(1.1, 1000, 1, 0.01, 1e-5) == compute_epsilon(1.1, 0.01, 1000, 1e-5)
    True
    """
    event = amplified_event(noise_multiplier, steps, bands, sampling_probability)
    return _epsilon(event.event, event.count, delta, accountant)


def calibrate_fixed_order(target_epsilon, delta, steps, steps_per_epoch, bands,
                          accountant="rdp", tolerance=1e-4):
    """The smallest noise multiplier meeting a target (fixed order).

    Args:
        target_epsilon: finite number > 0.
        delta: target delta in (0, 1).
        steps: planned steps n >= 1.
        steps_per_epoch: P >= bands.
        bands: b >= 1.
        accountant: "rdp" (default) or "pld".
        tolerance: relative precision of the answer.

    Returns:
        sigma with `fixed_order_epsilon(sigma, ...) <= target_epsilon`
        (`calibrate_noise_multiplier`'s search: it never overshoots).

    Example:

    >>> sigma = calibrate_fixed_order(1.0, 1e-5, 900, 30, 16)
    >>> fixed_order_epsilon(sigma, 900, 30, 16, 1e-5) <= 1.0
    True
    """
    check_separation(steps_per_epoch, bands)
    count = participations(check_int("steps", steps, minimum=1), steps_per_epoch)
    return calibrate_noise_multiplier(
        target_epsilon, delta, 1.0, count, accountant=accountant, tolerance=tolerance
    )


def calibrate_amplified(target_epsilon, delta, steps, bands, sampling_probability,
                        accountant="rdp", tolerance=1e-4):
    """The smallest noise multiplier meeting a target (cyclic Poisson).

    Example:

    >>> from tfdp.accounting import calibrate_noise_multiplier
    >>> calibrate_amplified(1.0, 1e-5, 1000, 1, 0.01) == calibrate_noise_multiplier(
    ...     1.0, 1e-5, 0.01, 1000)
    True
    """
    count = participations(check_int("steps", steps, minimum=1), check_int("bands", bands, minimum=1))
    return calibrate_noise_multiplier(
        target_epsilon, delta, sampling_probability, count, accountant=accountant,
        tolerance=tolerance,
    )


def noise_multiplier_of_sensitivity(noise_multiplier, sensitivity):
    """The Gaussian mechanism with sensitivity s and noise sigma is the one
    with sensitivity 1 and noise sigma / s (used to check `fixed_order_event`
    against a dense sensitivity computation).

    Example:

    >>> noise_multiplier_of_sensitivity(3.0, math.sqrt(9.0))
    1.0
    """
    sigma = check_real("noise_multiplier", noise_multiplier, low=0.0)
    sensitivity = check_real("sensitivity", sensitivity, low=0.0)
    return sigma / sensitivity
