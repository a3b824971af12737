"""Epsilon and delta of a list of (event, count) releases, via dp_accounting.

The one place tfdp turns DpEvents into numbers. `parts` is always a sequence
of `(event, count)` pairs with integer counts >= 1, meaning
`ComposedDpEvent([SelfComposedDpEvent(event, count), ...])`.

RDP: dp_accounting's `RdpAccountant` adds `count * RDP(event)` per composed
event. The RDP vector of each distinct event is computed once and cached, so a
ledger with many segments, a budget search or a calibration costs one
accountant call per distinct event; the sum and the conversion then run
exactly the operations `RdpAccountant` runs, giving bit-identical epsilons.

PLD: dp_accounting's `PLDAccountant` on the composed event.

For large sampling rates (q above about 0.06 at sigma near 1) dp_accounting
cannot sum the series of some fractional orders (1.1, 1.2, ...) and logs
"_compute_log_a_frac failed to converge ... Excluding this order" once per
order; the order then gets infinite RDP, which is a valid (unused) bound, and
the other orders give epsilon. tfdp drops exactly that warning while it
composes, so epsilon is dp_accounting's, bit for bit, and training logs stay
readable.

Example:

>>> from tfdp.accounting.events import dpsgd_event
>>> round(epsilon([(dpsgd_event(1.3, 0.0025), 6000)], 1e-5), 6)
0.724223
"""

import contextlib
import functools
import logging
import math
import threading

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as _pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_lib

from tfdp.accounting._huge_noise import cap_noise
from tfdp.accounting.joint_gaussian import as_one_gaussian
from tfdp.accounting._validation import show

ACCOUNTANTS = ("rdp", "pld")
CONVERSIONS = ("tight", "classic")

# dp_accounting's default orders (what RdpAccountant() uses).
RDP_ORDERS = tuple(float(a) for a in _rdp_lib.DEFAULT_RDP_ORDERS)
# The papers' conversion: integer orders 2..64 (Abadi et al. 2016, Mironov 2017).
CLASSIC_ORDERS = tuple(float(a) for a in range(2, 65))

# PLD discretization. 1e-4 is dp_accounting's default and is used whenever the
# noise allows; the interval grows as 1e-4 / s^2 for an effective Gaussian
# noise s < 1 (see `pld_discretization`). The PLD grid then keeps the same
# size relative to the privacy loss, so the cost stays bounded (at 1e-4 a
# single q=0.01, sigma=0.05 step takes 35 s and sigma=0.01 runs out of
# memory). The pessimistic discretization keeps the result an upper bound.
PLD_BASE_INTERVAL = 1e-4
# Below this effective noise the PLD grid cannot be built (float overflow);
# such settings have astronomically large epsilon anyway.
PLD_MIN_NOISE = 1e-3
# Below this delta the PLD's answer is not trustworthy: its tails are
# truncated near mass e^-50 and its sums run in float64, so a smaller delta
# returned the same epsilon for 1e-30, 1e-100 and 1e-300 (epsilon must grow
# as delta shrinks). Such deltas are refused; RDP (an upper bound) answers them.
PLD_MIN_DELTA = 1e-12
# PLD composition cost grows with the number of composed steps (10^6 steps
# of q=0.5, sigma=100 take ~8 s, 10^7 take ~150 s); beyond this, use RDP.
PLD_MAX_COUNT = 10**6


# The one dp_accounting warning tfdp silences (see the module docstring).
UNCONVERGED_ORDER_WARNING = "_compute_log_a_frac failed to converge"


class _UnconvergedOrderFilter(logging.Filter):
    """Drops dp_accounting's unconverged-order warning inside tfdp's own calls only."""

    def __init__(self):
        super().__init__()
        self.active = threading.local()

    def filter(self, record):
        if not getattr(self.active, "depth", 0):
            return True
        return not str(record.msg).startswith(UNCONVERGED_ORDER_WARNING)


_UNCONVERGED_FILTER = _UnconvergedOrderFilter()
logging.getLogger("absl").addFilter(_UNCONVERGED_FILTER)  # inert outside tfdp's calls


@contextlib.contextmanager
def _quiet_unconverged_orders():
    active = _UNCONVERGED_FILTER.active
    active.depth = getattr(active, "depth", 0) + 1
    try:
        yield
    finally:
        active.depth -= 1


class PLDUnavailable(ValueError):
    """The PLD accountant cannot (or cannot affordably) represent these releases."""


def _rdp_of(accountant):
    """The composed RDP vector of a dp_accounting `RdpAccountant`.

    dp_accounting keeps it in the private attribute `_rdp` and has no public
    getter; this is the one place tfdp reads it. A test pins it against the
    closed form of the Gaussian mechanism (order a: a / (2 sigma^2)).
    """
    return np.array(accountant._rdp, dtype=np.float64)  # pylint: disable=protected-access


