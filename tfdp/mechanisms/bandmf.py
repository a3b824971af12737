"""DP-BandMF's math: a banded Toeplitz strategy and its correlated noise.

Banded matrix factorization (Choquette-Choo et al. 2023, "(Amplified) Banded
Matrix Factorization", arXiv 2306.08153) releases, over n steps, the
gradients x_t plus noise w = C^{-1} z, where z_t ~ N(0, sigma^2 C_clip^2 I) are
independent draws and C is lower-triangular, Toeplitz and banded: row t of
C x is c_0 x_t + c_1 x_{t-1} + ... + c_{b-1} x_{t-b+1}. The released iterates
x + w are a function of C x + z (multiply by C) and the other way round, so
their privacy is the Gaussian mechanism's on C x: a record that takes part
in steps at least b apart touches disjoint rows of C, each time with norm
||c||_2 = 1 (`tfdp.accounting.bandmf`). With one band, c = [1] and w = z:
DP-SGD.

The noise of step t solves C w = z one row at a time:

    w_t = (z_t - c_1 w_{t-1} - ... - c_{b-1} w_{t-b+1}) / c_0,

so the optimizer keeps the last b - 1 noise vectors: memory (b - 1) times
the number of trained parameters. Replaying the noise from the seed instead
of storing it is not exact with a bounded window: C is banded but C^{-1} is
not (it is lower-triangular and dense), so w_t depends on every draw z_0 ...
z_t; an exact replay redraws all t of them (t times the work of a step's
noise at every resume).

The coefficients minimise the expected squared error of the noisy prefix
sums (the SGD iterates with a constant learning rate) over the planned n
steps, per unit of sensitivity: ||c||^2 ||A C^{-1}||_F^2 with A the
all-ones lower-triangular matrix. C^{-1} is lower-triangular Toeplitz with
first column d, the impulse response of the filter 1/c; A C^{-1} is Toeplitz
with first column D = cumsum(d), so ||A C^{-1}||_F^2 = sum_m (n - m) D_m^2,
O(n b) to evaluate with its gradient (`prefix_sum_error`).

Example:

>>> import numpy as np
>>> c = optimal_coefficients(bands=3, steps=50)
>>> bool(np.isclose(np.linalg.norm(c), 1.0)), bool(c[0] > c[1] > c[2] > 0)
(True, True)
"""

import math

import numpy as np
import scipy.optimize
import scipy.signal
import tensorflow as tf


def check_coefficients(coefficients):
    """The strategy's coefficients as a float64 array with ||c||_2 = 1.

    Args:
        coefficients: c_0, ..., c_{b-1}: a 1-D sequence of finite numbers
            with c_0 > 0 (C must be invertible).

    Returns:
        The coefficients divided by their L2 norm (so C's largest column
        norm is 1: the noise multiplier is relative to the clip norm).

    Raises:
        ValueError: for an empty or non-finite sequence, or c_0 <= 0.

    Example:

    >>> check_coefficients([3.0, 4.0])
    array([0.6, 0.8])
    """
    try:
        array = np.asarray(coefficients, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(
            "Expected `coefficients` to be a 1-D sequence of numbers. "
            f"Received: coefficients={coefficients!r}"
        ) from None
    if array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array)):
        raise ValueError(
            "Expected `coefficients` to be a non-empty 1-D sequence of finite numbers. "
            f"Received: coefficients={coefficients!r}"
        )
    if array[0] <= 0:
        raise ValueError(
            "Expected the first coefficient c_0 > 0 (the strategy matrix must be "
            f"invertible). Received: coefficients={coefficients!r}"
        )
    return array / np.linalg.norm(array)


# The inverse recurrence w_t = (z_t - sum_j c_j w_{t-j}) / c_0 carries each
# step's float32 rounding (2^-24 relative) into later noise with gain at most
# sum_m |d_m| (d the impulse response of 1 / c): up to this gain the noise
# stays within 1e-3 of C^{-1} z. The default (optimal) coefficients have
# gains near 10 (2 to 128 bands over 100 to 50,000 steps).
MAX_NOISE_GAIN = 1e4


