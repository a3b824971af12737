"""The batched path: one forward and backward pass, then the layer rules.

Example:

>>> import keras, tensorflow as tf
>>> from tfdp.per_example.plan import plan_for
>>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> grads, _, _ = batched_gradients(
...     model, plan_for(model), tf.ones([4, 3]), tf.zeros([4, 2]), tf.ones([4]),
...     lambda y, p: tf.reduce_sum(tf.square(y - p), -1), training=True)
>>> grads.path
'batched'
"""

import tensorflow as tf

from tfdp.per_example.declared import held_calls_checked
from tfdp.per_example.grads import PerExampleGradients
from tfdp.per_example.inference_mode import inference_mode_calls
from tfdp.per_example.keyed_noise import (
    KeyedNoise,
    has_cell_dropout,
    input_keys,
    keyed_cell_masks,
)
from tfdp.per_example.random_augmentation import KeyedAugmentation
from tfdp.per_example.recorder import Recorder


def batched_gradients(model, plan, x, y, weights, loss_fn, training):
    """(PerExampleGradients, y_pred, losses) from one batched pass.

    Args:
        model: a Keras model whose `plan.path` is "batched".
        plan: `tfdp.per_example.plan.Plan`.
        x, y, weights: the batch, its targets and per-example loss weights.
        loss_fn: callable(y_true, y_pred) -> per-example losses [B].
        training: passed to the model's layers.
    """
    keyed = any(isinstance(handler, (KeyedNoise, KeyedAugmentation))
                for _, handler in plan.handlers) or has_cell_dropout(model)
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        recorder = Recorder(tape, input_keys(x) if keyed else None)
        # The inference-mode hooks and the declared layers' checks wrap the
        # rules' (checked at every call).
        batch_size = tf.nest.flatten(x)[0].shape[0]
        with recorder.hooked(plan.handlers), inference_mode_calls(model), \
                held_calls_checked(model, batch_size), \
                keyed_cell_masks(model, recorder.example_keys):
            y_pred = model(x, training=training)
        losses = loss_fn(y, y_pred)
        total = tf.reduce_sum(losses * weights)
    recorder.compute_gradients(total)
    parts = []
    for layer, handler in plan.handlers:
        records = recorder.records_of(layer)
        if not records and layer.trainable_weights:
            raise ValueError(
                f"Layer '{layer.name}' has trainable weights but did not run in the "
                "model's forward pass; tfdp cannot compute its per-example gradients. "
                "Set layer.trainable = False or use per_example_gradients='vectorized'."
            )
        parts.extend(handler.parts(layer, records))
    return PerExampleGradients(model.trainable_variables, parts, path="batched"), y_pred, losses
