"""Helpers the layer rules share.

Example:

>>> import keras, tensorflow as tf
>>> layer = keras.layers.Dense(1, activation="relu", kernel_initializer="ones")
>>> layer.build((None, 1))
>>> call_pre_activation(layer, layer.call, tf.constant([[-2.0]])).numpy()
array([[-2.]], dtype=float32)
"""

import tensorflow as tf

from tfdp.per_example.grads import MaterializedGrads, as_float32


def call_pre_activation(layer, call, *args, **kwargs):
    """`call(*args, **kwargs)` with `layer.activation` switched off.

    Keras's Dense, EinsumDense and convolution layers compute
    `activation(op(inputs, kernel) + bias)`: running their own `call` without
    the activation gives the pre-activation exactly as Keras computes it.
    """
    activation = layer.activation
    object.__setattr__(layer, "activation", None)
    try:
        return call(*args, **kwargs)
    finally:
        object.__setattr__(layer, "activation", activation)


class PreActivationRule:
    """Base of rules for layers computing activation(op(x, kernel) + bias):
    records the input `x` and probes the pre-activation `z` of the layer's own
    call. Subclasses give `supports` and `parts`."""

    def supports(self, layer):
        return plain_weights(layer)

    def call(self, layer, recorder, call, inputs, **kwargs):
        inputs = tf.convert_to_tensor(inputs)
        record = recorder.record(layer, x=inputs)
        outputs = record.probe("z", call_pre_activation(layer, call, inputs, **kwargs))
        return apply_activation(layer, outputs)


def apply_activation(layer, outputs):
    """`layer.activation(outputs)`, or `outputs` for a layer without one."""
    if layer.activation is None:
        return outputs
    return layer.activation(outputs)


MIXED_COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def is_float32(layer):
    """True when the layer stores its weights in float32 and computes in
    float32 or, under a mixed precision policy, in bfloat16 / float16 (the
    per-example parts then work in float32, `tfdp.per_example.grads`)."""
    return getattr(layer, "compute_dtype", None) in MIXED_COMPUTE_DTYPES and all(
        v.dtype == "float32" for v in layer.trainable_variables
    )


def plain_weights(layer):
    """True for a float32 layer without LoRA or quantization (whose `call`
    reads other weights than the ones a rule differentiates)."""
    return (
        is_float32(layer)
        and getattr(layer, "quantization_mode", None) is None
        and not getattr(layer, "lora_enabled", False)
    )


def concat_positions(tensors):
    """Joins [B, S_k, C] tensors of several calls along the position axis.

    One layer called several times (shared weights) has the gradient
    sum_k X_k^T G_k, the gradient of a single call on the joined rows.
    """
    return tensors[0] if len(tensors) == 1 else tf.concat(tensors, axis=1)


def sum_per_example(tensors):
    """Sums per-example gradients of several calls ([B, ...] each)."""
    return tensors[0] if len(tensors) == 1 else tf.add_n(tensors)


def scale_and_offset_parts(scale, offset, records, kept_axes):
    """The exact per-example gradients of a normalization's scale and offset:
    `dL/dy * normalized` and `dL/dy`, each summed over every axis but the
    batch and `kept_axes(rank)` (the parameter's), over every call.

    Args:
        scale, offset: the layer's variables (None, or frozen: left out).
        records: the calls' records, each with `grads["y"]` and `normalized`.
        kept_axes: callable(rank) -> the axes the parameter spans.

    Returns:
        A one-part list: `MaterializedGrads` of the trainable ones.
    """
    variables, grads = [], []
    for param, with_input in ((scale, True), (offset, False)):
        if param is None or not param.trainable:
            continue
        per_call = []
        for r in records:
            g = as_float32(r.grads["y"])
            rank = g.shape.rank
            if with_input:
                g = g * r.normalized
            keep = kept_axes(rank)
            summed = tf.reduce_sum(g, [a for a in range(1, rank) if a not in keep])
            per_call.append(tf.reshape(summed, tf.concat([[tf.shape(g)[0]], param.shape], 0)))
        variables.append(param)
        grads.append(sum_per_example(per_call))
    return [MaterializedGrads(variables, grads)]
