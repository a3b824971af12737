"""Epsilon of DP-SGD settings, and the noise needed for a target epsilon.

Answers "what epsilon do these settings give" and "what noise multiplier do I
need for epsilon = 3" without training. DP-SGD here means Poisson sampling
with rate q and the Gaussian mechanism with noise multiplier sigma per step
(`dpsgd_event`).

Example:

>>> round(compute_dpsgd_epsilon(60000, 150, noise_multiplier=1.3, epochs=15, delta=1e-5), 4)
0.7242
>>> sigma = calibrate_dpsgd(60000, 256, epochs=60, target_epsilon=3.0, delta=1e-5)
>>> compute_dpsgd_epsilon(60000, 256, sigma, 60, 1e-5) <= 3.0
True
"""

import contextlib
import math

from absl import logging as absl_logging

from tfdp.accounting import _engine
from tfdp.accounting._validation import (
    MAX_COUNT,
    check_choice,
    check_delta,
    check_int,
    check_real,
    warn_if_delta_exceeds_one_over_n,
)
from tfdp.accounting.events import dpsgd_event

# The noise multipliers calibration searches.
SIGMA_MIN = 1e-2
SIGMA_MAX = 1e4


def _check_accountant(accountant, conversion):
    check_choice("accountant", accountant, _engine.ACCOUNTANTS)
    check_choice("conversion", conversion, _engine.CONVERSIONS)
    if conversion == "classic" and accountant != "rdp":
        raise ValueError(
            "The classic conversion converts RDP, so it needs accountant='rdp'. "
            f"Received: accountant={accountant!r}, conversion='classic'"
        )


def compute_epsilon(
    noise_multiplier, sampling_probability, steps, delta, accountant="rdp", conversion="tight"
):
    """Epsilon of `steps` DP-SGD steps with Poisson sampling.

    Args:
        noise_multiplier: sigma, a finite number > 0.
        sampling_probability: Poisson sampling rate q in (0, 1].
        steps: number of steps, an integer >= 0.
        delta: target delta in (0, 1).
        accountant: "rdp" (default) or "pld".
        conversion: "tight" (default) or "classic" (papers' RDP conversion,
            for reproducing them only; needs accountant="rdp").

    Returns:
        Epsilon as a float (0.0 for zero steps).

    Example:

    >>> round(compute_epsilon(1.3, 150 / 60000, 6000, 1e-5), 4)
    0.7242
    """
    event = dpsgd_event(noise_multiplier, sampling_probability)
    steps = check_int("steps", steps, minimum=0)
    delta = check_delta(delta)
    _check_accountant(accountant, conversion)
    return _engine.epsilon([(event, steps)], delta, accountant, conversion)


def steps_per_epoch(num_examples, batch_size):
    """Steps in one epoch of `DPModel.fit`: max(1, round(N / batch_size)).

    The samplers (`tfdp.data.PoissonSampler`, DPIS's `ImportanceSampler`)
    use this function for their default epoch length, so calibration counts
    exactly the steps `fit` runs. Each step samples every record with
    probability batch_size / N, so an epoch visits each record round(N / b)
    * b / N times in expectation, not exactly once.

    Args:
        num_examples: N, an integer >= 1.
        batch_size: expected batch size, a number in [1, N].

    Returns:
        The number of steps (an int >= 1).

    Example:

    >>> steps_per_epoch(60000, 150)
    400
    >>> steps_per_epoch(1000, 280)   # 3.57 rounds to 4
    4
    """
    return max(1, int(round(num_examples / batch_size)))


