"""`PrivacyLedger`: every private release of a training run, as DpEvents.

The ledger is tfdp's single source of truth for epsilon. Mechanisms describe
what they release (`begin_steps` for the per-step event, `record` for one-off
releases); the ledger composes them with dp_accounting's accountants.

Example:

>>> from tfdp.accounting import PrivacyLedger, dpsgd_event
>>> ledger = PrivacyLedger()
>>> ledger.begin_steps(dpsgd_event(noise_multiplier=1.1, sampling_probability=256 / 60000))
>>> ledger.advance(14_040)          # 60 epochs
>>> round(ledger.epsilon(delta=1e-5), 2)
2.92
"""

import json
import math

import dp_accounting
import numpy as np

from tfdp.accounting.events import check_count, check_number, event_from_dict, event_to_dict
from tfdp.accounting.statement import privacy_statement

ACCOUNTANTS = ("rdp", "pld")
CONVERSIONS = ("tight", "classic")
CLASSIC_ORDERS = tuple(range(2, 65))
# PLD discretisation: pessimistic rounding keeps the bound valid; 1e-4 keeps
# a 10,000-step DP-SGD ledger under a second.
PLD_DISCRETIZATION = 1e-4


def rdp_curve(event, orders):
    """RDP epsilons of `event` at `orders`, from dp_accounting's RdpAccountant.

    dp_accounting exposes the composed RDP vector only as the private
    attribute `_rdp`; this is the one place tfdp reads it (tests pin it).
    """
    accountant = dp_accounting.rdp.RdpAccountant(orders=list(orders))
    accountant.compose(event)
    return np.asarray(accountant._rdp, dtype=np.float64)  # pylint: disable=protected-access


def classic_epsilon(event, delta):
    """eps = min_alpha RDP(alpha) + log(1/delta) / (alpha - 1), alpha in 2..64.

    The conversion of Abadi et al. / Mironov (2017) the seed papers use; looser
    than dp_accounting's default. Only for reproducing papers' numbers.
    """
    orders = np.asarray(CLASSIC_ORDERS, dtype=np.float64)
    rdp = rdp_curve(event, orders)
    return float(np.min(rdp + math.log(1.0 / delta) / (orders - 1.0)))


def _accountant(name):
    if name == "rdp":
        return dp_accounting.rdp.RdpAccountant()
    if name == "pld":
        return dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    raise ValueError(f"Expected `accountant` in {ACCOUNTANTS}. Received: accountant={name!r}")


def event_epsilon(event, delta, accountant="rdp", conversion="tight"):
    """Epsilon at `delta` of one (composed) DpEvent."""
    delta = check_number("delta", delta, low=0.0, high=1.0)
    if conversion not in CONVERSIONS:
        raise ValueError(f"Expected `conversion` in {CONVERSIONS}. Received: conversion={conversion!r}")
    if conversion == "classic":
        if accountant != "rdp":
            raise ValueError(
                "The classic conversion applies to RDP only. Received: "
                f"accountant={accountant!r}, conversion='classic'"
            )
        return classic_epsilon(event, delta)
    acc = _accountant(accountant)
    acc.compose(event)
    return float(acc.get_epsilon(delta))


