"""DP partition selection: which tokens of the private data may be released.

Gaussian thresholding (Wilson et al. 2020, "Differentially private SQL with
bounded user contribution"; pipeline-dp's and OpenDP's Gaussian partition
selection): each unit (a record, or a person with `user_ids`) contributes
at most `k` distinct tokens (a uniform sample of its tokens when it has
more), each token's count of contributing units gets Gaussian noise of
standard deviation `sigma * sqrt(k)` (a unit changes at most k counts by 1,
L2 sensitivity sqrt(k)), and a token is kept when its noisy count exceeds a
threshold T.

The threshold's delta: a token held by one unit alone has count 1, so it
passes with probability p = P(1 + N(0, s^2) > T). The unit's at most k such
tokens are noised independently, so one of them passes with probability
1 - (1 - p)^k; T is the smallest threshold that keeps this at most
`delta_threshold`: p = 1 - (1 - delta_threshold)^(1/k) and
T = 1 + s * Phi^-1(1 - p + 2^-32). The 2^-32 is the generator's
(`tfdp.mechanisms.gaussian.numpy_normal`): its radius takes E = -ln V at
the bottom of V's 2^-32 cell, so P(E >= x) <= e^-x + 2^-32, which adds at
most 2^-33 to a count's tail over the half of the angles that point up,
and its angle is the midpoint of one of 2^32 cells: the midpoint rule on
the smooth periodic exp(-z^2 / (2 cos^2)), whose error is the function's
Fourier coefficients at multiples of 2^32, decaying like
exp(-(z^2 2^64)^(1/3)): far below 2^-33 for any z = (T - 1) / s above
1e-6 (every delta_threshold below 0.49). So the generator's tail is at
most the Gaussian tail plus 2^-32. The Gaussian part (counts of tokens the other
units also hold) is `GaussianDpEvent(sigma)` in the ledger; the threshold's
delta is accounted on top (`tfdp.accounting.additive_delta` derives the
bound: epsilon at delta - delta_threshold, plus -log(1 - delta_threshold)).

Example:

>>> t = threshold(noise_std=2.0, max_tokens=1, delta_threshold=1e-6)
>>> round(t, 4)
10.5069
>>> import numpy as np
>>> kept = select({"a": 500, "b": 1}, noise_std=2.0, threshold=t, rng=np.random.default_rng(0))
>>> sorted(kept)
['a']
"""

import math
import statistics

import numpy as np

from tfdp.mechanisms.gaussian import numpy_normal

_NORMAL = statistics.NormalDist()
# How much more often `numpy_normal`'s draw passes a threshold than an exact
# Gaussian's, at most (module docstring).
GENERATOR_TAIL_EXCESS = 2.0**-32


def pass_probability(max_tokens, delta_threshold):
    """p: each of a lone unit's `max_tokens` tokens may pass with this probability.

    1 - (1 - p)^k = delta_threshold, computed without cancellation.
    """
    return -math.expm1(math.log1p(-delta_threshold) / max_tokens)


def threshold(noise_std, max_tokens, delta_threshold):
    """The count a token's noisy count must exceed to be kept.

    Args:
        noise_std: s, the Gaussian noise's standard deviation on a count.
        max_tokens: k, the most distinct tokens one unit contributes.
        delta_threshold: the largest probability that any token held by one
            unit alone passes.

    Returns:
        T = 1 + s * Phi^-1(1 - p + 2^-32) with p = `pass_probability(k,
        delta)`: the noise generator's tail is at most the Gaussian's plus
        2^-32 (`GENERATOR_TAIL_EXCESS`).

    Raises:
        ValueError: if p <= 2^-32 (delta_threshold below about k 2^-32):
            no threshold keeps the generator's pass probability below it.
    """
    p = pass_probability(max_tokens, delta_threshold)
    gaussian_p = p - GENERATOR_TAIL_EXCESS
    if gaussian_p <= 0:
        raise ValueError(
            f"The threshold's delta is too small for the noise generator: a token of one unit "
            f"alone would pass with probability {p:.3g}, below the 2^-32 = "
            f"{GENERATOR_TAIL_EXCESS:.3g} that the generator's rounding may add. Use a delta "
            f"of at least {4 * max_tokens * GENERATOR_TAIL_EXCESS:.2g} for this adaptation "
            f"(k={max_tokens}). Received: delta_threshold={delta_threshold:g}")
    return 1.0 - noise_std * _NORMAL.inv_cdf(gaussian_p)  # -Phi^-1(p): exact in the tail


def bounded_counts(units, max_tokens, key):
    """Counts of units holding each token, each unit contributing <= k tokens.

    A unit with more than k distinct tokens contributes a uniform sample of
    k of them, drawn from its own stream keyed by (`key`, the unit's code):
    removing one unit leaves every other unit's sample as it was.

    Args:
        units: an iterable of (code, tokens) pairs, one per unit: `code` a
            sequence of non-negative ints naming the unit, a function of the
            unit alone (`tfdp.data.users.user_codes`), `tokens` an iterable
            of hashable tokens.
        max_tokens: k.
        key: a non-negative int, the run's key for the samples.

    Returns:
        A dict token -> number of units that contributed it.

    Example:

    >>> counts = bounded_counts([((0,), ["a", "b", "c"]), ((1,), ["a"])], 1, key=7)
    >>> counts["a"] >= 1 and sum(counts.values())
    2
    """
    counts = {}
    for code, tokens in units:
        distinct = list(dict.fromkeys(tokens))
        if len(distinct) > max_tokens:
            stream = np.random.default_rng([int(key), *(int(word) for word in code)])
            chosen = stream.choice(len(distinct), size=max_tokens, replace=False)
            distinct = [distinct[i] for i in sorted(chosen)]
        for token in distinct:
            counts[token] = counts.get(token, 0) + 1
    return counts


def select(counts, noise_std, threshold, rng):
    """The tokens whose noisy count exceeds `threshold`, with those noisy counts.

    Args:
        counts: dict token -> count (from `bounded_counts`).
        noise_std: the Gaussian noise's standard deviation.
        threshold: from `threshold`.
        rng: a `numpy.random.Generator`.

    Returns:
        A dict token -> noisy count, ordered by noisy count, largest first
        (ties by token text: the order depends on released values only).
    """
    tokens = list(counts)
    noisy = np.asarray([counts[t] for t in tokens], np.float64) + numpy_normal(
        rng, noise_std, size=len(tokens))  # the whole Gaussian tail
    kept = [(float(n), t) for n, t in zip(noisy, tokens) if n > threshold]
    kept.sort(key=lambda item: (-item[0], str(item[1])))
    return {token: value for value, token in kept}
