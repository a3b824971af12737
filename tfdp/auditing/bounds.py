"""Turning an attack's error rates into a lower bound on epsilon.

A mechanism that is (epsilon, delta)-DP forces every test that tells D from
D' (D plus one record) to satisfy FPR + e^epsilon FNR >= 1 - delta and
FNR + e^epsilon FPR >= 1 - delta (Kairouz et al. 2015). Observed error rates
therefore bound epsilon from below:

    epsilon >= log((1 - delta - FNR) / FPR)   and   log((1 - delta - FPR) / FNR).

Both right-hand sides decrease as FPR and FNR grow, so with finitely many
trials tfdp plugs in one-sided Clopper-Pearson UPPER bounds on both rates,
each at confidence (1 + confidence) / 2: by the union bound both hold at once
with probability >= `confidence`, and then so does the epsilon bound.

The Clopper-Pearson bound is exact (the Beta quantile, via
`scipy.special.betaincinv`; SciPy is already a dependency of dp_accounting),
not a normal approximation, so it is valid for counts of 0 and tiny rates.

Example:

>>> round(clopper_pearson_upper(0, 1000, 0.975), 5)
0.00368
>>> round(clopper_pearson_upper(5, 100, 0.95), 4)
0.1023
>>> round(epsilon_lower_bound(0, 1000, 0, 1000, delta=1e-5, confidence=0.95), 2)
5.6
"""

import numpy as np
from scipy import special

from tfdp.accounting._validation import check_int, check_real


def _check_counts(count_name, count, total_name, total):
    total = check_int(total_name, total, minimum=1)
    count = check_int(count_name, count)
    if count > total:
        raise ValueError(
            f"Expected `{count_name}` <= {total_name} ({total}). Received: {count_name}={count}"
        )
    return count, total


def _upper(successes, trials, confidence):
    """Vectorized one-sided Clopper-Pearson upper bounds (no argument checks)."""
    successes = np.asarray(successes, dtype=np.float64)
    trials = np.asarray(trials, dtype=np.float64)
    full = successes >= trials
    # Beta(k + 1, n - k) quantile; the k = n case (upper bound 1) is masked out
    # first because the Beta's second parameter would be 0.
    b = np.where(full, 1.0, trials - successes)
    bound = special.betaincinv(successes + 1.0, b, confidence)
    return np.where(full, 1.0, bound)


def clopper_pearson_upper(successes, trials, confidence):
    """One-sided upper confidence bound on a binomial proportion.

    The p_U with P(Binomial(trials, p_U) <= successes) = 1 - confidence (and
    1 when successes == trials): with probability >= `confidence` the true
    proportion is <= p_U.

    Args:
        successes: observed count k, an integer with 0 <= k <= trials.
        trials: n, an integer >= 1.
        confidence: in (0, 1), e.g. 0.975.

    Returns:
        A float in (0, 1].

    Example:

    >>> round(clopper_pearson_upper(50, 1000, 0.95), 4)
    0.0629
    """
    successes, trials = _check_counts("successes", successes, "trials", trials)
    confidence = check_real("confidence", confidence, low=0.0, high=1.0)
    return float(_upper(successes, trials, confidence))


def _epsilon_bounds(false_positives, negatives, false_negatives, positives, delta, confidence):
    """Vectorized `epsilon_lower_bound` (no argument checks)."""
    each = (1.0 + confidence) / 2.0
    fpr = _upper(false_positives, negatives, each)
    fnr = _upper(false_negatives, positives, each)
    with np.errstate(divide="ignore", invalid="ignore"):
        first = np.log((1.0 - delta - fnr) / fpr)
        second = np.log((1.0 - delta - fpr) / fnr)
    first = np.where(1.0 - delta - fnr > 0, first, 0.0)
    second = np.where(1.0 - delta - fpr > 0, second, 0.0)
    return np.maximum(0.0, np.maximum(first, second))


def epsilon_lower_bound(false_positives, negatives, false_negatives, positives, delta, confidence=0.95):
    """Epsilon that an attack's errors prove, with the given confidence.

    The attack looked at `negatives` outputs of the mechanism on D and
    `positives` outputs on D' and said "in" or "out" for each.

    Args:
        false_positives: outputs from D that the attack called "in".
        negatives: outputs from D, an integer >= 1.
        false_negatives: outputs from D' that the attack called "out".
        positives: outputs from D', an integer >= 1.
        delta: the delta of the guarantee being audited, in [0, 1).
        confidence: overall confidence of the bound, in (0, 1) (default 0.95).

    Returns:
        A float >= 0: with probability >= `confidence` over the trials, the
        mechanism is not (epsilon', delta)-DP for any epsilon' below it.
        0.0 when the errors prove nothing.

    Example:

    >>> round(epsilon_lower_bound(10, 10000, 9000, 10000, delta=1e-5), 3)
    3.936
    """
    false_positives, negatives = _check_counts("false_positives", false_positives, "negatives", negatives)
    false_negatives, positives = _check_counts("false_negatives", false_negatives, "positives", positives)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=True)
    confidence = check_real("confidence", confidence, low=0.0, high=1.0)
    return float(
        _epsilon_bounds(false_positives, negatives, false_negatives, positives, delta, confidence)
    )