class PrivacyLedger:
    """Composes a run's releases; answers epsilon, delta and budget questions.

    Args:
        step_counter: optional zero-argument callable returning how many
            private training steps ran (tfdp's models read a variable that
            the compiled train step increments). Without it the ledger keeps
            its own count, advanced by `advance`.
    """

    def __init__(self, step_counter=None):
        self._step_counter = step_counter
        self._own_steps = 0
        self._segments = []  # closed: (event, count)
        self._records = []  # one-off: (event, count)
        self._open_event = None
        self._open_start = 0
        self._cache = {}

    # -- recording -------------------------------------------------------

    @property
    def steps(self):
        """Private training steps run so far."""
        return int(self._step_counter()) if self._step_counter else self._own_steps

    def advance(self, n=1):
        """Counts `n` more steps (only for a ledger without a step_counter)."""
        if self._step_counter is not None:
            raise ValueError("This ledger reads its steps from the model; advance() is not allowed.")
        self._own_steps += check_count("n", n)

    def begin_steps(self, event):
        """From the current step on, every step releases `event`."""
        event_to_dict(event)  # type check
        if event == self._open_event:
            return
        self._close_open_segment()
        self._open_event = event
        self._open_start = self.steps

    def _close_open_segment(self):
        if self._open_event is not None:
            count = self.steps - self._open_start
            if count > 0:
                self._segments.append((self._open_event, count))
        self._open_event = None
        self._open_start = self.steps

    def record(self, event, count=1):
        """Records `count` one-off releases of `event` (not tied to steps)."""
        event_to_dict(event)
        count = check_count("count", count, minimum=1)
        self._records.append((event, count))

    # -- questions ---------------------------------------------------------

    def _parts(self, extra_steps=0):
        parts = list(self._segments) + list(self._records)
        if self._open_event is not None:
            count = self.steps - self._open_start + extra_steps
            if count > 0:
                parts.append((self._open_event, count))
        elif extra_steps:
            raise ValueError("No step event is open, so extra steps cannot be projected.")
        return parts

    def composed_event(self, extra_steps=0):
        """Everything released, as one dp_accounting DpEvent."""
        parts = [
            event if count == 1 else dp_accounting.SelfComposedDpEvent(event, count)
            for event, count in self._parts(extra_steps)
        ]
        return dp_accounting.ComposedDpEvent(parts)

    def epsilon(self, delta, accountant="rdp", conversion="tight", extra_steps=0):
        """Epsilon spent at `delta` (0.0 before any release).

        Args:
            delta: target delta in (0, 1).
            accountant: "rdp" (default, tensorflow-privacy's accountant) or
                "pld" (privacy loss distributions, tighter).
            conversion: "tight" (dp_accounting's RDP conversion, the default)
                or "classic" (the papers' formula; for reproductions only).
            extra_steps: also count this many more steps of the open event.
        """
        extra_steps = check_count("extra_steps", extra_steps)
        parts = self._parts(extra_steps)
        if not parts:
            check_number("delta", delta, low=0.0, high=1.0)
            return 0.0
        key = (repr(parts), float(delta), accountant, conversion)
        if key not in self._cache:
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[key] = event_epsilon(
                self.composed_event(extra_steps), delta, accountant, conversion
            )
        return self._cache[key]

    def delta(self, epsilon, accountant="rdp"):
        """Smallest delta at which the releases so far are epsilon-DP."""
        epsilon = check_number("epsilon", epsilon, low=0.0, low_open=False)
        if not self._parts():
            return 0.0
        acc = _accountant(accountant)
        acc.compose(self.composed_event())
        return float(acc.get_delta(epsilon))

    def steps_within_budget(self, epsilon, delta, accountant="rdp", max_steps=10**7):
        """Largest k >= 0 with epsilon after k more steps <= `epsilon`.

        Exponential search then bisection: O(log k) accountant calls. Never
        returns a k that overshoots the budget.
        """
        epsilon = check_number("epsilon", epsilon, low=0.0)
        if self._open_event is None:
            raise ValueError("No step event is open: call begin_steps first.")
        if self.epsilon(delta, accountant, extra_steps=1) > epsilon:
            return 0
        low, high = 1, 2
        while high <= max_steps and self.epsilon(delta, accountant, extra_steps=high) <= epsilon:
            low, high = high, high * 2
        if high > max_steps:
            return max_steps if self.epsilon(delta, accountant, extra_steps=max_steps) <= epsilon else self._bisect(low, max_steps, epsilon, delta, accountant)
        return self._bisect(low, high, epsilon, delta, accountant)

    def _bisect(self, feasible, infeasible, epsilon, delta, accountant):
        while infeasible - feasible > 1:
            middle = (feasible + infeasible) // 2
            if self.epsilon(delta, accountant, extra_steps=middle) <= epsilon:
                feasible = middle
            else:
                infeasible = middle
        return feasible

    def statement(self, delta, accountant="rdp"):
        """A plain-language statement of the guarantee so far."""
        return privacy_statement(self.epsilon(delta, accountant), delta, self.steps)

    # -- persistence ---------------------------------------------------------

    def to_json(self):
        """The ledger as JSON (events, counts, and the step count now)."""
        encode = lambda pairs: [{"event": event_to_dict(e), "count": c} for e, c in pairs]
        return json.dumps(
            {
                "version": 1,
                "steps": self.steps,
                "segments": encode(self._segments),
                "records": encode(self._records),
                "open_event": event_to_dict(self._open_event) if self._open_event is not None else None,
                "open_start": self._open_start,
            }
        )

    @classmethod
    def from_json(cls, text, step_counter=None):
        """Restores a ledger; refuses corrupt or mismatched state.

        With a `step_counter` (a restored model's), the counter must not be
        below the saved ledger's closed segments: weights and ledger from
        different checkpoints would under-count.
        """
        try:
            data = json.loads(text)
            decode = lambda items: [
                (event_from_dict(item["event"]), check_count("count", item["count"], 1)) for item in items
            ]
            segments, records = decode(data["segments"]), decode(data["records"])
            open_event = event_from_dict(data["open_event"]) if data["open_event"] else None
            open_start = check_count("open_start", data["open_start"])
            saved_steps = check_count("steps", data["steps"])
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"Corrupt privacy ledger: {error}") from None
        if open_start > saved_steps:
            raise ValueError("Corrupt privacy ledger: its open segment starts after its last step.")
        ledger = cls(step_counter=step_counter)
        if step_counter is None:
            ledger._own_steps = saved_steps
        elif ledger.steps < open_start:
            raise ValueError(
                f"Mismatched checkpoint: the weights count {ledger.steps} private "
                f"steps but their privacy ledger already closed {open_start}. "
                "Refusing to load a ledger that would under-count."
            )
        ledger._segments, ledger._records = segments, records
        ledger._open_event, ledger._open_start = open_event, open_start
        return ledger

    def __repr__(self):
        return (
            f"PrivacyLedger(steps={self.steps}, segments={len(self._segments) + (self._open_event is not None)}, "
            f"records={len(self._records)})"
        )
