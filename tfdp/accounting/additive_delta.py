"""Epsilon and delta of releases composed with a mechanism's failure probability.

DP partition selection (`tfdp.preprocessing`) is a Gaussian mechanism on
token counts followed by a threshold. The threshold adds a failure
probability `p` (that a token held by the one added record alone passes)
that no dp_accounting event represents: RDP and PLD compose the Gaussian
parts, and `p` is accounted here, on top.

The bound. Let P be the output of every release on a dataset, Q on the same
dataset with one more record, and A >= p the probability that Q releases
any token of that record alone (several selections: the sum of their
p, a union bound). P never releases such a token; on the outputs that
release none, Q's law is (1 - A') Q0 with A' <= A, and P against Q0 differ
only through the Gaussian parts, which the accountant composes into
delta_acc(eps) (both directions, add-or-remove). For any set S of outputs:

- Q(S) - e^eps P(S) <= A + delta_acc(eps);
- P(S) - e^eps Q(S) <= P(S) - e^eps (1 - A) Q0(S) <= delta_acc(eps - s),
  with s = -log(1 - A).

So the releases are (eps, delta)-DP for eps = eps_acc(delta - A) + s:
both terms are then at most delta. A is tiny (delta / 2 of an adaptation),
so s is about A; no e^eps factor multiplies it.

Example:

>>> import dp_accounting
>>> parts = [(dp_accounting.GaussianDpEvent(2.0), 1)]
>>> plain = epsilon_with(parts, 1e-5, additive=0.0)
>>> with_threshold = epsilon_with(parts, 1e-5, additive=1e-6)
>>> plain < with_threshold < plain + 0.1
True
>>> epsilon_with(parts, 1e-5, additive=1e-5)     # the threshold alone spends delta
inf
"""

import math

from tfdp.accounting import _engine


def shift(additive):
    """s = -log(1 - A): what the failure probability A adds to epsilon."""
    return -math.log1p(-additive)


def epsilon_with(parts, delta, additive, accountant="rdp", conversion="tight"):
    """eps_acc(delta - A) - log(1 - A): an epsilon bounding `parts` and A.

    Args:
        parts: (event, count) releases, as for `_engine.epsilon`.
        delta: the target delta in (0, 1).
        additive: the releases' summed failure probability A >= 0.
        accountant, conversion: as for `PrivacyLedger.epsilon`.

    Returns:
        Epsilon as a float; inf if A >= delta.
    """
    if additive == 0.0:
        return _engine.epsilon(parts, delta, accountant, conversion)
    if additive >= delta:
        return math.inf
    return _engine.epsilon(parts, delta - additive, accountant, conversion) + shift(additive)


def delta_with(parts, epsilon, additive, accountant="rdp"):
    """delta_acc(epsilon - s) + A (capped at 1): a delta bounding `parts` and A."""
    if additive == 0.0:
        return _engine.delta(parts, epsilon, accountant)
    if epsilon < shift(additive):
        return 1.0
    return min(1.0, _engine.delta(parts, epsilon - shift(additive), accountant) + additive)
