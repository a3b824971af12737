"""AdaDP's adaptive noise (Xu et al., seed 004, Algorithm 1) as TF functions.

AdaDP keeps, per parameter coordinate j, a statistic s_j of squared
gradients that sets the SHAPE of its per-coordinate clip bounds
(docs/mechanisms/adadp.md). s is post-processing of released or
public values only: the EMA of squared NOISY gradients

    s_j <- gamma' s_j + (1 - gamma') g~_j^2

(the paper's line 23 reads the raw gradient, an unaccounted release), or the
mean squared per-example gradient on a data set the user declares public
(`public_second_moments`).

While the spread Var_j(sqrt(s_j)) <= G (warm-up) a step is plain DP-SGD.
Afterwards the bounds are

    c_j = beta * C * sqrt(s'_j / sum_k s'_k),   s'_j = max(s_j, f * mean(s))

so s sets their shape and beta * C their scale: sum_j c_j^2 = beta^2 C^2
exactly, whatever the scale of s (`clip_bounds`; the floor f =
`RELATIVE_FLOOR` keeps every bound > 0, and the sum is taken over the
floored s', so flooring renormalises the other bounds slightly instead of
breaking the equality). Every per-example gradient is clipped to the
ellipsoid sum_j g_j^2 / (d c_j^2) <= 1 ("whitened_l2", the default) or to
the box [-c_j, c_j] ("coordinate", the paper's), and the sum gets noise
N(0, sigma_j^2) with sigma_j = sigma* * sqrt(d) * c_j (d = number of
parameters). Why that is private: dividing coordinate j by sqrt(d) * c_j
("whitening") maps every clipped per-example gradient into the L2 ball of
radius 1 and the noise to N(0, sigma*^2 I). In the whitened space the step
is DP-SGD with clip 1 and noise multiplier sigma*; un-whitening is
post-processing with a scale that depends only on released or public values.
So the step's dp_accounting event is DP-SGD's,
PoissonSampledDpEvent(q, GaussianDpEvent(sigma*)).

With a uniform s, c_j = beta C / sqrt(d): "whitened_l2" is then exactly
DP-SGD with clip beta * C (the ball of radius beta C, noise sigma* beta C),
so AdaDP differs from DP-SGD only through the shape it learns; "coordinate"
is the box inscribed in that ball.

The end of this module reproduces the paper's Theorem 1 accounting (the
Wang-Balle-Kasiviswanathan bound with the classic RDP conversion). It is not
tfdp's guarantee; see `paper_theorem1_epsilon`.

Example:

>>> import tensorflow as tf
>>> s = [tf.constant([3.0, 1.0])]
>>> [b.numpy() for b in clip_bounds(s, local_clip_factor=1.0, l2_norm_clip=2.0)][0]
array([1.7320508, 1.       ], dtype=float32)
"""

import functools
import math

import tensorflow as tf

from tfdp.mechanisms import dpsgd

LOCAL_CLIPPING_MODES = ("whitened_l2", "coordinate")

# Floor on s_j when it sets a clip bound: a fraction of the mean of s (scale
# free), plus an absolute minimum for an all-zero s (which gives uniform
# bounds). A coordinate at the floor keeps a bound of sqrt(RELATIVE_FLOOR)
# times the root-mean-square bound.
RELATIVE_FLOOR = 1e-3
ABSOLUTE_FLOOR = 1e-35


def num_parameters(tensors):
    """Number of coordinates d in a list of tensors or variables (static).

    Example:

    >>> num_parameters([tf.zeros([3, 2]), tf.zeros([2])])
    8
    """
    total = 0
    for tensor in tensors:
        if not tensor.shape.is_fully_defined():
            raise ValueError(
                "AdaDP needs statically shaped variables to count parameters. "
                f"Received: shape={tensor.shape}"
            )
        total += tensor.shape.num_elements()
    return total


def update_second_moments(moments, noisy_grads, decay):
    """EMA of squared released gradients: decay * m + (1 - decay) * g~^2.

    AdaDP's s uses decay = gamma' (0.9); its RMSprop statistic v uses
    decay = 1 - gamma. Only released (noisy) gradients may be passed here.

    Args:
        moments: list of float tensors, the current statistic.
        noisy_grads: list of released noisy gradients, same shapes.
        decay: float in [0, 1), weight of the old value.

    Returns:
        List of updated statistics.

    Example:

    >>> update_second_moments([tf.constant([1.0])], [tf.constant([2.0])], 0.9)[0].numpy()
    array([1.3], dtype=float32)
    """
    return [
        decay * m + (1.0 - decay) * tf.square(tf.cast(g, m.dtype))
        for m, g in zip(moments, noisy_grads)
    ]