def check_stable(coefficients, steps):
    """Refuses coefficients whose inverse recurrence is numerically unstable
    over `steps` steps: the noise gain sum_m |d_m| is not finite or above
    `MAX_NOISE_GAIN` (a tiny c_0, or roots of c(z) on or inside the unit
    circle), which trains to NaN or to noise that is not the accounted law.

    Example:

    >>> check_stable(check_coefficients([1.0, 0.5]), 1000)
    >>> check_stable(check_coefficients([1e-12, 1.0]), 1000)
    Traceback (most recent call last):
    ...
    ValueError: The DP-BandMF noise recurrence for these `coefficients` is numerically unstable ...
    """
    with np.errstate(all="ignore"):
        gain = float(np.sum(np.abs(inverse_impulse_response(coefficients, max(int(steps), 1)))))
    if not math.isfinite(gain) or gain > MAX_NOISE_GAIN:
        raise ValueError(
            "The DP-BandMF noise recurrence for these `coefficients` is numerically "
            f"unstable over the planned {int(steps)} steps: it amplifies float32 rounding by "
            f"{gain:.3g} (at most {MAX_NOISE_GAIN:.0e} keeps the noise within 1e-3 of the law "
            "the accounting assumes; a tiny c_0, or roots of c(z) on or inside the unit "
            "circle, make it grow without bound). Pass coefficients=None for the optimal "
            "ones, or coefficients whose first entry dominates. Received: "
            f"coefficients={np.asarray(coefficients).tolist()!r}"
        )


def inverse_impulse_response(coefficients, steps):
    """The first column d of C^{-1} (n x n), for C banded Toeplitz.

    Args:
        coefficients: c_0 ... c_{b-1}, c_0 != 0.
        steps: n, an int >= 1.

    Returns:
        float64 array [n]: d_0 = 1 / c_0 and sum_j c_j d_{m-j} = 0 for m > 0.

    Example:

    >>> inverse_impulse_response([1.0, 0.5], 4)
    array([ 1.   , -0.5  ,  0.25 , -0.125])
    """
    impulse = np.zeros(steps)
    impulse[0] = 1.0
    return scipy.signal.lfilter([1.0], np.asarray(coefficients, np.float64), impulse)


def prefix_sum_error(coefficients, steps):
    """Expected squared error of the n noisy prefix sums, and its gradient.

    loss(c) = ||c||^2 * ||A C^{-1}||_F^2 = ||c||^2 sum_m (n - m) D_m^2, with
    D = cumsum(d) and d the impulse response of 1/c: the total squared error
    of the iterates of SGD with a constant learning rate when the noise has
    standard deviation sigma * C_clip * ||c|| (the sensitivity of C x) per
    coordinate, in units of that noise. Scale-invariant in c.

    The gradient: perturbing c perturbs d by -(d * d) shifted (the impulse
    response of 1/c^2), so d loss / d c_j = 2 c_j f - 2 ||c||^2 sum_m (n - m)
    D_m E_{m-j}, with f = sum_m (n - m) D_m^2 and E = cumsum(d * d).

    Args:
        coefficients: c_0 ... c_{b-1}, c_0 != 0.
        steps: n, an int >= 1.

    Returns:
        (loss, gradient of the loss with respect to the coefficients).

    Example:

    >>> loss, grad = prefix_sum_error([1.0], 3)   # DP-SGD: ||A||_F^2 = 3 + 2 + 1
    >>> float(loss), grad.tolist()
    (6.0, [0.0])
    """
    c = np.asarray(coefficients, np.float64)
    n = int(steps)
    weights = n - np.arange(n, dtype=np.float64)
    d = inverse_impulse_response(c, n)
    cumulative = np.cumsum(d)
    errors = float(np.sum(weights * cumulative**2))
    squared = scipy.signal.lfilter([1.0], np.convolve(c, c), np.eye(1, n)[0])
    cumulative_squared = np.cumsum(squared)
    weighted = weights * cumulative
    # sum_m weighted_m E_{m-j} for j = 0 .. b-1.
    cross = np.array([np.dot(weighted[j:], cumulative_squared[: n - j]) for j in range(len(c))])
    norm_sq = float(np.dot(c, c))
    loss = norm_sq * errors
    grad = 2.0 * c * errors - 2.0 * norm_sq * cross
    return loss, grad


def _square_root_coefficients(bands):
    """c_k = binom(2k, k) / 4^k: the coefficients of sqrt(A), a good start."""
    k = np.arange(1, bands)
    return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])


