"""What a private hyperparameter search costs: Papernot & Steinke's repeat-and-select.

A search that runs a *random* number K of independent trials, each an
RDP mechanism Q (one private training plus its private score), and releases
only the best trial, is charged as one `dp_accounting.dp_event.RepeatAndSelectDpEvent(
Q, mean, shape)` (Papernot & Steinke, "Hyperparameter tuning with Renyi
differential privacy", ICLR 2022). K is drawn from one of four laws, each
named by dp_accounting's `shape`:

- "poisson" (shape = inf): K ~ Poisson(mean); K = 0 releases nothing.
- "geometric" (shape = 1): P(K = k) = g (1 - g)^(k - 1), k >= 1.
- "logarithmic" (shape = 0): P(K = k) proportional to (1 - g)^k / k, k >= 1.
- "negative_binomial" (0 < shape < inf): the negative binomial truncated
  at k >= 1, P(K = k) proportional to C(k + shape - 1, k) (1 - g)^k.

The halting probability g of the last three is the one dp_accounting's RDP
accountant derives from `mean` (`trial_count_parameter`), so the trials
drawn follow exactly the law the accountant analysed. The realised K is part
of the mechanism: releasing it with the best trial voids the bound.

This module imports neither TensorFlow nor Keras.

Example:

>>> import dp_accounting
>>> from tfdp.accounting import dpsgd_event
>>> trial = dp_accounting.SelfComposedDpEvent(dpsgd_event(1.1, 0.01), 1000)
>>> event = repeat_and_select_event(trial, mean_trials=10, distribution="geometric")
>>> event.shape
1.0
>>> one = compute_epsilon_of(trial, delta=1e-5)
>>> search = compute_epsilon_of(event, delta=1e-5)
>>> round(one, 2), round(search, 2)
(1.71, 3.43)
"""

import math

import dp_accounting
import numpy as np
from dp_accounting.dp_event import RepeatAndSelectDpEvent
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_lib

from tfdp.accounting import _engine
from tfdp.accounting._validation import (
    check_choice,
    check_delta,
    check_real,
    show,
    warn_if_delta_exceeds_one_over_n,
)
from tfdp.accounting.calibration import SIGMA_MAX, _quiet_dp_accounting, _search, dpsgd_steps
from tfdp.accounting.events import dpsgd_event

DISTRIBUTIONS = {
    "poisson": math.inf,
    "geometric": 1.0,
    "logarithmic": 0.0,
    "negative_binomial": None,
}
"""The laws a search can draw its number of trials from, each with
dp_accounting's `shape` (None: the negative binomial's, which you give)."""


def trial_count_shape(distribution, shape=None):
    """dp_accounting's `shape` for a named law of the number of trials.

    Args:
        distribution: "poisson", "geometric", "logarithmic" or
            "negative_binomial".
        shape: only for "negative_binomial": a finite number > 0 (the
            paper's eta; 1 is the geometric law, smaller values have a
            lighter cost and a heavier tail).

    Returns:
        The shape as a float: inf, 1.0, 0.0, or `shape`.

    Example:

    >>> trial_count_shape("poisson"), trial_count_shape("negative_binomial", 0.5)
    (inf, 0.5)
    """
    check_choice("distribution", distribution, tuple(DISTRIBUTIONS))
    fixed = DISTRIBUTIONS[distribution]
    if fixed is not None:
        if shape is not None:
            raise ValueError(
                f"`shape` is only for distribution='negative_binomial' (the {distribution} "
                f"law has shape {fixed}). Received: shape={show(shape)}"
            )
        return fixed
    if shape is None:
        raise ValueError(
            "distribution='negative_binomial' needs its `shape`, a finite number > 0. "
            "Received: shape=None"
        )
    return check_real("shape", shape, low=0.0)


def check_mean_trials(mean_trials):
    """The expected number of trials, a finite number >= 1."""
    return check_real("mean_trials", mean_trials, low=1.0, low_inclusive=True)


def trial_count_parameter(mean_trials, shape):
    """The halting probability g that dp_accounting's RDP accountant uses for
    a truncated negative binomial (shape < inf) of mean `mean_trials`.

    The accountant inverts the mean by bisection and keeps the smaller g
    (a mean slightly above the one asked for, the conservative side); the
    trials must be drawn with this same g. Reads dp_accounting's private
    `_gamma_truncated_negative_binomial`: this is the one place that does.

    Example:

    >>> trial_count_parameter(4.0, 1.0)
    0.25
    """
    return float(_rdp_lib._gamma_truncated_negative_binomial(shape, mean_trials))  # pylint: disable=protected-access


