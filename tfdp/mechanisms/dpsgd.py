"""DP-SGD's math (Abadi et al. 2016) as plain TensorFlow functions.

One private step: clip every per-example gradient to L2 norm at most
`l2_norm_clip`, sum, add Gaussian noise N(0, (noise_multiplier * l2_norm_clip)^2)
to every coordinate of the sum, and divide by the *expected* batch size (the
realised size of a Poisson batch is private). See docs/mechanisms/dpsgd.md.

Example:

>>> import tensorflow as tf
>>> sq_norms = tf.constant([4.0, 0.25, float("nan")])
>>> clip_factors(sq_norms, l2_norm_clip=1.0).numpy()
array([0.5, 1. , 0. ], dtype=float32)
"""

import tensorflow as tf

from tfdp.mechanisms.gaussian import add_normals, fold_seed, normals


# The smallest normal number of each float type: a squared-norm bound below it
# may be a rounded subnormal or flushed to 0 (CPU and XLA flush float32
# results below 2^-126), so it says only that the norm is below its square root.
_SMALLEST_NORMAL = {
    tf.float16: 2.0**-14,
    tf.bfloat16: 2.0**-126,
    tf.float32: 2.0**-126,
    tf.float64: 2.0**-1022,
}


def clip_factors(sq_norms, l2_norm_clip, weights=None):
    """Per-example factors `min(1, C / ||g_i||)` that clip each gradient to C.

    A non-finite norm (NaN or Inf gradient) gets factor 0: such an example
    contributes nothing, so it can never bypass clipping (docs/mechanisms/index.md#clipping).

    `sq_norms` are upper bounds of the squared norms, rounded up with a
    relative margin (`PerExampleGradients.sq_norms`: 2^-20) wherever they are
    normal numbers. A bound below the smallest normal t of its type (2^-126
    in float32) is read as the norm sqrt(t) (2^-63 ~ 1.1e-19 in float32): the
    true norm n is then below sqrt(t), so the factor min(1, C / sqrt(t)) keeps
    its contribution below C for every C. Read as 0, it gave factor 1, and a
    record with n ~ 1e-20 was summed whole at C = 1e-30. A C or a factor
    that is not a normal number (rounded with a large relative error where
    subnormals are not flushed) gives factor 0.

    Args:
        sq_norms: float tensor [B] (float16, bfloat16, float32 or float64),
            upper bounds of the squared L2 norms of per-example gradients.
        l2_norm_clip: positive float, the clipping bound C.
        weights: optional float tensor [B] multiplied into the factors (0 for
            padded rows of a batch).

    Returns:
        Float tensor [B] of factors in [0, 1]: float64 for float64
        `sq_norms`, float32 otherwise (a half-type bound is read in float32
        with float32's margin: C and C / norm rounded to nearest in the half
        type let a contribution exceed C by 0.8% in bfloat16).

    Example:

    >>> clip_factors(tf.constant([9.0]), 1.5).numpy()
    array([0.5], dtype=float32)
    >>> clip_factors(tf.constant([0.0]), 2.0**-64).numpy()   # a norm below 2^-63
    array([0.5], dtype=float32)
    >>> clip_factors(tf.constant([4.0], tf.bfloat16), 1.0).dtype   # read in float32
    tf.float32
    """
    sq_norms = tf.convert_to_tensor(sq_norms)
    if sq_norms.dtype not in _SMALLEST_NORMAL:
        raise ValueError(
            "Expected `sq_norms` to be a float16, bfloat16, float32 or float64 tensor. "
            f"Received: sq_norms dtype={sq_norms.dtype.name}"
        )
    finite = tf.math.is_finite(sq_norms)
    # ||g + a||^2 expanded as ||g||^2 + 2<g, a> + ||a||^2 can round below 0.
    safe = tf.where(finite, tf.maximum(sq_norms, 0.0), tf.zeros_like(sq_norms))
    if sq_norms.dtype in (tf.float16, tf.bfloat16):
        safe = _half_to_float32_bound(safe)
    smallest = _SMALLEST_NORMAL[safe.dtype]
    norms = tf.maximum(tf.sqrt(safe), smallest**0.5)
    clip = tf.cast(l2_norm_clip, safe.dtype)
    # C / norms overflows to inf only where C > norms: min(1, inf) = 1 is right.
    factors = tf.minimum(1.0, clip / norms)
    usable = finite & (clip >= smallest) & (factors >= smallest)
    factors = tf.where(usable, factors, tf.zeros_like(factors))
    if weights is not None:
        factors = factors * tf.cast(weights, factors.dtype)
    return factors


