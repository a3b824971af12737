"""DPIS's math (Wei et al. 2022, seed 002) as plain functions.

DPIS samples record i with probability pi_i proportional to its clipped
gradient norm and weights it by 1/pi_i, so the noisy mean stays unbiased while
every sampled term has the same norm K~/N~ (docs/mechanisms/dpis.md):

* released once: N~ = N + N(0, sigma_N^2)                  (`noisy_count`)
* released per epoch: K~, a clamped, subsampled, noisy sum of the clipped
  norms of all records                                       (`noisy_norm_sum`,
  `clamp_norm_sum`); with adaptive clipping also K~* at the bound C*.
* per step, two stages: stage 1 draws record i with q_i = b ghat_i / K~
  (`first_stage_probabilities`, ghat from `first_stage_bounds`, capped at
  K~ / b); stage 2 accepts it with p_i = ||g_i clipped to min(ghat_i, C)|| /
  ghat_i (`second_stage`). So pi_i = q_i p_i = b ||g_i clipped|| / K~ exactly,
  and the accepted gradient is weighted by b / (N~ pi_i)
  (`importance_weights`): each term has norm exactly K~ / N~.
* the step's release is a Poisson-sampled Gaussian with rate b C / K~ and
  noise multiplier sigma_G C N~ / K~ (`step_event`); sigma_G is chosen per
  epoch from the target epsilon by projecting the privacy ledger
  (`allocate_noise_multiplier`).

Soundness fixes against the paper (docs/mechanisms/dpis.md): ghat_i <= K~ / b (else
q_i is cut at 1, pi_i falls below b ||g_i|| / K~, and the term's norm exceeds
the K~ / N~ the analysis assumes); the K release is accounted with the
sensitivity it has (C on the unscaled sum, noise sigma_K C before the 1 / p_K
scaling); sigma_N is a constant, never 0.02 N.

Example:

>>> import numpy as np
>>> ghat = first_stage_bounds(np.array([0.1, 0.5, 1.0]), k=5, floor=0.01,
...                           k_tilde=40.0, batch_size=16)
>>> ghat.numpy()                        # k * max(norm, floor), capped at K~ / b
array([0.5, 2.5, 2.5], dtype=float32)
>>> first_stage_probabilities(ghat.numpy(), k_tilde=40.0, batch_size=16)
array([0.2, 1. , 1. ], dtype=float32)
"""

import contextlib
import math
import numbers

import dp_accounting
import numpy as np
import tensorflow as tf

from tfdp import accounting
from tfdp.accounting import _engine
from tfdp.mechanisms.gaussian import numpy_normal

__all__ = [
    "noisy_count",
    "count_event",
    "norm_sum_sampling_probability",
    "noisy_norm_sum",
    "norm_sum_event",
    "clamp_norm_sum",
    "adaptive_clip",
    "first_stage_bounds",
    "first_stage_probabilities",
    "released_first_stage_size",
    "second_stage",
    "importance_weights",
    "step_event",
    "uses_worst_case",
    "allocate_noise_multiplier",
]

# The noise multipliers `allocate_noise_multiplier` searches.
SIGMA_BRACKET = (1e-3, 1e4)

# Added to every per-example squared norm before DPIS uses it, so the norm it
# weights by is never below the true one. In float32 a squared coordinate
# (or product of factors) under ~1.2e-38 underflows to 0; a squared norm sums
# far fewer than 1e17 such terms, so it loses less than 1e-20. A norm below
# 1e-10 is then taken as 1e-10: its record's acceptance probability
# ||g|| / ghat is negligible anyway (ghat >= k g_L).
SQ_NORM_UNDERFLOW_ALLOWANCE = 1e-20