def optimal_coefficients(bands, steps):
    """Banded Toeplitz coefficients minimising the prefix sums' error.

    Minimises `prefix_sum_error` (its logarithm, with its analytic
    gradient) by L-BFGS from the coefficients of the square root of A
    truncated to `bands` (Fichtenberger et al. 2023's factorization), and
    returns them normalised to ||c||_2 = 1. One band gives [1.0] (DP-SGD).
    The error is scale-invariant, so the start is scaled to norm 10:
    L-BFGS's first trial step has length 1, and from a unit-norm start it
    can leave the region where 1/c is stable (c(z) with a root inside the
    unit circle: the error overflows to infinity) and stop there, at the
    start.

    Args:
        bands: b, an int in [1, steps].
        steps: n, the planned number of steps, an int >= 1.

    Returns:
        float64 array [b] with ||c||_2 = 1 and c_0 > 0.

    Raises:
        ValueError: if `bands` or `steps` is out of range.

    Example:

    >>> optimal_coefficients(1, 100)
    array([1.])
    >>> c = optimal_coefficients(4, 200)
    >>> bool(prefix_sum_error(c, 200)[0] < prefix_sum_error([1.0], 200)[0])
    True
    """
    for name, value in (("bands", bands), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"Expected `{name}` to be an int >= 1. Received: {name}={value!r}")
    if bands > steps:
        raise ValueError(
            f"Expected `bands` <= `steps` ({steps}): a band longer than the run adds "
            f"nothing. Received: bands={bands}"
        )
    if bands == 1:
        return np.ones(1)
    start = check_coefficients(_square_root_coefficients(bands))

    def objective(c):
        if c[0] <= 0:
            return math.inf, np.zeros_like(c)
        with np.errstate(over="ignore", invalid="ignore"):  # unstable c: inf, refused
            loss, grad = prefix_sum_error(c, steps)
        if not math.isfinite(loss) or loss <= 0:
            return math.inf, np.zeros_like(c)
        return math.log(loss), grad / loss

    result = scipy.optimize.minimize(
        objective, 10.0 * start, jac=True, method="L-BFGS-B",
        bounds=[(1e-6, None)] + [(None, None)] * (bands - 1),
        options={"maxiter": 500, "gtol": 1e-10},
    )
    best = result.x if objective(result.x)[0] <= objective(start)[0] else start
    return check_coefficients(best)


def noise_slot_weights(coefficients, stream_step):
    """Weights of the b - 1 ring-buffer slots in step t's noise recurrence.

    The optimizer keeps w_{t-1} ... w_{t-b+1} in a ring buffer of b - 1
    slots: w_s lives in slot s mod (b - 1). Slot k then holds w_{t-j} with
    j = ((t - 1 - k) mod (b - 1)) + 1, whose weight is c_j / c_0. Before
    step b - 1 some slots hold nothing yet (zeros), so their weight does not
    matter.

    Args:
        coefficients: float tensor [b], b >= 2.
        stream_step: int64 scalar t, the stream's step (0 at its start).

    Returns:
        float32 tensor [b - 1].

    Example:

    >>> noise_slot_weights(tf.constant([1.0, 0.5, 0.25]), tf.constant(3, tf.int64)).numpy()
    array([0.5 , 0.25], dtype=float32)
    """
    coefficients = tf.cast(coefficients, tf.float32)
    slots = tf.shape(coefficients, out_type=tf.int64)[0] - 1
    lag = tf.math.floormod(stream_step - 1 - tf.range(slots, dtype=tf.int64), slots) + 1
    return tf.gather(coefficients, lag) / coefficients[0]


def correlated_noise(draw, history, coefficients, stream_step):
    """Step t's noise w_t from its fresh draw z_t and the ring buffer.

    w_t = z_t / c_0 - sum_{j=1}^{b-1} (c_j / c_0) w_{t-j}: row t of C w = z.

    Args:
        draw: float tensor z_t (N(0, sigma^2 C_clip^2) per coordinate).
        history: float tensor [b - 1, *z.shape], the ring buffer (slot s
            mod (b - 1) holds w_s; zeros before the stream's first steps),
            or None when b == 1.
        coefficients: float tensor [b] (unit norm, c_0 > 0).
        stream_step: int64 scalar t.

    Returns:
        (w_t, the ring-buffer slot w_t must be written to, or None when b == 1).

    Example:

    >>> c = tf.constant([0.8, 0.6])
    >>> w, slot = correlated_noise(tf.constant([1.6]), tf.constant([[1.0]]), c,
    ...                            tf.constant(1, tf.int64))
    >>> w.numpy(), int(slot)
    (array([1.25], dtype=float32), 0)
    """
    c0 = tf.cast(coefficients[0], draw.dtype)
    if history is None:
        return draw / c0, None
    weights = tf.cast(noise_slot_weights(coefficients, stream_step), draw.dtype)
    carried = tf.tensordot(weights, history, axes=1)
    slot = tf.math.floormod(stream_step, tf.shape(history, out_type=tf.int64)[0])
    return draw / c0 - carried, slot