def _half_to_float32_bound(safe):
    """A float16 or bfloat16 squared-norm bound as float32 clipping reads it.

    Rounded to nearest in the half type, C and C / norm let a contribution
    exceed C by 0.8% (bfloat16); in float32 the bound needs the margin
    float32 clipping's analysis assumes (docs/mechanisms/per-example.md):
    the cast is exact, the bound is floored at its type's smallest normal t
    (below it the bound only says that the squared norm is below t), and
    times (1 + 2^-20), rounded, it is a normal float32 at least
    s (1 + 2^-20) (1 - 2^-24), as `PerExampleGradients.sq_norms` gives.
    """
    floor = _SMALLEST_NORMAL[safe.dtype]
    safe = tf.maximum(tf.cast(safe, tf.float32), floor)
    return safe * (1.0 + 2.0**-20)


def step_seed(key, step):
    """The seed of one step's noise: `key` folded with the step counter.

    Stateless: nothing about the noise is stored in a variable, so nothing can
    be saved with a model; a resumed run (larger `step`) never replays noise.

    Args:
        key: int64 tensor [2], the run's secret noise key.
        step: integer scalar tensor, e.g. the optimizer's iteration counter.

    Returns:
        int64 tensor [2].

    Example:

    >>> s = step_seed(tf.constant([1, 2], tf.int64), tf.constant(7, tf.int64))
    >>> s.shape
    TensorShape([2])
    """
    return fold_seed(key, step)


def gaussian_noise_like(tensors, stddev, seed):
    """Independent N(0, stddev^2) noise shaped like each tensor of a list.

    Args:
        tensors: list of float tensors.
        stddev: scalar standard deviation (a float, or a tensor broadcastable
            to each tensor for per-coordinate noise).
        seed: int64 tensor [2] (see `step_seed`); each tensor gets its own
            stream, folded with its index (small tensors share the first
            one's, split), drawn by the vectorised Box-Muller transform of
            `tfdp.mechanisms.gaussian` (whole tail).

    Returns:
        List of noise tensors.

    Example:

    >>> n = gaussian_noise_like([tf.zeros([3])], 1.0, tf.constant([0, 1], tf.int64))
    >>> n[0].shape
    TensorShape([3])
    """
    streams = [fold_seed(seed, i) for i in range(len(tensors))]
    shapes = [t.shape if t.shape.is_fully_defined() else tf.shape(t) for t in tensors]
    dtypes = [t.dtype for t in tensors]
    if tf.convert_to_tensor(stddev).shape.rank == 0:  # folded into the radius
        return normals(shapes, streams, dtypes, stddev=stddev)
    units = normals(shapes, streams, dtypes)
    return [u * tf.cast(stddev, t.dtype) for u, t in zip(units, tensors)]


def add_gaussian_noise(tensors, stddev, seed, divisor=None):
    """Each tensor plus its `gaussian_noise_like` noise, divided by `divisor`
    if given, bit for bit as `(t + n) / divisor`.

    With a scalar `stddev` the compiled kernel (where it runs)
    adds the noise in the same pass that draws it; the division is a
    TensorFlow op on both paths (`tfdp.mechanisms.gaussian.add_normals`).

    Args:
        tensors: list of float tensors.
        stddev: as in `gaussian_noise_like`.
        seed: int64 tensor [2].
        divisor: None or a scalar.

    Returns:
        List of tensors like `tensors`.

    Example:

    >>> t = add_gaussian_noise([tf.ones([2])], 0.0, tf.constant([0, 1], tf.int64))
    >>> t[0].numpy()
    array([1., 1.], dtype=float32)
    """
    if tf.convert_to_tensor(stddev).shape.rank == 0:
        streams = [fold_seed(seed, i) for i in range(len(tensors))]
        return add_normals(tensors, streams, stddev, divisor)
    noised = [t + n for t, n in zip(tensors, gaussian_noise_like(tensors, stddev, seed))]
    return noised if divisor is None else [t / tf.cast(divisor, t.dtype) for t in noised]


def noisy_mean(clipped_sums, noise_stddev, expected_batch_size, seed):
    """Adds Gaussian noise to clipped sums and divides by the expected size.

    Args:
        clipped_sums: list of tensors, the sums of clipped per-example grads.
        noise_stddev: standard deviation of the noise on each coordinate of
            the sum (noise_multiplier * l2_norm_clip for DP-SGD).
        expected_batch_size: the sampler's expected batch size b (never the
            realised size, which is private).
        seed: int64 tensor [2] for this step.

    Returns:
        List of noisy mean gradients.

    Example:

    >>> g = noisy_mean([tf.ones([2])], 0.0, 4.0, tf.constant([0, 0], tf.int64))
    >>> g[0].numpy()
    array([0.25, 0.25], dtype=float32)
    """
    return add_gaussian_noise(clipped_sums, noise_stddev, seed, divisor=expected_batch_size)
