"""The rule for GroupNormalization, computed as Keras computes it.

Within each example and group, y = (x - mean) * inv * gamma + beta, with
inv = 1 / sqrt(variance + epsilon). The rule runs the layer's own formula,
y = x * (inv gamma) + (beta - mean inv gamma): two full-size operations
forward, the backward pass Keras's own, and the same output bit for bit.
Spelling out the normalized tensor n(x) = (x - mean) inv first, as the
other normalizations' rule does, adds two full-size operations forward
and their gradients backward.

Example i's gradients are those of the scale and the offset summed over its
positions: for a channel c of group k, sum_s G_i(s, c) n_i(s, c) =
inv_ik (sum_s G_i(s, c) x_i(s, c) - mean_ik sum_s G_i(s, c)) and
sum_s G_i(s, c), the same products Keras's backward forms for the batch
sum. They are held in full (`MaterializedGrads`): their norms are measured
on the very float32 tensors the weighted sum adds, however they were
computed.

Example:

>>> import keras, tensorflow as tf
>>> from tfdp.per_example.recorder import Recorder
>>> layer = keras.layers.GroupNormalization(2)
>>> layer.build((None, 3, 4))
>>> x = tf.random.stateless_normal([5, 3, 4], [0, 1])
>>> with tf.GradientTape() as tape:
...     recorder = Recorder(tape)
...     with recorder.hooked([(layer, GroupNormalizationRule())]):
...         y = layer(x)
...     total = tf.reduce_sum(y)
>>> bool(tf.reduce_all(y == layer(x)))
True
>>> recorder.compute_gradients(total)
>>> [g.shape for g in GroupNormalizationRule().parts(
...     layer, recorder.records_of(layer))[0].grads]
[TensorShape([5, 4]), TensorShape([5, 4])]
"""

import keras
import tensorflow as tf

from tfdp.per_example.grads import MaterializedGrads, as_float32
from tfdp.per_example.registry import register_rule
from tfdp.per_example.rules.common import is_float32, sum_per_example


def _parameter(param, channel, groups, rank):
    """`param` [C] shaped to broadcast against the grouped input."""
    shape = [1] * (rank + 1)
    shape[channel] = groups
    shape[channel + 1] = param.shape[0] // groups
    return tf.reshape(tf.cast(param, tf.float32), shape)


@register_rule(keras.layers.GroupNormalization)
class GroupNormalizationRule:
    """Scale and offset of a GroupNormalization, per example."""

    def supports(self, layer):
        return is_float32(layer)

    def call(self, layer, recorder, call, inputs, **kwargs):
        # In float32 like Keras's own call, also under mixed precision.
        x = as_float32(tf.convert_to_tensor(inputs))
        rank = x.shape.rank
        channel = layer.axis % rank
        if channel == 0:  # the plan refuses it; a rule must not sum examples either
            raise ValueError(
                f"Layer '{layer.name}' (GroupNormalization) groups over the batch axis: "
                f"it has no per-example gradient. Received: axis={layer.axis}")
        groups = layer.groups
        shape = tf.unstack(tf.shape(x))
        grouped = tf.reshape(x, tf.stack(
            shape[:channel] + [groups, x.shape[channel] // groups] + shape[channel + 1:]))
        statistics = [a for a in range(1, rank + 1) if a != channel]
        mean, variance = tf.nn.moments(grouped, statistics, keepdims=True)
        inv = tf.math.rsqrt(variance + layer.epsilon)
        scale = inv
        if layer.gamma is not None:
            scale = inv * _parameter(layer.gamma, channel, groups, rank)
        offset = -mean * scale
        if layer.beta is not None:
            offset = offset + _parameter(layer.beta, channel, groups, rank)
        outputs = tf.reshape(grouped * scale + offset, tf.shape(x))
        record = recorder.record(layer, grouped=grouped, mean=mean, inv=inv, channel=channel)
        return record.probe("y", tf.cast(outputs, layer.compute_dtype))

    def parts(self, layer, records):
        variables, grads = [], []
        for param, with_input in ((layer.gamma, True), (layer.beta, False)):
            if param is None or not param.trainable:
                continue
            per_call = []
            for r in records:
                g = tf.reshape(as_float32(r.grads["y"]), tf.shape(r.grouped))
                positions = [a for a in range(1, g.shape.rank)
                             if a not in (r.channel, r.channel + 1)]
                summed = tf.reduce_sum(g, positions, keepdims=True)
                if with_input:
                    products = tf.reduce_sum(g * r.grouped, positions, keepdims=True)
                    summed = (products - r.mean * summed) * r.inv
                per_call.append(tf.reshape(summed, [tf.shape(g)[0], param.shape[0]]))
            variables.append(param)
            grads.append(sum_per_example(per_call))
        return [MaterializedGrads(variables, grads)]