def dpsgd_steps(num_examples, batch_size, epochs):
    """Number of DP-SGD steps that `fit(epochs=epochs, batch_size=b)` runs.

    `epochs * steps_per_epoch(N, b)` (`steps_per_epoch` is max(1,
    round(N / b)), the samplers' own count), rounded up for a fractional
    number of epochs. tensorflow-privacy's compute_dp_sgd_privacy counts
    ceil(epochs * N / b) instead, which under-counts fit whenever N / b
    rounds up (N = 1000, b = 280, 10 epochs: 36 against the 40 fit runs). A
    product within 1e-9 (relative) of an integer is taken as that integer,
    so float noise such as 0.1 * 3 does not add a step.

    Args:
        num_examples: N, an integer >= 1.
        batch_size: expected batch size, an integer in [1, N].
        epochs: a finite number >= 0.

    Returns:
        The number of steps (an int).

    Raises:
        ValueError: if the batch is larger than the dataset, or an argument
            is out of range.

    Example:

    >>> dpsgd_steps(60000, 150, 15)
    6000
    >>> dpsgd_steps(1000, 280, 10)
    40
    """
    num_examples = check_int("num_examples", num_examples, minimum=1)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    epochs = check_real("epochs", epochs, low=0.0, low_inclusive=True)
    if batch_size > num_examples:
        raise ValueError(
            f"Expected `batch_size` <= `num_examples` ({num_examples}): the batch is larger "
            f"than the dataset. Received: batch_size={batch_size}"
        )
    exact = epochs * steps_per_epoch(num_examples, batch_size)
    if exact > MAX_COUNT:
        raise ValueError(
            f"Expected `epochs` to give at most {MAX_COUNT} steps; epochs * "
            f"steps_per_epoch = {exact:.4g}. Received: epochs={epochs!r}"
        )
    nearest = round(exact)
    if abs(exact - nearest) <= 1e-9 * max(1.0, exact):
        return int(nearest)
    return math.ceil(exact)


def sampled_units(num_examples, num_users):
    """The number of units a step samples: N records, or U people with
    user-level DP (`fit(user_ids=...)`, where `batch_size` counts people);
    exactly one of the two.

    Example:

    >>> sampled_units(None, 500)
    500
    """
    if (num_examples is None) == (num_users is None):
        raise ValueError(
            "Pass `num_examples` (record-level DP: N records) or `num_users` (user-level "
            "DP, fit(user_ids=...): U people, batch_size counting people), exactly one. "
            f"Received: num_examples={num_examples!r}, num_users={num_users!r}"
        )
    if num_users is not None:
        return check_int("num_users", num_users, minimum=1)
    return num_examples


def compute_dpsgd_epsilon(
    num_examples=None,
    batch_size=None,
    noise_multiplier=None,
    epochs=None,
    delta=None,
    accountant="rdp",
    conversion="tight",
    num_users=None,
):
    """Epsilon of DP-SGD on N examples (or U people) for a number of epochs.

    Uses q = batch_size / N and the steps `fit(epochs=epochs,
    batch_size=batch_size)` runs (`dpsgd_steps`: epochs * round(N / b));
    with `num_users` U instead, q = batch_size / U (user-level DP: the
    epsilon protects a person with all their records).

    Args:
        num_examples: N, an integer >= 1 (or None with `num_users`).
        batch_size: expected batch size, an integer in [1, N].
        noise_multiplier: sigma, a finite number > 0.
        epochs: a finite number >= 0.
        delta: target delta in (0, 1); above 1/N a `LargeDeltaWarning`
            (a guarantee that allows publishing a whole record).
        accountant: "rdp" (default) or "pld".
        conversion: "tight" (default) or "classic" (papers only).
        num_users: U people, instead of `num_examples` (user-level DP).

    Returns:
        Epsilon as a float.

    Example:

    >>> round(compute_dpsgd_epsilon(60000, 150, 1.3, 15, 1e-5), 6)
    0.724223
    """
    num_examples = sampled_units(num_examples, num_users)
    steps = dpsgd_steps(num_examples, batch_size, epochs)
    warn_if_delta_exceeds_one_over_n(check_delta(delta), num_examples)
    return compute_epsilon(
        noise_multiplier, batch_size / num_examples, steps, delta, accountant, conversion
    )


