"""Adaptive (quantile) clipping's math as plain functions.

Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private Learning
with Adaptive Clipping" (NeurIPS 2021): the clip norm C_t follows a target
quantile gamma of the units' gradient norms. Each step releases, besides
DP-SGD's noisy sum, a noisy count of the units left unclipped, centred so
that each unit adds +-1/2 (sensitivity 1/2):

    b_t = (sum_i (1[unit i unclipped at C_t] - 1/2) + N(0, sigma_b^2)) / B + 1/2
    C_{t+1} = C_t exp(-eta (b_t - gamma))        (geometric)
    C_{t+1} = C_t - eta (b_t - gamma)            (linear)

with B the expected batch size (public). The sum's noise multiplier is
lowered so that the pair costs one Gaussian of the user's multiplier z:
sigma_grad = (z^-2 - (2 sigma_b)^-2)^(-1/2) (docs/mechanisms/dpsgd.md,
"Adaptive clipping").

Example (noise 0: half the units unclipped at target 0.5 leaves C alone):

>>> import tensorflow as tf
>>> count = centred_unclipped_count(tf.constant([0.25, 4.0]), 1.0, tf.ones([2]))
>>> fraction = unclipped_fraction(count, 0.0, 2.0, tf.constant([0, 1], tf.int64))
>>> float(next_clip_norm(1.0, fraction, 0.5, 0.2, "geometric", 1e30))
1.0
"""

import math

import tensorflow as tf

from tfdp.mechanisms.dpsgd import clip_factors
from tfdp.mechanisms.gaussian import standard_normal

CLIP_UPDATES = ("geometric", "linear")

# Andrew et al.'s defaults: eta = 0.2 (geometric) and sigma_b = B / 20.
DEFAULT_CLIP_LEARNING_RATE = 0.2
DEFAULT_COUNT_STDDEV_PER_UNIT = 1.0 / 20.0

# The clip norm never goes below this (the linear update can reach 0 and
# the geometric update could not leave it).
SMALLEST_CLIP_NORM = 1e-30

# The count's noise stream, folded into the step's noise seed: far from the
# per-variable streams 0, 1, ... of the gradient noise.
COUNT_STREAM = 2**31 - 1


def count_stddev(clipped_count_stddev, expected_batch_size):
    """sigma_b: `clipped_count_stddev`, or B / 20 (the paper's) when None.

    Example:

    >>> count_stddev(None, 256), count_stddev(3.0, 256)
    (12.8, 3.0)
    """
    if clipped_count_stddev is None:
        return expected_batch_size * DEFAULT_COUNT_STDDEV_PER_UNIT
    return clipped_count_stddev


def gradient_noise_multiplier(noise_multiplier, count_stddev):
    """sigma_grad = (z^-2 - (2 sigma_b)^-2)^(-1/2): the sum's multiplier that,
    with the count's noise sigma_b on a sensitivity-1/2 count, costs one
    Gaussian of multiplier z. Works on floats and tensors alike; the caller
    checks it is defined (`check_noise_split`).

    Example:

    >>> round(gradient_noise_multiplier(1.0, 1.0), 6)   # (1 - 1/4)^(-1/2)
    1.154701
    """
    return (noise_multiplier ** -2 - (2.0 * count_stddev) ** -2) ** -0.5


def check_noise_split(noise_multiplier, count_stddev, received):
    """Raises ValueError unless 2 sigma_b > z (sigma_grad is then defined).

    Args:
        noise_multiplier: z, the multiplier the ledger charges.
        count_stddev: sigma_b, the count's noise standard deviation.
        received: the arguments these came from, for the message.

    Example:

    >>> check_noise_split(1.0, 0.4, "noise_multiplier=1, clipped_count_stddev=0.4")
    Traceback (most recent call last):
    ...
    ValueError: ... Received: noise_multiplier=1, clipped_count_stddev=0.4
    """
    if not 2.0 * count_stddev > noise_multiplier:
        raise ValueError(
            "Adaptive clipping spends part of the noise multiplier z on the count of "
            "unclipped units (noise sigma_b on a count of sensitivity 1/2), and the "
            "gradient's multiplier (z^-2 - (2 sigma_b)^-2)^(-1/2) is defined only for "
            f"2 sigma_b > z: here 2 sigma_b = {2.0 * count_stddev:g} and z = "
            f"{noise_multiplier:g}. Raise `clipped_count_stddev` (the paper's "
            "expected_batch_size / 20 needs batch_size > 10 z), or the batch size. "
            f"Received: {received}"
        )
    sigma = gradient_noise_multiplier(noise_multiplier, count_stddev)
    if not math.isfinite(sigma):
        raise ValueError(
            f"The gradient's noise multiplier (z^-2 - (2 sigma_b)^-2)^(-1/2) overflows "
            f"for z = {noise_multiplier:g} and sigma_b = {count_stddev:g}. Raise "
            f"`clipped_count_stddev`. Received: {received}"
        )
    return sigma


def centred_unclipped_count(sq_norms, clip_norm, mask):
    """sum_i (1[unit i unclipped] - 1/2) over the drawn units (mask > 0).

    A unit is unclipped when clipping at `clip_norm` leaves its factor at 1,
    read from the same squared-norm bounds clipping reads
    (`tfdp.mechanisms.dpsgd.clip_factors`); a non-finite norm counts as
    clipped. Each drawn unit adds exactly +1/2 or -1/2, whatever its
    gradient, and a padding row adds 0.

    Example:

    >>> float(centred_unclipped_count(tf.constant([0.5, 9.0, float("nan")]), 1.0,
    ...                               tf.constant([1.0, 1.0, 1.0])))
    -0.5
    """
    factors = clip_factors(sq_norms, clip_norm)
    unclipped = tf.cast(factors >= 1.0, tf.float32) - 0.5
    drawn = tf.cast(tf.convert_to_tensor(mask) > 0, tf.float32)
    return tf.reduce_sum(unclipped * drawn)


def unclipped_fraction(centred_count, stddev, expected_batch_size, seed):
    """b_t: the noisy fraction of unclipped units, clamped to [0, 1].

    Args:
        centred_count: `centred_unclipped_count` (summed over chunks).
        stddev: sigma_b (0 only in tests).
        expected_batch_size: B, the public expected number of units a step.
        seed: int64 [2], the count's own noise seed.

    Example:

    >>> float(unclipped_fraction(1.0, 0.0, 4.0, tf.constant([0, 1], tf.int64)))
    0.75
    """
    noise = standard_normal([], seed) * tf.cast(stddev, tf.float32)
    expected = tf.cast(expected_batch_size, tf.float32)
    fraction = (tf.cast(centred_count, tf.float32) + noise) / expected + 0.5
    return tf.clip_by_value(fraction, 0.0, 1.0)


def next_clip_norm(clip_norm, fraction, target_quantile, learning_rate, update, ceiling):
    """C_{t+1} from C_t and the released b_t only, within [1e-30, ceiling].

    Example:

    >>> round(float(next_clip_norm(2.0, 1.0, 0.5, 0.2, "geometric", 1e30)), 5)  # 2 e^-0.1
    1.80967
    >>> round(float(next_clip_norm(2.0, 0.0, 0.5, 0.2, "linear", 1e30)), 5)
    2.1
    """
    clip_norm = tf.cast(clip_norm, tf.float32)
    step = learning_rate * (tf.cast(fraction, tf.float32) - target_quantile)
    if update == "geometric":
        moved = clip_norm * tf.exp(-step)
    else:
        moved = clip_norm - step
    return tf.clip_by_value(moved, SMALLEST_CLIP_NORM, tf.cast(ceiling, tf.float32))
