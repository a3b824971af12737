"""Rules for convolutions: Conv1D/2D/3D (groups, dilation, strides, both data
formats, causal), DepthwiseConv1D/2D, SeparableConv1D/2D and the transposed
convolutions.

A convolution is a matmul of input patches with the kernel at every output
position, so example i's kernel gradient is sum_p patch_i(p)^T G_i(p)
(`LinearGrads`: factored norms or materialized, whichever is cheaper). Grouped
and depthwise kernels are block-diagonal in that form; their per-example
kernels are small and are materialized per group. A transposed convolution's
kernel gradient is the same product with the roles of input and output
swapped: patches of the output gradient times the input.

Example:

>>> import keras
>>> layer = keras.layers.Conv2D(4, 3, groups=2)
>>> layer.build((None, 8, 8, 6))
>>> ConvRule().supports(layer)
True
"""

import math

import keras
import tensorflow as tf

from tfdp.per_example import grouped_filter
from tfdp.per_example.grads import LinearGrads, MaterializedGrads, as_float32
from tfdp.per_example.patches import as_rows, channels_last, extract_patches
from tfdp.per_example.registry import register_rule
from tfdp.per_example.rules.common import (
    PreActivationRule,
    apply_activation,
    concat_positions,
    plain_weights,
    sum_per_example,
)

_L = keras.layers


def _patches(layer, x, kernel_size=None):
    """Patches of a channels-last input with the layer's geometry."""
    padding = layer.padding
    kernel_size = kernel_size or layer.kernel_size
    if padding == "causal":
        left = (kernel_size[0] - 1) * layer.dilation_rate[0]
        x = tf.pad(x, [[0, 0], [left, 0], [0, 0]])
        padding = "valid"
    return extract_patches(x, kernel_size, layer.strides, layer.dilation_rate, padding)


def _bias_part(layer, records, name="z"):
    """Per-example bias gradients: the output gradient summed over positions."""
    sums = [
        tf.reduce_sum(as_rows(channels_last(r.grads[name], layer.data_format)), 1)
        for r in records
    ]
    return MaterializedGrads([layer.bias], [sum_per_example(sums)])


class _ConvolutionRule(PreActivationRule):
    """A pre-activation rule reading inputs and gradients channels-last."""

    def _xg(self, layer, record):
        return (
            channels_last(record.x, layer.data_format),
            channels_last(record.grads["z"], layer.data_format),
        )


