"""Standard normal noise by a vectorised Box-Muller transform.

`tf.random.stateless_normal` runs the Box-Muller transform one pair at a time
inside its kernel; the same transform written as TensorFlow element-wise ops
(log, sqrt, cos, sin over whole tensors) runs vectorised, and measured about
1.5x faster on the 2-core AVX-512 CPU (535k draws: 3.6 against 5.6 ms,
benchmarks/throughput.py's "noise ms"). Same distribution: two independent
uniforms U1, U2 give two independent N(0, 1) draws
sqrt(-2 ln(1 - U1)) cos(2 pi U2) and sqrt(-2 ln(1 - U1)) sin(2 pi U2).
Float32 uniforms are multiples of 2^-23, so |z| <= 5.64 (TensorFlow's own
kernel clamps U1 at 1e-7: |z| <= 5.68).

Example:

>>> import tensorflow as tf
>>> z = standard_normal([3, 2], tf.constant([1, 2], tf.int64))
>>> z.shape, z.dtype
(TensorShape([3, 2]), tf.float32)
"""

import math

import tensorflow as tf


def standard_normal(shape, seed, dtype=tf.float32):
    """N(0, 1) draws of `shape`, a pure function of `seed` (stateless).

    Args:
        shape: the output shape (a list or a 1-D int tensor).
        seed: int64 tensor [2].
        dtype: float dtype of the result; the draw is in float32 (or
            float64 for float64) and cast.

    Returns:
        A tensor of `shape` and `dtype`.

    Example:

    >>> a = standard_normal([4], tf.constant([0, 1], tf.int64))
    >>> b = standard_normal([4], tf.constant([0, 1], tf.int64))
    >>> bool(tf.reduce_all(a == b))
    True
    """
    work = tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32
    shape = tf.convert_to_tensor(shape, tf.int32)
    count = tf.reduce_prod(shape)
    half = (count + 1) // 2
    uniforms = tf.random.stateless_uniform(tf.stack([2, half]), seed=seed, dtype=work)
    radius = tf.sqrt(-2.0 * tf.math.log1p(-uniforms[0]))  # 1 - U1 is in (0, 1]
    angle = tf.constant(2.0 * math.pi, work) * uniforms[1]
    pairs = tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], 0)
    return tf.cast(tf.reshape(pairs[:count], shape), dtype)