def sqrt_spread(moments):
    """Var_j(sqrt(s_j)) over every coordinate of every tensor (scalar).

    Example:

    >>> float(sqrt_spread([tf.constant([0.0, 4.0])]))
    1.0
    """
    roots = tf.concat([tf.reshape(tf.sqrt(tf.maximum(m, 0.0)), [-1]) for m in moments], 0)
    mean = tf.reduce_mean(roots)
    return tf.reduce_mean(tf.square(roots - mean))


def is_adaptive_phase(moments, threshold):
    """True (a bool tensor) once Var(sqrt(s)) > G: local clipping starts.

    Computed from the noisy statistic only, so the phase switch is
    post-processing of released values. Use it with `tf.cond` / `tf.where`
    inside a compiled step.

    Example:

    >>> bool(is_adaptive_phase([tf.constant([0.0, 4.0])], 1e-6))
    True
    >>> bool(is_adaptive_phase([tf.zeros([3])], 1e-6))
    False
    """
    return sqrt_spread(moments) > tf.cast(threshold, tf.float32)


def clip_bounds(moments, local_clip_factor, l2_norm_clip):
    """Per-coordinate clip bounds c_j = beta C sqrt(s'_j / sum_k s'_k).

    s'_j = max(s_j, floor), the floor being `RELATIVE_FLOOR` times the mean
    of s over all coordinates (and at least `ABSOLUTE_FLOOR`), so no bound is
    0. The normalising sum is over the floored s', so

        sum_j c_j^2 = beta^2 C^2

    holds exactly (up to float rounding) whatever s is: s sets the shape of
    the bounds, beta and C their scale, as C does for DP-SGD. Raising a
    coordinate to the floor takes its share from the others (at most a
    fraction RELATIVE_FLOOR of the total). An all-zero s gives the uniform
    bounds beta C / sqrt(d). Depends only on s, so the privacy argument
    holds for any s computed from released or public values.

    Args:
        moments: list of tensors, the statistic s.
        local_clip_factor: beta > 0.
        l2_norm_clip: C > 0.

    Returns:
        List of positive tensors shaped like `moments`.

    Example:

    >>> bounds = clip_bounds([tf.constant([4.0, 0.0]), tf.constant([1.0])], 1.0, 1.0)
    >>> round(sum(float(tf.reduce_sum(b**2)) for b in bounds), 6)
    1.0
    """
    count = float(num_parameters(moments))
    total = tf.add_n([tf.reduce_sum(tf.maximum(m, 0.0)) for m in moments])
    floor = tf.maximum(RELATIVE_FLOOR * total / count, ABSOLUTE_FLOOR)
    floored = [tf.maximum(m, floor) for m in moments]
    floored_total = tf.add_n([tf.reduce_sum(f) for f in floored])
    scale = local_clip_factor * l2_norm_clip * tf.math.rsqrt(floored_total)
    return [scale * tf.sqrt(f) for f in floored]


def whitening_scales(bounds, num_params):
    """sqrt(d) * c_j: dividing by it maps the clip box into the unit L2 ball."""
    root = math.sqrt(float(num_params))
    return [root * b for b in bounds]


def noise_stddevs(bounds, noise_multiplier, num_params):
    """Per-coordinate noise std on the sum: sigma_j = sigma* sqrt(d) c_j.

    Example:

    >>> noise_stddevs([tf.constant([1.0, 0.5])], 2.0, 4)[0].numpy()
    array([4., 2.], dtype=float32)
    """
    return [noise_multiplier * s for s in whitening_scales(bounds, num_params)]


def whiten(tensors, bounds, num_params):
    """Divides coordinate j by sqrt(d) c_j (leading batch dims broadcast)."""
    return [t / s for t, s in zip(tensors, whitening_scales(bounds, num_params))]


def _keep_rows(per_example, weights):
    """[B] bool: row has nonzero weight and an all-finite gradient."""
    finite = tf.reduce_all(
        tf.stack(
            [
                tf.reduce_all(tf.math.is_finite(tf.reshape(g, [tf.shape(g)[0], -1])), 1)
                for g in per_example
            ]
        ),
        0,
    )
    if weights is None:
        return finite, finite
    return tf.logical_and(finite, tf.not_equal(weights, 0.0)), finite


def _rows(mask, tensor):
    return tf.reshape(mask, [-1] + [1] * (tensor.shape.rank - 1))


def clip_coordinates(per_example, bounds):
    """Clips each coordinate of each example to [-c_j, c_j] (paper eq. 5).

    Args:
        per_example: list of tensors [B, *shape].
        bounds: list of tensors [*shape], positive.

    Returns:
        List of clipped tensors [B, *shape] (NaN stays NaN: mask it).
    """
    return [tf.clip_by_value(g, -b[None], b[None]) for g, b in zip(per_example, bounds)]


