"""Rule for a trainable BatchNormalization in inference mode.

Called with `training=False` (the only way the DP step runs a trainable one,
`tfdp.per_example.inference_mode`), the layer computes, per example,
y = gamma * xhat + beta with xhat = (x - moving_mean) / sqrt(moving_variance
+ epsilon): fixed statistics, gamma and beta broadcast along the channel
axis. Example i's gradients are sum(G_i * xhat_i) and sum(G_i) over every
axis but the batch and the channel: small [B, C] tensors, materialized
(`MaterializedGrads`, whose norms bound what the sum adds). The rule computes
the output itself from the moving statistics, so nothing is read from the
batch and no statistic is written, whatever `training` says; a call in
training mode is refused all the same.

Example:

>>> import keras, tensorflow as tf
>>> from tfdp.per_example.recorder import Recorder
>>> layer = keras.layers.BatchNormalization()
>>> layer.build((None, 3))
>>> with tf.GradientTape() as tape:
...     recorder = Recorder(tape)
...     with recorder.hooked([(layer, BatchNormalizationRule())]):
...         total = tf.reduce_sum(layer(tf.constant([[1.0, 2.0, 3.0]]), training=False))
>>> recorder.compute_gradients(total)
>>> [g.shape for g in BatchNormalizationRule().parts(layer, recorder.records_of(layer))[0].grads]
[TensorShape([1, 3]), TensorShape([1, 3])]
"""

import keras
import tensorflow as tf

from tfdp.per_example.grads import as_float32
from tfdp.per_example.inference_mode import check_inference_call
from tfdp.per_example.registry import register_rule
from tfdp.per_example.rules.common import is_float32, scale_and_offset_parts


def _channel_shape(layer, rank):
    shape = [1] * rank
    shape[layer.axis % rank] = -1
    return shape


@register_rule(keras.layers.BatchNormalization)
class BatchNormalizationRule:
    """Scale and offset of a BatchNormalization in inference mode."""

    def supports(self, layer):
        return is_float32(layer)

    def call(self, layer, recorder, call, inputs, training=None, mask=None):
        check_inference_call(layer, training)
        # In float32 like Keras's own call, also under mixed precision.
        inputs = as_float32(tf.convert_to_tensor(inputs))
        rank = inputs.shape.rank
        shape = _channel_shape(layer, rank)
        mean = tf.reshape(tf.cast(layer.moving_mean, tf.float32), shape)
        variance = tf.reshape(tf.cast(layer.moving_variance, tf.float32), shape)
        normalized = (inputs - mean) * tf.math.rsqrt(variance + layer.epsilon)
        record = recorder.record(layer, normalized=normalized)
        outputs = normalized
        if layer.scale:
            outputs = outputs * tf.reshape(tf.cast(layer.gamma, tf.float32), shape)
        if layer.center:
            outputs = outputs + tf.reshape(tf.cast(layer.beta, tf.float32), shape)
        return record.probe("y", tf.cast(outputs, layer.compute_dtype))

    def parts(self, layer, records):
        return scale_and_offset_parts(layer.gamma if layer.scale else None,
                                      layer.beta if layer.center else None, records,
                                      lambda rank: (layer.axis % rank,))