def _check_real(name, value, low=None, low_inclusive=False, high=None, high_inclusive=True):
    """`float(value)` if it is a finite real number in range (Keras-style errors)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.number)):
        raise TypeError(f"Expected `{name}` to be a number. Received: {name}={value!r}")
    number = float(value)
    ok = math.isfinite(number)
    if ok and low is not None:
        ok = number >= low if low_inclusive else number > low
    if ok and high is not None:
        ok = number <= high if high_inclusive else number < high
    if not ok:
        parts = []
        if low is not None:
            parts.append(f"{'>=' if low_inclusive else '>'} {low:g}")
        if high is not None:
            parts.append(f"{'<=' if high_inclusive else '<'} {high:g}")
        bound = " and ".join(parts) if parts else "finite"
        raise ValueError(
            f"Expected `{name}` to be a finite number {bound}. Received: {name}={value!r}"
        )
    return number


# -- releases: N~, K~, K~* -----------------------------------------------------


def noisy_count(num_examples, sigma_n, rng):
    """N~ = N + N(0, sigma_N^2): the dataset size, released once.

    Args:
        num_examples: N, an integer >= 1.
        sigma_n: the noise's standard deviation, a constant > 0 (never a
            function of the private N; use 0.02 times a public estimate of N
            for the paper's setting).
        rng: a `numpy.random.Generator`.

    Returns:
        N~ as a float. Its release is `count_event(sigma_n)`.
    """
    sigma_n = _check_real("sigma_n", sigma_n, low=0.0)
    return float(num_examples) + numpy_normal(rng, sigma_n)


def count_event(sigma_n):
    """The release of N~: a Gaussian mechanism of sensitivity 1."""
    return dp_accounting.GaussianDpEvent(_check_real("sigma_n", sigma_n, low=0.0))


def norm_sum_sampling_probability(batch_size, n_tilde):
    """p_K = min(1, b / N~): the Poisson rate of the K~ release's sample."""
    batch_size = _check_real("batch_size", batch_size, low=0.0)
    n_tilde = _check_real("n_tilde", n_tilde, low=0.0)
    return min(1.0, batch_size / n_tilde)


def noisy_norm_sum(clipped_norms, clip, sigma_k, sampling_probability, rng):
    """K' = (sum of a Poisson sample of clipped norms + N(0, (sigma_K C)^2)) / p_K.

    Each record joins the sample independently with probability p_K; the
    unscaled sum has sensitivity C (one record adds at most one clipped norm),
    so the release is `norm_sum_event(sigma_k, p_K)`. Dividing by p_K is
    post-processing.

    Args:
        clipped_norms: array [N] of per-record gradient norms clipped to
            `clip` (0 for a record whose gradient was not finite).
        clip: the clip bound C > 0 (the release's sensitivity).
        sigma_k: the noise multiplier > 0 on the unscaled sum.
        sampling_probability: p_K in (0, 1].
        rng: a `numpy.random.Generator`.

    Returns:
        K' as a float (an unbiased estimate of sum_i clipped_norms_i).
    """
    clip = _check_real("clip", clip, low=0.0)
    sigma_k = _check_real("sigma_k", sigma_k, low=0.0)
    p = _check_real("sampling_probability", sampling_probability, low=0.0, high=1.0)
    norms = np.minimum(np.asarray(clipped_norms, np.float64), clip)
    sampled = rng.random(norms.shape[0]) < p
    total = float(np.sum(norms[sampled])) + numpy_normal(rng, sigma_k * clip)
    return total / p


def norm_sum_event(sigma_k, sampling_probability):
    """The release of one K~ (or K~*): Poisson-sampled Gaussian, sensitivity C."""
    return accounting.dpsgd_event(
        _check_real("sigma_k", sigma_k, low=0.0), sampling_probability
    )


