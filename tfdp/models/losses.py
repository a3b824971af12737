"""Per-example losses from whatever a Keras user passes to `compile(loss=...)`.

Example:

>>> import tensorflow as tf
>>> fn = per_example_loss("mse")
>>> fn(tf.zeros([2, 3]), tf.ones([2, 3])).numpy()
array([1., 1.], dtype=float32)
"""

import keras
import tensorflow as tf

from tfdp.per_example.grads import as_float32


def per_example_loss(loss):
    """Returns callable(y_true, y_pred) -> losses of shape [batch].

    Args:
        loss: a loss name ("sparse_categorical_crossentropy"), a
            `keras.losses.Loss` instance (its reduction is ignored: tfdp needs
            each example's loss to clip its gradient) or a function returning
            one loss per example (extra axes are averaged).

    Raises:
        ValueError: if `loss` is missing, a list or a dict (DP models take one
            loss for one output).
    """
    if loss is None:
        raise ValueError("A DP model needs a loss to compute per-example gradients. Received: loss=None")
    if isinstance(loss, (list, tuple, dict)):
        raise ValueError(
            "DP models support one output with one loss. Received: "
            f"loss={loss!r}"
        )
    resolved = keras.losses.get(loss) if isinstance(loss, str) else loss
    if resolved is None:
        raise ValueError(f"Unknown loss. Received: loss={loss!r}")
    unreduced = resolved.call if isinstance(resolved, keras.losses.Loss) else resolved

    def loss_fn(y_true, y_pred):
        # Mixed precision: the model's output may be bfloat16/float16; the
        # loss (and so every gradient's scale) is computed in float32.
        y_pred = tf.nest.map_structure(as_float32, y_pred)
        values = tf.convert_to_tensor(unreduced(y_true, y_pred))
        if values.shape.rank is None or values.shape.rank == 0:
            raise ValueError(
                "The loss must return one value per example (shape [batch, ...]). "
                f"Received: a loss of shape {values.shape}"
            )
        if values.shape.rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        return tf.cast(values, tf.float32)

    return loss_fn