def _unsupported(accountant_name, event, error):
    return ValueError(
        f"The {accountant_name.upper()} accountant cannot account for this event: {error} "
        f"Received: event={show(event)}"
    )


def _compute_rdp_vector(event, orders):
    accountant = dp_accounting.rdp.RdpAccountant(orders=list(orders))
    try:
        with _quiet_unconverged_orders():
            accountant.compose(event)
    except dp_accounting.UnsupportedEventError as error:
        raise _unsupported("rdp", event, error) from None
    except (OverflowError, ZeroDivisionError, FloatingPointError):
        # Extreme parameters (a noise multiplier near 1e308 or 1e-300) overflow
        # dp_accounting's float arithmetic: infinite RDP is always a valid bound.
        vector = np.full(len(orders), np.inf)
        vector.setflags(write=False)
        return vector
    vector = _rdp_of(accountant)
    vector.setflags(write=False)
    return vector


@functools.lru_cache(maxsize=4096)
def _cached_rdp_vector(event, orders):
    return _compute_rdp_vector(event, orders)


def rdp_vector(event, orders=RDP_ORDERS):
    """RDP of one `event` at `orders` (read-only array; cached per event)."""
    event = cap_noise(as_one_gaussian(event))
    try:
        hash(event)
    except TypeError:  # e.g. a ComposedDpEvent holds a list
        return _compute_rdp_vector(event, tuple(orders))
    return _cached_rdp_vector(event, tuple(orders))


def total_rdp(parts, orders=RDP_ORDERS):
    """sum(count * RDP(event)), in the order RdpAccountant would add them."""
    rdp = np.zeros(len(orders), dtype=np.float64)
    for event, count in parts:
        rdp += count * rdp_vector(event, orders)
    return rdp


def classic_epsilon_from_rdp(rdp, delta, orders=CLASSIC_ORDERS):
    """eps = min over orders of rdp + log(1/delta) / (order - 1).

    The conversion of Abadi et al. (2016) / Mironov (2017) the papers use.
    Looser than dp_accounting's; tfdp uses it only to reproduce papers.
    """
    orders = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        values = rdp + math.log(1.0 / delta) / (orders - 1.0)
    values = np.where(np.isnan(values), np.inf, values)
    return float(np.min(values))


def pld_discretization(parts):
    """Value discretization interval for a PLD of these releases.

    1e-4 (dp_accounting's default) unless some Gaussian noise is small: an
    effective Gaussian standard deviation s < 1 (for `GaussianDpEvent` under
    `SelfComposedDpEvent` counts, s = sigma / sqrt(count), because
    PLDAccountant folds the count into the noise) gives 1e-4 / s^2; a Laplace
    parameter b < 1 gives 1e-4 / b.

    Raises:
        PLDUnavailable: if s < 1e-3, or more than 10^6 releases are
            composed (use the RDP accountant instead).
    """
    interval = PLD_BASE_INTERVAL
    smallest = math.inf

    def gaussian(s):
        nonlocal interval, smallest
        if s > 0:
            smallest = min(smallest, s)
            interval = max(interval, PLD_BASE_INTERVAL / min(1.0, s) ** 2)

    def laplace(b):
        nonlocal interval
        if b > 0:
            interval = max(interval, PLD_BASE_INTERVAL / min(1.0, b))

    def walk(event, multiplicity):
        if isinstance(event, dp_accounting.SelfComposedDpEvent):
            walk(event.event, multiplicity * event.count)
        elif isinstance(event, dp_accounting.ComposedDpEvent):
            for inner in event.events:
                walk(inner, multiplicity)
        elif isinstance(event, dp_accounting.GaussianDpEvent):
            gaussian(event.noise_multiplier / math.sqrt(multiplicity))
        elif isinstance(event, dp_accounting.PoissonSampledDpEvent):
            inner = event.event
            if isinstance(inner, dp_accounting.GaussianDpEvent):
                gaussian(inner.noise_multiplier)
            elif isinstance(inner, dp_accounting.LaplaceDpEvent):
                laplace(inner.noise_multiplier)
        elif isinstance(event, dp_accounting.TruncatedSubsampledGaussianDpEvent):
            gaussian(event.noise_multiplier)
        elif isinstance(event, dp_accounting.LaplaceDpEvent):
            laplace(event.noise_multiplier)

    total = 0
    for event, count in parts:
        walk(event, count)
        total += count
    if total > PLD_MAX_COUNT:
        raise PLDUnavailable(
            f"Too many releases for the PLD accountant ({total} > {PLD_MAX_COUNT}; its "
            "cost grows with the count). Use accountant='rdp'."
        )
    if smallest < PLD_MIN_NOISE:
        raise PLDUnavailable(
            f"The noise is too small for the PLD accountant (effective Gaussian noise "
            f"{smallest:.3g} < {PLD_MIN_NOISE:g}; epsilon is astronomically large). "
            "Use accountant='rdp'."
        )
    return interval