def clamp_norm_sum(k_prime, batch_size, clip, n_tilde, xi=None):
    """K~ = min(max(K', b C + xi), N~ C) (the paper's Equation 12).

    The floor keeps every record's inclusion probability b C / K~ below 1
    (privacy amplification needs it); the ceiling is the largest possible
    sum of N~ clipped norms.

    Args:
        k_prime: the noisy estimate K'.
        batch_size: the expected batch size b.
        clip: the clip bound C > 0.
        n_tilde: the released N~.
        xi: the floor's margin > 0 (default C, so K~ >= (b + 1) C).

    Returns:
        K~ as a float.

    Raises:
        ValueError: if the floor is not below the ceiling (b + xi / C >= N~:
            the batch is as large as the noisy dataset), or xi <= 0.

    Example:

    >>> clamp_norm_sum(5.0, batch_size=10, clip=1.0, n_tilde=100.0)
    11.0
    >>> clamp_norm_sum(1e9, batch_size=10, clip=1.0, n_tilde=100.0)
    100.0
    """
    k_prime = _check_real("k_prime", k_prime)
    batch_size = _check_real("batch_size", batch_size, low=0.0)
    clip = _check_real("clip", clip, low=0.0)
    n_tilde = _check_real("n_tilde", n_tilde)
    xi = clip if xi is None else _check_real("xi", xi, low=0.0)
    floor, ceiling = batch_size * clip + xi, n_tilde * clip
    if not floor < ceiling:
        raise ValueError(
            f"The K~ floor b*C + xi = {floor:g} is not below its ceiling N~*C = "
            f"{ceiling:g} (b={batch_size:g}, C={clip:g}, xi={xi:g}, N~={n_tilde:g}): "
            "the expected batch is as large as the (noisy) dataset, so importance "
            "sampling has no room. Use a smaller batch_size. Received: "
            f"batch_size={batch_size:g}"
        )
    return min(max(k_prime, floor), ceiling)


def adaptive_clip(k_star_tilde, n_tilde, quantile, external_clip, minimum):
    """C_{e+1} = lambda K~*_e / N~ (section 3.5), kept in [minimum, lambda C*].

    K~*_e is the released sum of norms clipped at the external bound C*, so
    K~*_e / N~ estimates the mean clipped norm; noise can push it outside
    [0, C*], hence the clamp.
    """
    quantile = _check_real("clip_quantile", quantile, low=0.0)
    external_clip = _check_real("external_clip", external_clip, low=0.0)
    value = quantile * float(k_star_tilde) / float(n_tilde)
    return float(min(max(value, minimum), quantile * external_clip))


# -- sampling -------------------------------------------------------------------


def first_stage_bounds(clipped_norms, k, floor, k_tilde, batch_size):
    """ghat_i = min(k max(||g_i clipped||, g_L), K~ / b).

    The cap at K~ / b is tfdp's fix (docs/mechanisms/dpis.md): it keeps the stage-1
    probability b ghat_i / K~ <= 1, so the inclusion probability is exactly
    b ||g_i clipped|| / K~. A non-finite norm gets the cap.

    Args:
        clipped_norms: float tensor or array [B] of clipped norms.
        k: the probability multiplier k > 1.
        floor: the lower bound g_L > 0 on a norm.
        k_tilde: the released K~.
        batch_size: the expected batch size b.

    Returns:
        float32 tensor [B].
    """
    norms = tf.cast(clipped_norms, tf.float32)
    cap = tf.cast(k_tilde, tf.float32) / tf.cast(batch_size, tf.float32)
    bounds = tf.cast(k, tf.float32) * tf.maximum(norms, tf.cast(floor, tf.float32))
    bounds = tf.where(tf.math.is_finite(norms), bounds, cap)
    return tf.minimum(bounds, cap)


def first_stage_probabilities(ghat, k_tilde, batch_size):
    """q_i = b ghat_i / K~, clipped to [0, 1] (NumPy; the sampler draws with it).

    With ghat from `first_stage_bounds` the clip never binds (up to rounding).
    """
    ghat = np.asarray(ghat, np.float32)
    scale = np.float32(float(batch_size) / float(k_tilde))
    return np.clip(ghat * scale, 0.0, 1.0).astype(np.float32)


