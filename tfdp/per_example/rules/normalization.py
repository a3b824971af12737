"""Rules for LayerNormalization and RMSNormalization (GroupNormalization's:
`tfdp.per_example.rules.group_normalization`).

Each computes y = n(x) * gamma + beta with n(x) normalized within one example
and gamma, beta broadcast along the normalized (parameter) axes, so example
i's gradients are sum(G_i * n(x_i)) and sum(G_i) over the other axes: small
[B, *gamma.shape] tensors, materialized.

Example:

>>> import keras
>>> layer = keras.layers.LayerNormalization()
>>> layer.build((None, 3, 4))
>>> NormalizationRule().supports(layer)
True
"""

import keras
import tensorflow as tf

from tfdp.per_example.grads import as_float32
from tfdp.per_example.registry import register_rule
from tfdp.per_example.rules.common import is_float32, scale_and_offset_parts

_L = keras.layers
_RMS = getattr(_L, "RMSNormalization", None)


def _axes(layer, rank):
    axis = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    return sorted(a % rank for a in axis)


def _normalized(layer, x):
    """n(x): the layer's normalization without its scale and offset."""
    rank = x.shape.rank
    axes = _axes(layer, rank)
    if _RMS is not None and isinstance(layer, _RMS):
        return keras.ops.rms_normalization(x, scale=None, axis=axes, epsilon=layer.epsilon)
    return keras.ops.layer_normalization(
        x, None, None, axes, layer.epsilon, rms_scaling=layer.rms_scaling
    )


def _scale_and_offset(layer):
    if _RMS is not None and isinstance(layer, _RMS):
        return layer.scale, None
    return layer.gamma, layer.beta


def _broadcast(param, axes, rank):
    shape = [1] * rank
    for axis, size in zip(axes, param.shape):
        shape[axis] = size
    return tf.reshape(param, shape)


@register_rule(*[c for c in (_L.LayerNormalization, _RMS) if c])
class NormalizationRule:
    """Scale and offset of a per-example normalization."""

    def supports(self, layer):
        return is_float32(layer)

    def call(self, layer, recorder, call, inputs, **kwargs):
        # In float32 like Keras's own call, also under mixed precision.
        inputs = as_float32(tf.convert_to_tensor(inputs))
        normalized = _normalized(layer, inputs)
        record = recorder.record(layer, normalized=normalized)
        rank = inputs.shape.rank
        axes = _axes(layer, rank)
        scale, offset = _scale_and_offset(layer)
        outputs = normalized
        if scale is not None:
            outputs = outputs * _broadcast(tf.cast(scale, tf.float32), axes, rank)
        if offset is not None:
            outputs = outputs + _broadcast(tf.cast(offset, tf.float32), axes, rank)
        return record.probe("y", tf.cast(outputs, layer.compute_dtype))

    def parts(self, layer, records):
        scale, offset = _scale_and_offset(layer)
        return scale_and_offset_parts(scale, offset, records, lambda rank: _axes(layer, rank))