@register_rule(_L.Conv1D, _L.Conv2D, _L.Conv3D)
class ConvRule(_ConvolutionRule):
    """Conv1D/2D/3D: patches @ kernel, per group."""

    def parts(self, layer, records):
        groups = layer.groups
        if groups == 1:
            calls = [self._xg(layer, r) for r in records]
            wide = [[as_float32(t) for t in call] for call in calls]
            matrices = None
            if all(grouped_filter.applies(layer, x, g) for x, g in wide):
                def matrices():
                    return sum_per_example(
                        [grouped_filter.per_example_kernels(layer, x, g) for x, g in wide])
            return [LinearGrads(concat_positions([as_rows(_patches(layer, x)) for x, _ in calls]),
                                concat_positions([as_rows(g) for _, g in calls]),
                                layer.kernel, layer.bias, matrices=matrices)]
        window = math.prod(layer.kernel_size)
        kernels = []
        for r in records:
            x, g = self._xg(layer, r)
            patches = as_rows(_patches(layer, x))
            batch = tf.shape(patches)[0]
            cin = x.shape[-1] // groups
            patches = tf.reshape(patches, [batch, -1, window, groups, cin])
            g = tf.reshape(as_rows(g), [batch, -1, groups, layer.filters // groups])
            kernel = tf.einsum("bskgc,bsgo->bkcgo", patches, g)
            kernels.append(tf.reshape(kernel, tf.concat([[batch], layer.kernel.shape], 0)))
        parts = [MaterializedGrads([layer.kernel], [sum_per_example(kernels)])]
        if layer.bias is not None:
            parts.append(_bias_part(layer, records))
        return parts


def _depthwise_kernel_grads(layer, x, g, kernel, strides_layer=None):
    """[B, *kernel.shape] per-example depthwise kernel gradients."""
    patches = as_rows(_patches(strides_layer or layer, x, kernel.shape[:-2]))
    batch = tf.shape(patches)[0]
    channels, multiplier = kernel.shape[-2], kernel.shape[-1]
    window = math.prod(kernel.shape[:-2])
    patches = tf.reshape(patches, [batch, -1, window, channels])
    g = tf.reshape(as_rows(g), [batch, -1, channels, multiplier])
    grads = tf.einsum("bskc,bscm->bkcm", patches, g)
    return tf.reshape(grads, tf.concat([[batch], kernel.shape], 0))


@register_rule(_L.DepthwiseConv1D, _L.DepthwiseConv2D)
class DepthwiseConvRule(_ConvolutionRule):
    """Depthwise: input channel c feeds outputs c * multiplier + m."""

    def parts(self, layer, records):
        kernels = []
        for r in records:
            x, g = self._xg(layer, r)
            kernels.append(_depthwise_kernel_grads(layer, x, g, layer.kernel))
        parts = [MaterializedGrads([layer.kernel], [sum_per_example(kernels)])]
        if layer.bias is not None:
            parts.append(_bias_part(layer, records))
        return parts


@register_rule(_L.SeparableConv1D, _L.SeparableConv2D)
class SeparableConvRule:
    """Separable: a depthwise step (probed) then a 1x1 pointwise step (probed)."""

    def supports(self, layer):
        return plain_weights(layer)

    def call(self, layer, recorder, call, inputs, **kwargs):
        inputs = tf.convert_to_tensor(inputs)
        record = recorder.record(layer, x=inputs)
        depthwise = keras.ops.depthwise_conv(
            inputs, layer.depthwise_kernel, strides=layer.strides, padding=layer.padding,
            dilation_rate=layer.dilation_rate, data_format=layer.data_format,
        )
        depthwise = record.probe("depthwise", depthwise)
        record.values["depthwise"] = depthwise
        outputs = keras.ops.conv(
            depthwise, layer.pointwise_kernel, strides=1, padding="valid",
            data_format=layer.data_format,
        )
        if layer.bias is not None:
            shape = [1] * (layer.rank + 2)
            shape[-1 if layer.data_format == "channels_last" else 1] = layer.filters
            outputs = outputs + tf.reshape(layer.bias, shape)
        return apply_activation(layer, record.probe("z", outputs))

    def parts(self, layer, records):
        kernels, rows, gs = [], [], []
        for r in records:
            x = channels_last(r.x, layer.data_format)
            g_depthwise = channels_last(r.grads["depthwise"], layer.data_format)
            kernels.append(
                _depthwise_kernel_grads(layer, x, g_depthwise, layer.depthwise_kernel)
            )
            rows.append(as_rows(channels_last(r.values["depthwise"], layer.data_format)))
            gs.append(as_rows(channels_last(r.grads["z"], layer.data_format)))
        return [
            MaterializedGrads([layer.depthwise_kernel], [sum_per_example(kernels)]),
            LinearGrads(concat_positions(rows), concat_positions(gs),
                        layer.pointwise_kernel, layer.bias),
        ]


@register_rule(_L.Conv1DTranspose, _L.Conv2DTranspose, _L.Conv3DTranspose)
class ConvTransposeRule(_ConvolutionRule):
    """Transposed conv: patches of the output gradient times the input."""

    def supports(self, layer):
        return plain_weights(layer) and layer.output_padding is None

    def parts(self, layer, records):
        patches, inputs = [], []
        for r in records:
            x, g = self._xg(layer, r)
            patch = _patches(layer, g)
            if patch.shape[1:-1] != x.shape[1:-1]:
                raise ValueError(
                    f"Per-example gradients of layer '{layer.name}': the transposed "
                    "convolution's output does not map back onto its input. "
                    "Use per_example_gradients='vectorized'."
                )
            patches.append(as_rows(patch))
            inputs.append(as_rows(x))
        parts = [LinearGrads(concat_positions(patches), concat_positions(inputs), layer.kernel)]
        if layer.bias is not None:
            parts.append(_bias_part(layer, records))
        return parts