def whitened_l2_factors(per_example, bounds, num_params):
    """Factors min(1, 1 / ||g_i / (sqrt(d) c)||_2), one per example ([B]).

    A non-finite gradient gets factor 0 (it contributes nothing).
    """
    white = whiten(per_example, bounds, num_params)
    sq = tf.add_n(
        [tf.reduce_sum(tf.square(tf.reshape(w, [tf.shape(w)[0], -1])), 1) for w in white]
    )
    return dpsgd.clip_factors(sq, 1.0)


def local_clipped_sum(per_example, bounds, num_params, weights=None, mode="whitened_l2"):
    """Sum over examples of locally clipped gradients.

    Every clipped example, whitened, has L2 norm <= 1, so one example changes
    the whitened sum by at most 1 (add/remove neighbours).

    Args:
        per_example: list of tensors [B, *shape] (materialized gradients).
        bounds: list of clip bounds c [*shape] (see `clip_bounds`).
        num_params: d, the total number of coordinates.
        weights: optional [B] 0/1 mask (0 on padding rows).
        mode: "whitened_l2" (default: scale the whitened gradient to norm
            <= 1, keeping its direction) or "coordinate" (the paper: clip
            each coordinate to [-c_j, c_j]).

    Returns:
        (list of sums [*shape], number of kept rows with a non-finite
        gradient, a float scalar).

    Example:

    >>> g = [tf.constant([[3.0, -0.5], [0.1, 0.2]])]
    >>> sums, _ = local_clipped_sum(g, [tf.constant([1.0, 1.0])], 2, mode="coordinate")
    >>> sums[0].numpy()
    array([ 1.1, -0.3], dtype=float32)
    """
    if mode not in LOCAL_CLIPPING_MODES:
        raise ValueError(
            f"Expected `local_clipping` in {LOCAL_CLIPPING_MODES}. Received: "
            f"local_clipping={mode!r}"
        )
    keep, finite = _keep_rows(per_example, weights)
    safe = [tf.where(_rows(keep, g), g, tf.zeros_like(g)) for g in per_example]
    keep_f = tf.cast(keep, safe[0].dtype)
    if mode == "coordinate":
        clipped = clip_coordinates(safe, bounds)
        sums = [tf.tensordot(keep_f, c, axes=1) for c in clipped]
    else:
        factors = whitened_l2_factors(safe, bounds, num_params) * keep_f
        sums = [tf.tensordot(factors, g, axes=1) for g in safe]
    nonfinite = tf.logical_not(finite)
    if weights is not None:
        nonfinite = tf.logical_and(nonfinite, tf.not_equal(weights, 0.0))
    return sums, tf.reduce_sum(tf.cast(nonfinite, tf.float32))


def adaptive_noisy_mean(sums, bounds, num_params, noise_multiplier, expected_batch_size, seed):
    """Adds N(0, sigma_j^2), sigma_j = sigma* sqrt(d) c_j, and divides by b.

    Uses the same unit-normal streams as `dpsgd.noisy_mean` for the same
    seed; only the per-coordinate scale differs.

    Args:
        sums: list of locally clipped sums.
        bounds: list of clip bounds c.
        num_params: d.
        noise_multiplier: sigma*, the noise multiplier in the whitened space.
        expected_batch_size: b (never the realised, private, batch size).
        seed: int64 tensor [2] for this step.

    Returns:
        List of noisy mean gradients.
    """
    units = dpsgd.gaussian_noise_like(sums, 1.0, seed)
    stds = noise_stddevs(bounds, noise_multiplier, num_params)
    return [
        (s + u * sd) / tf.cast(expected_batch_size, s.dtype)
        for s, u, sd in zip(sums, units, stds)
    ]


def noise_std_summary(moments, local_clip_factor, l2_norm_clip, noise_multiplier, num_params):
    """(mean, std) over coordinates of the adaptive-phase sigma_j (scalars)."""
    bounds = clip_bounds(moments, local_clip_factor, l2_norm_clip)
    stds = noise_stddevs(bounds, noise_multiplier, num_params)
    flat = tf.concat([tf.reshape(s, [-1]) for s in stds], 0)
    mean = tf.reduce_mean(flat)
    return mean, tf.sqrt(tf.reduce_mean(tf.square(flat - mean)))


# -- The paper's accounting (reproduction only, NOT tfdp's guarantee) ---------

PAPER_ORDERS = tuple(range(2, 65))


