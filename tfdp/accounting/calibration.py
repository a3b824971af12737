"""Epsilon of DP-SGD settings, and the noise needed for a target epsilon.

Example:

>>> eps = compute_dpsgd_epsilon(60000, 150, 1.3, 15, 1e-5)
>>> round(eps, 4)
0.7242
>>> sigma = calibrate_noise_multiplier(1.0, 1e-5, 0.01, 1000)
>>> compute_epsilon(sigma, 0.01, 1000, 1e-5) <= 1.0
True
"""

import math

import dp_accounting

from tfdp.accounting.events import check_count, check_number, dpsgd_event
from tfdp.accounting.ledger import event_epsilon

SIGMA_BRACKET = (1e-3, 1e4)


def compute_epsilon(noise_multiplier, sampling_probability, steps, delta, accountant="rdp", conversion="tight"):
    """Epsilon at `delta` of `steps` DP-SGD steps with Poisson sampling rate q."""
    steps = check_count("steps", steps)
    event = dpsgd_event(noise_multiplier, sampling_probability)
    check_number("delta", delta, low=0.0, high=1.0)
    if steps == 0:
        return 0.0
    return event_epsilon(dp_accounting.SelfComposedDpEvent(event, steps), delta, accountant, conversion)


def dpsgd_steps(num_examples, batch_size, epochs):
    """steps = ceil(epochs * N / batch_size), validating the arguments."""
    num_examples = check_count("num_examples", num_examples, minimum=1)
    batch_size = check_count("batch_size", batch_size, minimum=1)
    if batch_size > num_examples:
        raise ValueError(
            f"Expected `batch_size` <= the number of examples ({num_examples}). "
            f"Received: batch_size={batch_size}"
        )
    epochs = check_number("epochs", epochs, low=0.0)
    return math.ceil(epochs * num_examples / batch_size)


def compute_dpsgd_epsilon(num_examples, batch_size, noise_multiplier, epochs, delta, accountant="rdp", conversion="tight"):
    """Epsilon of DP-SGD over `epochs` epochs: q = batch_size / N,
    steps = ceil(epochs * N / batch_size) (tensorflow-privacy's convention)."""
    steps = dpsgd_steps(num_examples, batch_size, epochs)
    return compute_epsilon(noise_multiplier, batch_size / num_examples, steps, delta, accountant, conversion)


def calibrate_noise_multiplier(target_epsilon, delta, sampling_probability, steps, accountant="rdp", tolerance=1e-4):
    """Smallest noise multiplier (to a relative `tolerance`) with epsilon <= target.

    Bisection in log(sigma) that always keeps the feasible endpoint, so the
    result never overshoots the target.

    Raises:
        ValueError: if even sigma = 1e4 cannot reach the target.
    """
    target = check_number("target_epsilon", target_epsilon, low=0.0)
    check_number("delta", delta, low=0.0, high=1.0)
    check_number("sampling_probability", sampling_probability, low=0.0, high=1.0, high_open=False)
    steps = check_count("steps", steps, minimum=1)
    tolerance = check_number("tolerance", tolerance, low=0.0, high=1.0)
    eps = lambda sigma: compute_epsilon(sigma, sampling_probability, steps, delta, accountant)
    low, high = SIGMA_BRACKET
    if eps(high) > target:
        raise ValueError(
            f"The target epsilon cannot be reached with noise_multiplier <= {high:g} "
            f"at delta={delta}, {steps} steps, sampling probability {sampling_probability}. "
            f"Received: target_epsilon={target_epsilon}"
        )
    if eps(low) <= target:
        return low
    while high / low > 1.0 + tolerance:
        middle = math.sqrt(low * high)
        if eps(middle) <= target:
            high = middle
        else:
            low = middle
    return high


def calibrate_dpsgd(num_examples, batch_size, epochs, target_epsilon, delta, accountant="rdp", tolerance=1e-4):
    """`calibrate_noise_multiplier` for N examples, a batch size and epochs."""
    steps = dpsgd_steps(num_examples, batch_size, epochs)
    return calibrate_noise_multiplier(target_epsilon, delta, batch_size / num_examples, max(steps, 1), accountant, tolerance)