def released_first_stage_size(k, floor, k_tilde, n_tilde, batch_size):
    """An upper estimate of the stage-1 size sum_i q_i from released values.

    sum_i q_i = (b / K~) sum_i ghat_i, and ghat_i <= k (||g_i clipped|| + g_L),
    so with K~ standing for the sum of clipped norms and N~ for N it is about
    at most k b (1 + N~ g_L / K~), and at most N~. DPIS sizes its padded
    batches with this: the ghat table (raw gradient norms) and N are
    private, and the padded length is observable. A draw longer than the
    padding is never truncated, so a low estimate costs only speed.

    Args:
        k: the probability multiplier k.
        floor: the norm floor g_L.
        k_tilde, n_tilde: the released K~ and N~.
        batch_size: the expected batch size b.

    Returns:
        The estimate, a float > 0.

    Example:

    >>> released_first_stage_size(k=5, floor=0.01, k_tilde=40.0, n_tilde=1000.0, batch_size=50)
    312.5
    """
    k = _check_real("k", k, low=0.0)
    floor = _check_real("floor", floor, low=0.0, low_inclusive=True)
    k_tilde = _check_real("k_tilde", k_tilde, low=0.0)
    n_tilde = _check_real("n_tilde", n_tilde, low=0.0)
    batch_size = _check_real("batch_size", batch_size, low=0.0)
    return min(n_tilde, k * batch_size * (1.0 + n_tilde * floor / k_tilde))


def second_stage(sq_norms, ghat, clip, uniform, mask):
    """Stage 2: clip g_i to min(ghat_i, C), accept with p_i = ||clipped|| / ghat_i.

    The norm is sqrt(sq_norm + SQ_NORM_UNDERFLOW_ALLOWANCE): float32 squares
    of tiny coordinates underflow to 0, and a norm below the true one would
    give the record's weighted term a norm above K~ / N~ (a gradient with
    one coordinate at 1e-18 and ten thousand at 3e-20 had a computed norm of
    a third of its true one). The allowance makes it an over-estimate, which
    keeps every term at or below K~ / N~.

    Args:
        sq_norms: float tensor [B], squared norms of the current per-example
            gradients (of the records stage 1 drew).
        ghat: float tensor [B], the ghat_i stage 1 used.
        clip: the epoch's clip bound C_e.
        uniform: float tensor [B] of U[0, 1) draws.
        mask: float tensor [B], 0 on padding rows.

    Returns:
        dict of [B] tensors: "norms" (the over-estimates above; 1e-10 where
        not finite), "clipped_norms",
        "probability" p_i, "accepted" (bool), "finite" (bool).
    """
    sq_norms = tf.convert_to_tensor(sq_norms, tf.float32)
    ghat = tf.cast(ghat, tf.float32)
    finite = tf.math.is_finite(sq_norms)
    safe = tf.where(finite, tf.maximum(sq_norms, 0.0), tf.zeros_like(sq_norms))
    norms = tf.sqrt(safe + SQ_NORM_UNDERFLOW_ALLOWANCE)
    bound = tf.minimum(ghat, tf.cast(clip, tf.float32))
    clipped = tf.minimum(norms, bound)
    probability = tf.minimum(tf.math.divide_no_nan(clipped, ghat), 1.0)
    accepted = (
        (tf.cast(mask, tf.float32) > 0.0)
        & finite
        & (safe > 0.0)  # a zero gradient adds nothing: never accepted
        & (tf.cast(uniform, tf.float32) < probability)
    )
    return {
        "norms": norms,
        "clipped_norms": clipped,
        "probability": probability,
        "accepted": accepted,
        "finite": finite,
    }


def importance_weights(norms, accepted, k_tilde, n_tilde):
    """Per-example factors that turn raw gradients into the weighted clipped terms.

    An accepted term is (b / (N~ pi_i)) * clip(g_i) with pi_i = b ||clip(g_i)|| / K~
    and clip(g_i) = g_i ||clip(g_i)|| / ||g_i||, i.e. K~ / (N~ ||g_i||) * g_i:
    its norm is exactly K~ / N~. Rejected rows get 0.

    Args:
        norms: float tensor [B] of raw gradient norms.
        accepted: bool tensor [B].
        k_tilde, n_tilde: the released K~ and N~.

    Returns:
        float32 tensor [B].
    """
    norms = tf.cast(norms, tf.float32)
    keep = accepted & (norms > 0.0)
    scale = tf.cast(k_tilde, tf.float32) / tf.cast(n_tilde, tf.float32)
    return tf.where(keep, scale / tf.where(keep, norms, tf.ones_like(norms)), tf.zeros_like(norms))