def draw_trial_count(rng, mean_trials, shape):
    """Draws the number of trials K from the law the accountant analyses.

    Args:
        rng: a `numpy.random.Generator` (fresh entropy in a real search).
        mean_trials: the mean, >= 1.
        shape: dp_accounting's shape (`trial_count_shape`).

    Returns:
        K, an int (>= 1, or >= 0 for the Poisson law).

    Example:

    >>> rng = np.random.default_rng(0)
    >>> counts = [draw_trial_count(rng, 3.0, 1.0) for _ in range(20000)]
    >>> bool(min(counts) >= 1 and abs(np.mean(counts) - 3.0) < 0.1)
    True
    """
    if shape == math.inf:
        return int(rng.poisson(mean_trials))
    gamma = trial_count_parameter(mean_trials, shape)
    if gamma >= 1.0:
        return 1
    if shape == 0.0:  # logarithmic: P(k) = (1-g)^k / (k log(1/g))
        return int(rng.logseries(1.0 - gamma))
    return _truncated_negative_binomial(float(rng.random()), gamma, shape)


def _truncated_negative_binomial(uniform, gamma, shape):
    """The inverse CDF at `uniform` of the negative binomial truncated at k >= 1.

    P(K = k) = C(k + shape - 1, k) g^shape (1 - g)^k / (1 - g^shape): one
    uniform draw for any shape (rejecting K = 0 took ~1 / (1 - g^shape)
    draws, forever for a tiny shape). The loop runs K times; it stops where
    the float probabilities underflow, a tail below 1e-300.

    Example:

    >>> [_truncated_negative_binomial(u, 0.5, 1.0) for u in (0.1, 0.6, 0.9)]
    [1, 2, 4]
    """
    log_gamma = math.log(gamma)
    probability = (shape * (1.0 - gamma) * math.exp(shape * log_gamma)
                   / -math.expm1(shape * log_gamma))
    count, cumulative = 1, probability
    while uniform >= cumulative and probability > 0.0:
        probability *= (count + shape) / (count + 1) * (1.0 - gamma)
        count += 1
        cumulative += probability
    return count


def repeat_and_select_event(trial_event, mean_trials, distribution="geometric", shape=None):
    """The event of a search that releases the best of K trials of `trial_event`.

    Args:
        trial_event: a `dp_accounting.DpEvent`: everything ONE trial releases
            (its training steps and its private score).
        mean_trials: the expected number of trials, a finite number >= 1.
        distribution: the law of K (see the module docstring).
        shape: the negative binomial's shape (only with that law).

    Returns:
        `dp_accounting.dp_event.RepeatAndSelectDpEvent(trial_event, mean, shape)`.

    Example:

    >>> repeat_and_select_event(dp_accounting.GaussianDpEvent(5.0), 8, "poisson")
    RepeatAndSelectDpEvent(event=GaussianDpEvent(noise_multiplier=5.0), mean=8.0, shape=inf)
    """
    if not isinstance(trial_event, dp_accounting.DpEvent):
        raise TypeError(
            "Expected `trial_event` to be a dp_accounting DpEvent. Received: "
            f"trial_event={show(trial_event)}"
        )
    return RepeatAndSelectDpEvent(
        trial_event, check_mean_trials(mean_trials), trial_count_shape(distribution, shape))


def compute_epsilon_of(event, delta):
    """Epsilon at `delta` of one `event` with tfdp's RDP accountant (the
    ledger's numbers).

    Example:

    >>> round(compute_epsilon_of(dp_accounting.GaussianDpEvent(5.0), 1e-5), 4)
    0.7945
    """
    return _engine.epsilon([(event, 1)], check_delta(delta))


def search_epsilon(trial_event, mean_trials, delta, distribution="geometric", shape=None):
    """Epsilon at `delta` of a private search of `trial_event` trials.

    Example:

    >>> trial = dp_accounting.GaussianDpEvent(5.0)
    >>> search_epsilon(trial, 10, 1e-5) > compute_epsilon_of(trial, 1e-5)
    True
    """
    return compute_epsilon_of(
        repeat_and_select_event(trial_event, mean_trials, distribution, shape), delta)


