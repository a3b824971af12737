"""Epsilon and delta of releases composed with a mechanism's additive delta.

DP partition selection (`tfdp.preprocessing`) is a Gaussian mechanism on
counts followed by a threshold; the threshold adds a failure probability
`p` (a token held by one record alone passes) that no dp_accounting event
represents: RDP and PLD compose the Gaussian part, and `p` is added on top.

The bound: let P and Q be the outputs of all releases on neighbouring
datasets, Q the one with the extra record, and let `p` bound the
probability that Q releases anything of that record's own tokens (then P
and Q differ only through the Gaussian parts, which the accountant
composes into delta_acc(epsilon)). For any set S of outputs,
P(S) - e^eps Q(S) <= delta_acc(eps) + e^eps p and
Q(S) - e^eps P(S) <= delta_acc(eps) + p, so the composition is
(eps, delta_acc(eps) + e^eps p)-DP (several selections: p is the sum of
their thresholds' deltas, a union bound). `epsilon_with` returns an eps
with that sum at most delta.

Example:

>>> import dp_accounting
>>> parts = [(dp_accounting.GaussianDpEvent(2.0), 1)]
>>> plain = epsilon_with(parts, 1e-5, additive=0.0)
>>> with_threshold = epsilon_with(parts, 1e-5, additive=1e-7)
>>> plain < with_threshold
True
>>> delta_with(parts, with_threshold, additive=1e-7) <= 1e-5
True
"""

import math

from tfdp.accounting import _engine

# Fixed-point iterations before giving up (each one accountant call; the
# answer typically settles in two or three).
_MAX_ITERATIONS = 60
# Relative step added to a candidate so the iteration reaches a fixed point.
_SLACK = 1e-9


def epsilon_with(parts, delta, additive, accountant="rdp", conversion="tight"):
    """The smallest epsilon found with delta_acc(eps) + e^eps * additive <= delta.

    Args:
        parts: (event, count) releases, as for `_engine.epsilon`.
        delta: the target delta in (0, 1).
        additive: the releases' summed additive delta p >= 0.
        accountant, conversion: as for `PrivacyLedger.epsilon`.

    Returns:
        A float eps such that the accountant's epsilon at
        delta - e^eps * additive is at most eps (so the bound holds), or inf
        if no such eps exists below the budget of iterations.
    """
    if additive == 0.0:
        return _engine.epsilon(parts, delta, accountant, conversion)
    eps = 0.0
    for _ in range(_MAX_ITERATIONS):
        rest = delta - math.exp(eps) * additive if eps < 700 else -1.0
        if rest <= 0.0:
            return math.inf
        candidate = _engine.epsilon(parts, rest, accountant, conversion)
        if candidate <= eps:
            return eps  # delta_acc(eps) <= delta_acc(candidate) <= rest
        if math.isinf(candidate):
            return math.inf
        eps = candidate * (1.0 + _SLACK) + _SLACK
    return math.inf


def delta_with(parts, epsilon, additive, accountant="rdp"):
    """delta_acc(epsilon) + e^epsilon * additive, capped at 1."""
    value = _engine.delta(parts, epsilon, accountant)
    if additive:
        value += math.exp(min(epsilon, 700.0)) * additive
    return min(1.0, value)