# -- accounting -----------------------------------------------------------------


def step_event(noise_multiplier, clip, k_tilde, n_tilde, batch_size):
    """One DPIS step's release (Lemma 3.1, as a Poisson-sampled Gaussian).

    Every record's inclusion probability is at most q' = b C / K~ and its
    weighted term has norm K~ / N~ against noise of standard deviation
    sigma_G C, so the step is `dpsgd_event(sigma_G C N~ / K~, q')`. With
    K~ = N~ C it is DP-SGD's event `dpsgd_event(sigma_G, b / N~)`.

    Args:
        noise_multiplier: sigma_G > 0 (noise std sigma_G C on the sum).
        clip: the clip bound C_e.
        k_tilde: the epoch's K~ (>= b C after `clamp_norm_sum`).
        n_tilde: the released N~.
        batch_size: the expected batch size b.
    """
    sigma = _check_real("noise_multiplier", noise_multiplier, low=0.0)
    clip = _check_real("clip", clip, low=0.0)
    k_tilde = _check_real("k_tilde", k_tilde, low=0.0)
    n_tilde = _check_real("n_tilde", n_tilde, low=0.0)
    batch_size = _check_real("batch_size", batch_size, low=0.0)
    records = k_tilde / clip  # K~ / C: DPIS's stand-in for DP-SGD's N~
    q = batch_size / records
    if q > 1.0:
        raise ValueError(
            f"Expected K~ >= b*C so that the inclusion probability b*C/K~ <= 1. "
            f"Received: k_tilde={k_tilde:g} with batch_size={batch_size:g}, clip={clip:g}"
        )
    return accounting.dpsgd_event(sigma * n_tilde / records, q)


def uses_worst_case(epoch, epochs, epoch_divider):
    """True while `epoch` (0-based) is in the first a_E * E epochs (section 4.2)."""
    return epoch < epoch_divider * epochs


def _projected_epsilon(base_json, delta, accountant, releases):
    copy = accounting.PrivacyLedger.from_json(base_json)
    for event, count in releases:
        if count > 0:
            copy.record(event, count=count)
    return copy.epsilon(delta, accountant=accountant)


def allocate_noise_multiplier(
    ledger,
    target_epsilon,
    delta,
    *,
    batch_size,
    clip,
    n_tilde,
    k_tilde,
    steps_per_epoch,
    epochs_left,
    future_k_tilde=None,
    epoch_events=(),
    accountant="rdp",
    max_noise_multiplier=None,
    tolerance=1e-3,
):
    """The smallest sigma_G whose projected total epsilon stays within the target.

    The projection (section 4.2) is the ledger's spending so far plus this
    epoch's `steps_per_epoch` steps at the current K~, plus, for each of the
    `epochs_left - 1` later epochs, its per-epoch releases (`epoch_events`,
    the K~ release and with adaptive clipping the K~* one) and its steps at
    `future_k_tilde` (N~ C in the worst-case phase, the current K~ after).
    The ledger is read, never changed. Bisection in log(sigma) keeps the
    feasible end, so the result never overshoots the target.

    Args:
        ledger: the run's `tfdp.accounting.PrivacyLedger` (with this epoch's
            K~ release already recorded).
        target_epsilon: the run's total budget.
        delta: its delta.
        batch_size, clip, n_tilde, k_tilde: b, C_e, N~ and this epoch's K~.
        steps_per_epoch: T.
        epochs_left: epochs from this one to the last, >= 1.
        future_k_tilde: K~ assumed for later epochs (default `k_tilde`).
        epoch_events: DpEvents released once per later epoch.
        accountant: "rdp" or "pld".
        max_noise_multiplier: optional upper end; if it already fits, the
            result is at most it (the previous epoch's sigma_G, which keeps
            the schedule non-increasing whenever K~ does not grow).
        tolerance: relative precision of the bisection.

    Returns:
        `(sigma_G, projected_epsilon)`.

    Raises:
        ValueError: if even sigma_G = 1e4 exceeds the target (the releases so
            far and the remaining K~ releases already spend it), or if
            `accountant` is "pld" and `delta` is below 1e-12 (use "rdp").
    """
    target = _check_real("target_epsilon", target_epsilon, low=0.0)
    steps = int(steps_per_epoch)
    left = int(epochs_left)
    if left < 1:
        raise ValueError(f"Expected `epochs_left` >= 1. Received: epochs_left={epochs_left}")
    if accountant == "pld":  # before the search, which reads its ValueErrors as epsilon inf
        _engine.check_pld_delta(delta)
    future = k_tilde if future_k_tilde is None else future_k_tilde
    base = ledger.to_json()
    def projected(sigma):
        releases = [(step_event(sigma, clip, k_tilde, n_tilde, batch_size), steps)]
        releases += [(event, left - 1) for event in epoch_events]
        releases.append(
            (step_event(sigma, clip, future, n_tilde, batch_size), steps * (left - 1))
        )
        try:
            return _projected_epsilon(base, delta, accountant, releases)
        except ValueError:
            if accountant != "pld":
                raise
            return math.inf  # noise too small for a PLD grid: far over any budget

    with _quiet_accountant():
        return _bisect(projected, target, left, delta, max_noise_multiplier, tolerance)