def calibrate_noise_multiplier(
    target_epsilon,
    delta,
    sampling_probability,
    steps,
    accountant="rdp",
    tolerance=1e-4,
    conversion="tight",
    ledger=None,
):
    """The smallest noise multiplier whose epsilon stays within a target.

    A bracketing search over [1e-2, 1e4] (factors of 4 from sigma = 1, then
    secant steps on log(epsilon) against log(sigma) with bisection as the
    safeguard; typically 6 to 10 accountant calls). It only ever returns a
    sigma it evaluated as feasible, so the result never overshoots:
    `compute_epsilon(result, ...) <= target_epsilon` holds exactly as
    computed, and a sigma within a factor (1 + tolerance) below it was
    evaluated over the target (so, epsilon decreasing in sigma, so is
    `result / (1 + tolerance)`).

    Args:
        target_epsilon: the target, a finite number > 0.
        delta: target delta in (0, 1).
        sampling_probability: Poisson sampling rate q in (0, 1].
        steps: number of steps, an integer >= 1.
        accountant: "rdp" (default) or "pld".
        tolerance: relative precision of the answer, in (0, 1).
        conversion: "tight" (default) or "classic" (papers only).
        ledger: optional `PrivacyLedger` whose releases so far are composed
            with the `steps` future steps (to budget the rest of a run).

    Returns:
        The noise multiplier (a float in [1e-2, 1e4]); 1e-2 if even that
        little noise meets the target.

    Raises:
        ValueError: if even sigma = 1e4 cannot reach the target, an
            argument is invalid, or accountant="pld" with more than 10^6
            steps.

    Example:

    >>> sigma = calibrate_noise_multiplier(1.0, 1e-5, 0.01, 1000)
    >>> round(sigma, 3)
    1.513
    >>> compute_epsilon(sigma, 0.01, 1000, 1e-5) <= 1.0 < compute_epsilon(sigma / 1.0001, 0.01, 1000, 1e-5)
    True
    """
    target = check_real("target_epsilon", target_epsilon, low=0.0)
    delta = check_delta(delta)
    q = check_real(
        "sampling_probability", sampling_probability, low=0.0, high=1.0, high_inclusive=True
    )
    steps = check_int("steps", steps, minimum=1)
    tolerance = check_real("tolerance", tolerance, low=0.0, high=1.0)
    _check_accountant(accountant, conversion)
    spent = [] if ledger is None else ledger._spent_parts()  # pylint: disable=protected-access
    # With a ledger, its preprocessing thresholds' delta too (tfdp.accounting.additive_delta).
    epsilon_of = _engine.epsilon if ledger is None else (
        ledger._epsilon_of)  # pylint: disable=protected-access

    def epsilon_at(sigma):
        parts = spent + [(dpsgd_event(sigma, q), steps)]
        try:
            return epsilon_of(parts, delta, accountant, conversion)
        except _engine.PLDUnavailable:
            return math.inf  # beyond what PLD can represent: certainly over target

    if accountant == "pld":  # refuse what PLD cannot do before searching
        _engine.check_pld_delta(delta)
        _engine.pld_discretization(spent + [(dpsgd_event(SIGMA_MAX, q), steps)])

    def unreachable(at_max):
        already = ""
        if spent:
            already = (
                f" The ledger has already spent epsilon="
                f"{epsilon_of(spent, delta, accountant, conversion):.4g}."
            )
        return ValueError(
            f"The target epsilon cannot be reached: even noise_multiplier={SIGMA_MAX:g} gives "
            f"epsilon={at_max:.4g} at delta={delta:g} for {steps} steps with sampling "
            f"probability {q:g}.{already} Received: target_epsilon={target_epsilon!r}"
        )

    with _quiet_dp_accounting():
        return _search(epsilon_at, target, tolerance, unreachable)


@contextlib.contextmanager
def _quiet_dp_accounting():
    """Hides dp_accounting's "failed to converge ... excluding this order" warnings
    while the search probes small noise (dropping an order only loosens the
    bound; the answer is checked with the same accountant)."""
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(verbosity)


def _search(epsilon_at, target, tolerance, unreachable):
    """Brackets the answer, then narrows it (see `_bracketed_search`)."""
    # Bracket the answer by factors of 4 from sigma = 1 (typical answers need
    # few steps), within [SIGMA_MIN, SIGMA_MAX].
    sigma, value = 1.0, epsilon_at(1.0)
    if value <= target:
        high, at_high = sigma, value
        while True:
            low = max(high / 4.0, SIGMA_MIN)
            at_low = epsilon_at(low)
            if at_low > target:
                break
            if low == SIGMA_MIN:
                return SIGMA_MIN
            high, at_high = low, at_low
    else:
        low, at_low = sigma, value
        while True:
            high = min(low * 4.0, SIGMA_MAX)
            at_high = epsilon_at(high)
            if at_high <= target:
                break
            if high == SIGMA_MAX:
                raise unreachable(at_high)
            low, at_low = high, at_high
    return _bracketed_search(epsilon_at, target, low, at_low, high, at_high, tolerance)


