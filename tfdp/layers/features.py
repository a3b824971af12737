"""Fixed features computed once for a whole data set (a features cache).

A weightless transform such as `Scattering2D` gives every image the same
features in every epoch, so training `[transform, small model]` is the same
mechanism, with the same privacy accounting, as training the small model on
the transformed data set: the per-example gradients, clipping and noise only
see the small model's weights. Transforming the data once instead of at every
step saves the transform's cost in each of the epochs.

Example:

>>> import numpy as np
>>> from tfdp.layers import Scattering2D
>>> compute_features(Scattering2D(J=2), np.zeros([3, 28, 28, 1], "float32")).shape
(3, 7, 7, 81)
"""

import numpy as np
import tensorflow as tf


def compute_features(layer, x, batch_size=512, jit_compile=True):
    """`layer(x)` for a whole array, in batches, as a float32 numpy array.

    Args:
        layer: a Keras layer without trainable weights (a fixed transform).
        x: numpy array [N, ...], the data set.
        batch_size: examples per call (bounds the memory used).
        jit_compile: compile with XLA (on CPU about 3x faster for
            `Scattering2D`; same values to float rounding).

    Returns:
        numpy array [N, ...] of the layer's outputs.
    """
    if not layer.built:
        layer.build((None,) + tuple(x.shape[1:]))
    if layer.trainable_weights:
        raise ValueError(
            "compute_features needs a fixed transform, but the layer has trainable "
            f"weights, which training would change. Received: layer={layer.name!r}"
        )
    if batch_size < 1 or len(x) == 0:
        raise ValueError(
            f"Expected `batch_size` >= 1 and a non-empty `x`. Received: "
            f"batch_size={batch_size}, x.shape={x.shape}"
        )
    apply = tf.function(layer, jit_compile=jit_compile)
    parts = [np.asarray(apply(x[i:i + batch_size])) for i in range(0, len(x), batch_size)]
    return np.concatenate(parts).astype(np.float32, copy=False)