def _theorem1_logs(q, sigma, orders, mp):
    """log of the bracket of the paper's eq. (8) at each integer order."""
    # B(l) = sum_i (-1)^i C(l, i) exp((i - 1) eps(i)), eps(i) = i / (2 sigma^2);
    # only even l are needed.
    half_inv_var = 1 / (2 * mp.mpf(sigma) ** 2)
    big_b = {
        l: mp.fsum(
            (-1) ** i * mp.binomial(l, i) * mp.exp((i - 1) * i * half_inv_var)
            for i in range(l + 1)
        )
        for l in range(2, 2 * ((max(orders) + 1) // 2) + 1, 2)
    }
    if any(value < 0 for value in big_b.values()):
        return None  # precision lost; the caller retries with more digits
    q = mp.mpf(q)
    e2 = mp.exp(2 * half_inv_var)
    logs = []
    for alpha in orders:
        total = 1 + q**2 * mp.binomial(alpha, 2) * min(4 * (e2 - 1), 2 * e2)
        for j in range(3, alpha + 1):
            product = big_b[2 * ((j + 1) // 2)] * big_b[2 * (j // 2)]
            total += 4 * q**j * mp.binomial(alpha, j) * mp.sqrt(product)
        logs.append(mp.log(total))
    return logs


@functools.lru_cache(maxsize=64)
def paper_theorem1_rdp(sampling_probability, noise_multiplier, orders=PAPER_ORDERS):
    """Per-step RDP of the paper's Lemma 6 / eq. (8) at integer `orders`.

    Reproduction only. This is the Wang-Balle-Kasiviswanathan (2018) bound
    for a Gaussian mechanism on a lot drawn uniformly WITHOUT replacement
    (fixed size L = qN, replace-one neighbours), as the paper states it:

        eps'(a) = 1/(a-1) log(1 + q^2 C(a,2) min{4(e^{1/s^2} - 1), 2 e^{1/s^2}}
                  + 4 sum_{j=3}^{a} q^j C(a,j) sqrt(B(2 ceil(j/2)) B(2 floor(j/2))))
        B(l) = sum_{i=0}^{l} (-1)^i C(l,i) exp((i-1) i / (2 s^2)).

    Reading chosen where the paper's typesetting is inconsistent: the j >= 3
    sum sits inside the log (eq. 8 and eq. 12; eq. 7 misplaces a
    parenthesis), and B uses Wang et al.'s exp((i-1) eps(i)) with the
    Gaussian's eps(i) = i / (2 s^2) (the paper prints (i-1) l / (2 s^2) in
    Theorem 1 and (i-1) / (2 s^2) in eq. 11). Exact arithmetic (mpmath): the
    alternating sums cancel catastrophically in floating point.

    Returns:
        Tuple of per-step RDP values, one per order.
    """
    import mpmath

    q, sigma = float(sampling_probability), float(noise_multiplier)
    digits = 60 + int(max(orders) * math.log10(2.0)) + int(
        (max(orders) // 2) * max(0.0, math.log10(2.0 * sigma**2))
    )
    for _ in range(6):
        ctx = mpmath.MPContext()
        ctx.dps = digits
        logs = _theorem1_logs(q, sigma, [int(a) for a in orders], ctx)
        if logs is not None:
            return tuple(float(value) / (a - 1) for value, a in zip(logs, orders))
        digits *= 2
    raise ArithmeticError(
        "Theorem 1's bound lost precision. Received: "
        f"noise_multiplier={noise_multiplier}, sampling_probability={sampling_probability}"
    )


def paper_theorem1_epsilon(noise_multiplier, sampling_probability, steps, delta):
    """The paper's Theorem 1 epsilon: NOT a guarantee for tfdp's training.

    Composes `steps` copies of `paper_theorem1_rdp` and converts with the
    classic formula eps = T eps'(a) + log(1/delta) / (a - 1), minimised over
    the integer orders 2..64 (the paper's section IV-A). It reproduces the
    paper's accounting; tfdp's ledger (tight Poisson sampled-Gaussian RDP) is
    the guarantee. Wang et al.'s bound assumes fixed-size lots sampled
    without replacement, while tfdp (and the paper's own Algorithm 1, line 3)
    samples Poisson, so this number does not describe a tfdp run.

    Note: for the paper's worked example (L = 600, N = 60000, sigma* = 0.9,
    1800 steps, delta = 1e-5) this formula gives epsilon 6.92 at order 4, not
    the printed (4.0, 1e-5) at order 6; the printed value is the Poisson
    sampled-Gaussian RDP with the classic conversion (4.015 at order 6).

    Returns:
        (epsilon, optimal order).

    Example:

    >>> eps, order = paper_theorem1_epsilon(0.9, 0.01, 1800, 1e-5)
    >>> round(eps, 2), order
    (6.92, 4)
    """
    rdp = paper_theorem1_rdp(float(sampling_probability), float(noise_multiplier))
    best = min(
        (steps * r + math.log(1.0 / delta) / (a - 1), a) for r, a in zip(rdp, PAPER_ORDERS)
    )
    return best[0], best[1]