def _log_gap(epsilon, target):
    """log(epsilon / target), with inf and 0 mapped to +-inf."""
    if epsilon <= 0:
        return -math.inf
    return math.log(epsilon) - math.log(target)


def _bracketed_search(epsilon_at, target, low, at_low, high, at_high, tolerance):
    """Shrinks [low, high] with epsilon_at(high) <= target < epsilon_at(low).

    A secant step on log(epsilon) against log(sigma) through the two latest
    points estimates the root; once the bracket is narrow, two probes just
    either side of the estimate (their ratio below 1 + tolerance) usually
    close it at once. A bisection step is taken whenever an estimate falls
    outside the bracket or an iteration fails to halve it, so the search also
    ends in O(log) calls. Every point is evaluated before it becomes an
    endpoint: the returned `high` is always feasible. Stops when
    high <= low * (1 + tolerance).
    """
    half = 0.999 * math.log1p(tolerance) / 2
    latest = [(math.log(low), _log_gap(at_low, target)), (math.log(high), _log_gap(at_high, target))]
    bisect_next = False

    def evaluate(sigma):
        nonlocal low, high
        if not low < sigma < high:
            return
        value = epsilon_at(sigma)
        latest.append((math.log(sigma), _log_gap(value, target)))
        del latest[:-2]
        if value <= target:
            high = sigma
        else:
            low = sigma

    while high > low * (1.0 + tolerance):
        a, b = math.log(low), math.log(high)
        (x1, g1), (x2, g2) = latest
        estimate = None
        if not bisect_next and math.isfinite(g1) and math.isfinite(g2) and g1 != g2:
            estimate = x2 - g2 * (x2 - x1) / (g2 - g1)
            if not a < estimate < b:
                estimate = None
        if estimate is None:
            middle = math.exp((a + b) / 2)
            if not low < middle < high:  # float resolution reached
                break
            evaluate(middle)
        elif b - a < 0.5:
            evaluate(math.exp(estimate + half))
            evaluate(math.exp(estimate - half))
        else:
            evaluate(math.exp(estimate))
        bisect_next = math.log(high) - math.log(low) > (b - a) / 2
    return high


def calibrate_dpsgd(
    num_examples=None,
    batch_size=None,
    epochs=None,
    target_epsilon=None,
    delta=None,
    accountant="rdp",
    tolerance=1e-4,
    conversion="tight",
    num_users=None,
):
    """`calibrate_noise_multiplier` for N examples (or U people), a batch
    size and epochs.

    Uses q = batch_size / N and the steps `fit(epochs=epochs,
    batch_size=batch_size)` runs (`dpsgd_steps`: epochs * round(N / b)), so
    training with the returned noise ends within `target_epsilon`. With
    `num_users` U instead of N, q = batch_size / U: the noise for
    `fit(user_ids=..., batch_size=b)`, whose epsilon protects a person.

    Args:
        num_examples: N, an integer >= 1 (or None with `num_users`).
        batch_size: expected batch size, an integer in [1, N].
        epochs: a finite number > 0.
        target_epsilon: the target, a finite number > 0.
        delta: target delta in (0, 1); above 1/N a `LargeDeltaWarning`.
        accountant: "rdp" (default) or "pld".
        tolerance: relative precision of the answer, in (0, 1).
        conversion: "tight" (default) or "classic" (papers only).
        num_users: U people, instead of `num_examples` (user-level DP).

    Returns:
        The noise multiplier.

    Example:

    >>> round(calibrate_dpsgd(60000, 150, 15, target_epsilon=0.7242234, delta=1e-5), 3)
    1.3
    >>> round(calibrate_dpsgd(num_users=60000, batch_size=150, epochs=15,
    ...                       target_epsilon=0.7242234, delta=1e-5), 3)
    1.3
    """
    num_examples = sampled_units(num_examples, num_users)
    check_real("epochs", epochs, low=0.0)
    steps = dpsgd_steps(num_examples, batch_size, epochs)
    warn_if_delta_exceeds_one_over_n(check_delta(delta), num_examples)
    return calibrate_noise_multiplier(
        target_epsilon,
        delta,
        batch_size / num_examples,
        steps,
        accountant=accountant,
        tolerance=tolerance,
        conversion=conversion,
    )
