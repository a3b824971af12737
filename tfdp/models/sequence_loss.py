"""Sequence-level losses for language models: per-token sample weights.

A causal language model's example is a sequence; its loss is the mean (or
sum) of its token losses, each token weighted by its `sample_weight` (KerasHub's
CausalLM preprocessors give the padding mask as sample weight, shape
[batch, sequence]). DP-SGD then clips each SEQUENCE's gradient, so the
guarantee protects sequences (one training example), not single tokens.

Example:

>>> import tensorflow as tf
>>> fn = token_weighted_loss("sparse_categorical_crossentropy", "sum")
>>> y = tf.constant([[1, 0]])
>>> p = tf.constant([[[0.5, 0.5], [0.9, 0.1]]])
>>> round(float(fn((y, tf.constant([[1.0, 0.0]])), p)[0]), 4)   # -log 0.5
0.6931
"""

import tensorflow as tf

from tfdp.models.losses import unreduced_loss

REDUCTIONS = ("mean", "sum")


def token_weighted_loss(loss, reduction="mean"):
    """callable((y_true, token_weights), y_pred) -> one loss per sequence.

    Args:
        loss: as for `compile(loss=...)`: a name, a `keras.losses.Loss` (its
            reduction ignored) or a function; it must return one loss per
            token, shape [batch, sequence].
        reduction: "mean" (sum of w_t * loss_t over sum of w_t; a sequence
            without weighted tokens has loss 0) or "sum".
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"Expected `reduction` in {REDUCTIONS}. Received: reduction={reduction!r}")
    unreduced = unreduced_loss(loss)

    def loss_fn(y_and_weights, y_pred):
        y_true, weights = y_and_weights
        values = tf.cast(tf.convert_to_tensor(unreduced(y_true, y_pred)), tf.float32)
        weights = tf.cast(weights, tf.float32)
        if values.shape.rank != weights.shape.rank:
            raise ValueError(
                "Per-token sample weights need a loss with one value per token: "
                f"the loss has shape {values.shape}. Received: sample_weight of shape "
                f"{weights.shape}"
            )
        axes = list(range(1, values.shape.rank))
        total = tf.reduce_sum(values * weights, axes)
        if reduction == "sum":
            return total
        return tf.math.divide_no_nan(total, tf.reduce_sum(weights, axes))

    return loss_fn