@contextlib.contextmanager
def _quiet_accountant():
    """Silences dp_accounting's convergence warnings while the bisection probes
    small sigmas (an order it drops only loosens, never breaks, the bound)."""
    from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel

    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(level)


def _bisect(projected, target, left, delta, start, tolerance):
    """Smallest feasible sigma (to `tolerance`), searching outwards from `start`.

    `projected(sigma)` decreases in sigma. The returned sigma is feasible
    (projected <= target), and never above `start` when `start` is feasible.
    """
    floor, ceiling = SIGMA_BRACKET
    memo = {}

    def projected_once(sigma):
        if sigma not in memo:
            memo[sigma] = projected(sigma)
        return memo[sigma]

    start = 1.0 if start is None or not floor < start < ceiling else float(start)
    if projected_once(start) <= target:
        high, low = start, start / 2.0
        while projected_once(low) <= target:
            if low <= floor:
                return low, memo[low]
            high, low = low, low / 2.0
        high_value = memo[high]
    else:
        low, high = start, start * 2.0
        while True:
            high_value = projected_once(high)
            if high_value <= target:
                break
            if high >= ceiling:
                raise ValueError(
                    f"target_epsilon={target:g} cannot be met: with sigma_G={high:g} the "
                    f"releases so far and those planned for the {left} remaining epoch(s) "
                    f"already spend epsilon={high_value:.4g} (delta={delta}). Plan fewer "
                    "epochs or a larger target_epsilon."
                )
            low, high = high, high * 2.0
    # Illinois false position on log(epsilon) against log(sigma), which is
    # nearly linear, so a few steps suffice; bisection whenever it stalls.
    # The bracket [low infeasible, high feasible] only shrinks.
    def gap(value):
        return math.log(value / target) if 0 < value < math.inf else (math.inf if value > 0 else -math.inf)

    f_low, f_high = gap(memo.get(low, math.inf)), gap(high_value)
    side = 0
    while high / low > 1.0 + tolerance and high_value < (1.0 - tolerance) * target:
        x_low, x_high = math.log(low), math.log(high)
        if math.isfinite(f_low) and math.isfinite(f_high) and f_low > f_high:
            x = (x_low * f_high - x_high * f_low) / (f_high - f_low)
            x = min(max(x, x_low + 0.01 * (x_high - x_low)), x_high - 0.01 * (x_high - x_low))
        else:
            x = 0.5 * (x_low + x_high)
        middle = math.exp(x)
        value = projected_once(middle)
        if value <= target:
            high, high_value, f_high = middle, value, gap(value)
            if side == 1:
                f_low /= 2.0
            side = 1
        else:
            low, f_low = middle, gap(value)
            if side == -1:
                f_high /= 2.0
            side = -1
    return high, high_value