def dpsgd_trial_event(noise_multiplier, num_examples, batch_size, epochs,
                      score_noise_multiplier=10.0):
    """What one DP-SGD trial of `tfdp.tuning.PrivateRandomSearch` releases:
    `fit(epochs=epochs, batch_size=batch_size)` on N records (every trial
    samples all N, held-out records with weight 0), then its validation
    score with noise `score_noise_multiplier`, or no score release when it
    is None (validation data you could publish).

    Example:

    >>> dpsgd_trial_event(2.0, 1000, 100, 1, score_noise_multiplier=None)
    SelfComposedDpEvent(event=PoissonSampledDpEvent(sampling_probability=0.1, event=GaussianDpEvent(noise_multiplier=2.0)), count=10)
    """
    check_real("epochs", epochs, low=0.0)
    steps = dpsgd_steps(num_examples, batch_size, epochs)
    training = dp_accounting.SelfComposedDpEvent(
        dpsgd_event(noise_multiplier, batch_size / num_examples), steps)
    if score_noise_multiplier is None:
        return training
    score = check_real("score_noise_multiplier", score_noise_multiplier, low=0.0)
    return dp_accounting.ComposedDpEvent([training, dp_accounting.GaussianDpEvent(score)])


def calibrate_search_noise(num_examples, batch_size, epochs, target_epsilon, delta, mean_trials,
                           distribution="geometric", shape=None, score_noise_multiplier=10.0,
                           tolerance=1e-4):
    """The smallest DP-SGD noise multiplier whose whole private search
    costs at most `target_epsilon` at `delta`.

    The search is `tfdp.tuning.PrivateRandomSearch(..., mean_trials,
    distribution, shape, score_noise_multiplier)` whose trials run
    `fit(x, y, batch_size=batch_size, epochs=epochs)` on `num_examples`
    records with this noise multiplier (`dpsgd_trial_event`); pass
    `score_noise_multiplier=None` when the trials are scored on public
    validation data. The ledger of the chosen model of a tuner's first
    search then reports at most `target_epsilon` (the same accountant; a
    second search with the same tuner is charged on top of the first), and
    a noise multiplier `1 + tolerance` times smaller would exceed it, unless
    the answer is the floor 0.01: then even that little noise meets the
    target.

    Args:
        num_examples: N, the records the trials sample from.
        batch_size: the expected batch size, an integer in [1, N].
        epochs: a finite number > 0.
        target_epsilon: the search's target, a finite number > 0.
        delta: target delta in (0, 1); above 1/N a `LargeDeltaWarning`.
        mean_trials, distribution, shape: the law of the number of trials.
        score_noise_multiplier: the search's (default 10), or None.
        tolerance: relative precision of the answer, in (0, 1).

    Returns:
        The noise multiplier, to pass to the hypermodel's optimizer (its
        model must keep `steps_per_execution=1`, as the search requires).

    Raises:
        ValueError: if even sigma = 1e4 cannot reach the target (the score
            release alone may cost more: raise `score_noise_multiplier`),
            or an argument is invalid.

    Example:

    >>> sigma = calibrate_search_noise(60000, 2048, 40, target_epsilon=3.0, delta=1e-5,
    ...                                mean_trials=4, distribution="logarithmic")
    >>> event = dpsgd_trial_event(sigma, 60000, 2048, 40)
    >>> search_epsilon(event, 4, 1e-5, "logarithmic") <= 3.0
    True
    >>> round(sigma, 2)
    2.74
    """
    # Checks N, the batch size, the epochs and the score's noise first.
    dpsgd_trial_event(1.0, num_examples, batch_size, epochs, score_noise_multiplier)
    target = check_real("target_epsilon", target_epsilon, low=0.0)
    warn_if_delta_exceeds_one_over_n(check_delta(delta), num_examples)
    mean_trials = check_mean_trials(mean_trials)
    shape = trial_count_shape(distribution, shape)
    tolerance = check_real("tolerance", tolerance, low=0.0, high=1.0)

    def epsilon_at(sigma):
        trial = dpsgd_trial_event(sigma, num_examples, batch_size, epochs, score_noise_multiplier)
        return compute_epsilon_of(RepeatAndSelectDpEvent(trial, mean_trials, shape), delta)

    def unreachable(at_max):
        return ValueError(
            f"The target epsilon cannot be reached: even noise_multiplier={SIGMA_MAX:g} gives a "
            f"search epsilon of {at_max:.4g} at delta={delta:g} (the noisy validation scores "
            "cost epsilon too: raise score_noise_multiplier, or score on public data). "
            f"Received: target_epsilon={target_epsilon!r}"
        )

    with _quiet_dp_accounting():
        return _search(epsilon_at, target, tolerance, unreachable)
