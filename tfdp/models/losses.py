"""Per-example losses from whatever a Keras user passes to `compile(loss=...)`.

The batched per-example pass needs each example's loss to read that example
alone. Keras's usual losses do (`ROW_WISE_LOSSES`); any other loss (Keras's
`circle`, `dice` or `tversky`, which compare or pool rows of the batch, a
custom function or `Loss` subclass) is evaluated one row at a time, so no
example's loss, and so no clipped gradient, can depend on another's.

Example:

>>> import tensorflow as tf
>>> fn = per_example_loss("mse")
>>> fn(tf.zeros([2, 3]), tf.ones([2, 3])).numpy()
array([1., 1.], dtype=float32)
"""

import keras
from keras.src.losses.losses import LossFunctionWrapper
import tensorflow as tf

from tfdp.per_example.grads import as_float32


_L = keras.losses
# Loss functions whose value for row i is computed from row i alone (they
# reduce over the last axis only). Keras's `circle`, `dice`, `tversky` and
# `ctc` are not here: the first three pool or compare rows of the batch.
ROW_WISE_LOSSES = frozenset([
    _L.binary_crossentropy, _L.binary_focal_crossentropy, _L.categorical_crossentropy,
    _L.categorical_focal_crossentropy, _L.sparse_categorical_crossentropy,
    _L.categorical_hinge, _L.hinge, _L.squared_hinge, _L.huber, _L.log_cosh,
    _L.kl_divergence, _L.poisson, _L.cosine_similarity, _L.mean_squared_error,
    _L.mean_absolute_error, _L.mean_absolute_percentage_error,
    _L.mean_squared_logarithmic_error,
])


def _is_row_wise(resolved):
    if isinstance(resolved, keras.losses.Loss):
        wrapper = LossFunctionWrapper
        if not isinstance(resolved, wrapper) or type(resolved).call is not wrapper.call:
            return False  # a Loss with its own call: unknown
        axis = resolved._fn_kwargs.get("axis", -1)
        return resolved.fn in ROW_WISE_LOSSES and isinstance(axis, int) and (axis == -1 or axis > 0)
    return resolved in ROW_WISE_LOSSES


def _one_row_at_a_time(unreduced):
    def per_row(y_true, y_pred):
        def one_example(pair):
            row_true, row_pred = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), pair)
            return tf.convert_to_tensor(unreduced(row_true, row_pred))[0]

        return tf.vectorized_map(one_example, (y_true, y_pred))

    return per_row


SEVERAL_HEADS = (
    "each example's loss is what is clipped, so several heads train as one output "
    "with one loss that weighs them per example: concatenate the heads "
    "(keras.layers.Concatenate()([head_a, head_b])), stack their targets as the "
    "columns of y, and compile with a loss that splits both and returns w_a * "
    "loss_a + w_b * loss_b for each example (docs/guides/your-model.md, "
    "'Several outputs')."
)


def check_one_output(model):
    """Refuses, at `compile`, a model with several outputs.

    Raises:
        ValueError: naming the outputs and how to train the heads as one.
    """
    try:
        outputs = model.outputs or []
    except AttributeError:  # a subclassed model: its outputs are its call()'s
        return
    if len(outputs) > 1:
        names = [getattr(o, "name", "?") for o in outputs]
        raise ValueError(
            f"A DP model trains one output with one loss; this one has {len(outputs)} "
            f"outputs {names}: " + SEVERAL_HEADS + f" Received: {len(outputs)} outputs"
        )


def unreduced_loss(loss):
    """callable(y_true, y_pred) -> unreduced losses whose row i reads row i only.

    Example:

    >>> import tensorflow as tf
    >>> fn = unreduced_loss("circle")          # compares rows of the batch
    >>> fn(tf.constant([0, 1]), tf.constant([[1.0, 0.0], [0.0, 1.0]])).shape
    TensorShape([2])
    """
    if loss is None:
        raise ValueError("A DP model needs a loss to compute per-example gradients. Received: loss=None")
    if isinstance(loss, (list, tuple, dict)):
        raise ValueError(
            "DP models support one output with one loss: " + SEVERAL_HEADS + " Received: "
            f"loss={loss!r}"
        )
    resolved = keras.losses.get(loss) if isinstance(loss, str) else loss
    if resolved is None:
        raise ValueError(f"Unknown loss. Received: loss={loss!r}")
    unreduced = resolved.call if isinstance(resolved, keras.losses.Loss) else resolved
    return unreduced if _is_row_wise(resolved) else _one_row_at_a_time(unreduced)


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
    unreduced = unreduced_loss(loss)

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
