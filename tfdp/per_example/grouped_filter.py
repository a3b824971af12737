"""A convolution's per-example kernel gradients from one grouped convolution.

Example i's kernel gradient is sum_p patch_i(p)^T G_i(p) (`patches`). With
the batch folded into the channels (input [1, H, W, B Cin], output gradient
[1, H', W', B Cout]), TensorFlow's kernel-gradient op of a convolution of B
groups computes all B of them at once ([kh, kw, Cin, B Cout]), without the
[B, H' W', kh kw Cin] patches the einsum reads. On CPUs (oneDNN) it is the
faster route for 3x3-like kernels at stride 1 over a few channels and many
positions (a ResNet's first stages), and the slower one elsewhere: one or
few input channels, strides, 64 channels or more, one spatial axis
(`benchmarks/grouped_filter.py` prints both routes on the shapes it was
chosen on). The result is a [B, K, O] tensor like the einsum's, held by
`LinearGrads` as its materialized matrices: their norms are measured on the
tensor the weighted sum then adds, whichever route computed it.

Example:

>>> import keras, tensorflow as tf
>>> layer = keras.layers.Conv2D(16, 3, padding="same")
>>> layer.build((None, 32, 32, 16))
>>> x = tf.random.stateless_normal([2, 32, 32, 16], [0, 1])
>>> g = tf.random.stateless_normal([2, 32, 32, 16], [0, 2])
>>> applies(layer, x, g) == onednn.onednn_enabled()  # the route runs through oneDNN only
True
>>> not applies(layer, x, g) or per_example_kernels(layer, x, g).shape == (2, 144, 16)
True
"""

import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tfdp.per_example import onednn

# The shapes this route is taken on (measured on a 2-core Xeon with
# AVX-512, `benchmarks/grouped_filter.py`): input and output channels in
# [MIN_CHANNELS, MAX_CHANNELS], both spatial axes at least MIN_SIDE.
MIN_CHANNELS = 8
MAX_CHANNELS = 32
MIN_SIDE = 8


def applies(layer, x, g):
    """Whether `per_example_kernels` is the route for this call of `layer`
    (a channels-last input `x` and output gradient `g`): a float32 Conv2D
    without groups, strides or dilation, static shapes in the measured
    range, on a CPU running TensorFlow's kernels through oneDNN, outside XLA
    (TensorFlow's own CPU kernel has no grouped kernel gradient; XLA and
    GPUs keep the einsum)."""
    if type(layer).__name__ != "Conv2D" or layer.groups != 1 or not onednn.onednn_enabled():
        return False
    if tuple(layer.strides) != (1, 1) or tuple(layer.dilation_rate) != (1, 1):
        return False
    if layer.padding not in ("same", "valid") or x.dtype != tf.float32 or g.dtype != tf.float32:
        return False
    spatial = x.shape[1:3]
    if not (spatial.is_fully_defined() and g.shape[1:3].is_fully_defined()):
        return False
    if min(spatial) < MIN_SIDE:
        return False
    channels = (x.shape[-1], g.shape[-1])
    if not all(MIN_CHANNELS <= c <= MAX_CHANNELS for c in channels):
        return False
    if tf.config.list_physical_devices("GPU"):
        return False
    return not control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _batch_in_channels(tensor):
    """[B, H, W, C] as [1, H, W, B C], example-major within the channels."""
    batch = tf.shape(tensor)[0]
    height, width, channels = tensor.shape[1:]
    moved = tf.transpose(tensor, [1, 2, 0, 3])
    return tf.reshape(moved, tf.stack([1, height, width, batch * channels]))


def per_example_kernels(layer, x, g):
    """[B, kh kw Cin, Cout] per-example kernel gradients of a Conv2D call
    ("same" or "valid" padding; `applies` says where it is the faster
    route), entries in the kernel's order like the einsum of
    `patches.extract_patches` rows with `g`'s.

    Args:
        layer: the Conv2D.
        x: float32 [B, H, W, Cin], the call's input, channels last.
        g: float32 [B, H', W', Cout], the gradient at its output.

    Raises:
        ValueError: TensorFlow does not run its CPU kernels through oneDNN.
    """
    if not onednn.onednn_enabled():
        raise ValueError(
            "The grouped-convolution route needs TensorFlow's oneDNN CPU kernels: its own "
            "kernel has no grouped kernel gradient. TensorFlow turns oneDNN on by default on "
            "some CPUs only; set TF_ENABLE_ONEDNN_OPTS=1 before importing it, or call "
            "`applies` first (the Conv2D rule does). Received: oneDNN off")
    batch = tf.shape(x)[0]
    kh, kw = layer.kernel_size
    cin, cout = x.shape[-1], g.shape[-1]
    kernels = tf.raw_ops.Conv2DBackpropFilter(
        input=_batch_in_channels(x),
        filter_sizes=tf.stack([kh, kw, cin, batch * cout]),
        out_backprop=_batch_in_channels(g),
        strides=[1, *layer.strides, 1],
        padding=layer.padding.upper(),
        dilations=[1, *layer.dilation_rate, 1],
    )
    kernels = tf.reshape(kernels, tf.stack([kh * kw * cin, batch, cout]))
    return tf.transpose(kernels, [1, 0, 2])