def composed(parts):
    """The dp_accounting event of `parts`."""
    return dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(event, count) for event, count in parts]
    )


@functools.lru_cache(maxsize=32)
def _poisson_gaussian_pld(sigma, q, interval):
    """PLD of one Poisson-sampled Gaussian step, built as PLDAccountant builds it."""
    return _pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma,
        value_discretization_interval=interval,
        sampling_prob=q,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )


def _is_dpsgd_step(event):
    return (
        isinstance(event, dp_accounting.PoissonSampledDpEvent)
        and isinstance(event.event, dp_accounting.GaussianDpEvent)
        and 0 < event.sampling_probability <= 1
        and 0 < event.event.noise_multiplier < math.inf
    )


class _ComposedPLD:
    """The fast path's stand-in for a PLDAccountant (same two queries)."""

    def __init__(self, pld):
        self._pld = pld

    def get_epsilon(self, target_delta):
        return self._pld.get_epsilon_for_delta(target_delta)

    def get_delta(self, target_epsilon):
        return self._pld.get_delta_for_epsilon(target_epsilon)


def _pld_accountant(parts):
    """A PLD accountant that has composed `parts` (PLDUnavailable on overflow)."""
    try:
        return _build_pld_accountant(parts)
    except (OverflowError, ZeroDivisionError, FloatingPointError) as error:
        raise PLDUnavailable(
            f"The PLD accountant overflows on these releases ({error}); use accountant='rdp'."
        ) from None


def _build_pld_accountant(parts):
    """A PLD accountant that has composed `parts`.

    When every part is a DP-SGD step event (Poisson-sampled Gaussian), the
    single-step PLD is built once per (sigma, q, interval) and cached (building
    it is ~2/3 of a call), then self-composed and composed in the order and
    with the arguments dp_accounting's PLDAccountant uses, so the result is
    the same. Anything else goes through PLDAccountant itself.
    """
    parts = [(cap_noise(as_one_gaussian(event)), count) for event, count in parts]
    interval = pld_discretization(parts)
    if all(_is_dpsgd_step(event) for event, _ in parts):
        pld = _pld_lib.identity(value_discretization_interval=interval)
        for event, count in parts:
            step = _poisson_gaussian_pld(
                float(event.event.noise_multiplier), float(event.sampling_probability), interval
            )
            pld = pld.compose(step.self_compose(count))
        return _ComposedPLD(pld)
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
    event = composed(parts)
    try:
        accountant.compose(event)
    except dp_accounting.UnsupportedEventError as error:
        raise _unsupported("pld", event, error) from None
    return accountant


def _finite_or_inf(value):
    value = float(value)
    return math.inf if math.isnan(value) else max(0.0, value)


def epsilon(parts, delta, accountant="rdp", conversion="tight"):
    """Epsilon at `delta` of the composition of `parts` (0.0 if empty).

    Arguments are assumed validated. NaN from the accountant (extreme
    parameters) is reported as inf, which is always a valid bound.
    """
    parts = [(event, count) for event, count in parts if count > 0]
    if not parts:
        return 0.0
    if conversion == "classic":
        return _finite_or_inf(classic_epsilon_from_rdp(total_rdp(parts, CLASSIC_ORDERS), delta))
    if accountant == "rdp":
        with np.errstate(over="ignore", invalid="ignore"):  # extreme RDP: inf is fine
            value, _ = _rdp_lib.compute_epsilon(RDP_ORDERS, total_rdp(parts), delta)
        return _finite_or_inf(value)
    check_pld_delta(delta)
    return _finite_or_inf(_pld_accountant(parts).get_epsilon(delta))


def check_pld_delta(delta):
    """Refuses a delta below what the PLD accountant resolves (PLD_MIN_DELTA)."""
    if delta < PLD_MIN_DELTA:
        raise ValueError(
            f"The PLD accountant cannot resolve delta below {PLD_MIN_DELTA:g} (its "
            "tails are truncated and summed in float64, so its epsilon would be too "
            f"small); use accountant='rdp' for such a delta. Received: delta={delta:g}"
        )


def delta(parts, epsilon_value, accountant="rdp"):
    """Smallest delta for which `parts` are (epsilon, delta)-DP (0.0 if empty)."""
    parts = [(event, count) for event, count in parts if count > 0]
    if not parts:
        return 0.0
    if accountant == "rdp":
        with np.errstate(over="ignore", invalid="ignore"):  # extreme RDP: inf is fine
            value, _ = _rdp_lib.compute_delta(RDP_ORDERS, total_rdp(parts), epsilon_value)
    else:
        value = _pld_accountant(parts).get_delta(epsilon_value)
    value = float(value)
    return 1.0 if math.isnan(value) else min(1.0, max(0.0, value))
