"""Input patches of an N-d convolution, so that a conv is a matmul over rows.

A convolution's output at position p is patch(p) @ kernel, with the patch
flattened in the kernel's (k_1, ..., k_n, channels) order. Its per-example
kernel gradient is then sum_p patch_i(p)^T G_i(p), which `LinearGrads` holds.

Example:

>>> import tensorflow as tf
>>> x = tf.reshape(tf.range(5.0), [1, 5, 1])
>>> extract_patches(x, (2,), (2,), (1,), "valid")[0, :, :].numpy()
array([[0., 1.],
       [2., 3.]], dtype=float32)
"""

import numpy as np
import tensorflow as tf

# Below this many input channels, gathering patches copies too little per
# index and a convolution with an identity kernel is faster (measured on the
# tanh CNN at batch 2048, 2 CPU cores: 1 channel, identity 34 ms against
# gather 99 ms; 16 channels, gather 5 ms against identity 55 ms and
# tf.image.extract_patches 19 ms).
_IDENTITY_CONV_MAX_CHANNELS = 8


def extract_patches(inputs, kernel_size, strides, dilation_rate, padding):
    """[B, *out_spatial, prod(kernel_size) * C] patches of channels-last inputs.

    Args:
        inputs: float tensor [B, *spatial, C] (1 to 3 spatial axes).
        kernel_size, strides, dilation_rate: tuples, one entry per axis.
        padding: "valid" or "same" (TensorFlow's split of "same" padding).
    """
    channels = inputs.shape[-1]
    spatial = inputs.shape[1:-1]
    if channels < _IDENTITY_CONV_MAX_CHANNELS or not spatial.is_fully_defined():
        size = int(np.prod(kernel_size)) * channels
        identity = tf.reshape(
            tf.eye(size, dtype=inputs.dtype), list(kernel_size) + [channels, size]
        )
        return tf.nn.convolution(
            inputs,
            identity,
            strides=list(strides),
            padding=padding.upper(),
            dilations=list(dilation_rate),
        )
    return _gather_patches(inputs, kernel_size, strides, dilation_rate, padding)


def patch_geometry(size, kernel, stride, dilation, padding):
    """(output size, padding before, padding after) of one axis, as TF pads."""
    span = (kernel - 1) * dilation + 1
    if padding == "same":
        out = -(-size // stride)
        total = max((out - 1) * stride + span - size, 0)
        return out, total // 2, total - total // 2
    return (size - span) // stride + 1, 0, 0


def _gather_patches(inputs, kernel_size, strides, dilation_rate, padding):
    """Patches by one tf.gather over the padded input's positions (static shape)."""
    rank = len(kernel_size)
    spatial = list(inputs.shape[1:-1])
    channels = inputs.shape[-1]
    geometry = [
        patch_geometry(n, k, s, d, padding)
        for n, k, s, d in zip(spatial, kernel_size, strides, dilation_rate)
    ]
    padded = [n + before + after for n, (_, before, after) in zip(spatial, geometry)]
    # index[o_1..o_n, k_1..k_n] of the flat padded position each patch entry reads.
    index = np.zeros([g[0] for g in geometry] + list(kernel_size), np.int64)
    place = 1
    for axis in reversed(range(rank)):
        out = geometry[axis][0]
        along = np.arange(out) * strides[axis]
        offsets = np.arange(kernel_size[axis]) * dilation_rate[axis]
        shape = [1] * (2 * rank)
        shape[axis] = out
        position = along.reshape(shape)
        shape = [1] * (2 * rank)
        shape[rank + axis] = kernel_size[axis]
        index = index + (position + offsets.reshape(shape)) * place
        place *= padded[axis]
    outputs = [g[0] for g in geometry]
    index = index.reshape(int(np.prod(outputs)), int(np.prod(kernel_size)))
    pads = [[0, 0]] + [[b, a] for _, b, a in geometry] + [[0, 0]]
    flat = tf.reshape(tf.pad(inputs, pads), [tf.shape(inputs)[0], -1, channels])
    patches = tf.gather(flat, tf.constant(index, tf.int32), axis=1)
    return tf.reshape(
        patches,
        [tf.shape(inputs)[0]] + outputs + [int(np.prod(kernel_size)) * channels],
    )


def as_rows(tensor):
    """[B, ..., C] as [B, S, C], S static when the middle dimensions are.

    A static S lets `LinearGrads` choose ghost norms or the one-position
    shortcut while tracing (with S unknown it materialises per-example
    matrices).
    """
    middle = tensor.shape[1:-1]
    positions = middle.num_elements() if middle.is_fully_defined() else -1
    return tf.reshape(tensor, [tf.shape(tensor)[0], positions, tensor.shape[-1]])


def channels_last(tensor, data_format):
    """`tensor` in channels-last layout (a no-op for "channels_last")."""
    if data_format == "channels_last":
        return tensor
    rank = tensor.shape.rank
    return tf.transpose(tensor, [0] + list(range(2, rank)) + [1])
