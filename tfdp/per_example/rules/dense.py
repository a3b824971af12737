"""Rules for Dense and EinsumDense: Z = X W + b at every position.

Example i's kernel gradient is X_i^T G_i over its positions (`LinearGrads`),
G the gradient at the pre-activation. EinsumDense covers MultiHeadAttention's
projections: its equation is rearranged into that matrix form.

Example:

>>> import keras
>>> rule_for_einsum = EinsumDenseRule()
>>> layer = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 4))
>>> layer.build((None, 3, 5))
>>> rule_for_einsum.supports(layer)
True
"""

import math

import keras
import tensorflow as tf

from tfdp.per_example.grads import LinearGrads, MaterializedGrads
from tfdp.per_example.patches import as_rows
from tfdp.per_example.registry import register_rule
from tfdp.per_example.rules.common import (
    PreActivationRule,
    concat_positions,
    plain_weights,
    sum_per_example,
)


@register_rule(keras.layers.Dense)
class DenseRule(PreActivationRule):
    """Dense on inputs of any rank: positions are all axes but batch and last."""

    def parts(self, layer, records):
        x = concat_positions([as_rows(r.x) for r in records])
        g = concat_positions([as_rows(r.grads["z"]) for r in records])
        return [LinearGrads(x, g, layer.kernel, layer.bias)]


def _einsum_matrix_form(equation):
    """How an EinsumDense equation "x,w->out" reads as rows @ matrix.

    Returns (x_perm, free, contracted, w_perm, w_out) or None: X transposed by
    `x_perm` is [batch, free..., contracted...]; W transposed by `w_perm` is
    [contracted..., w_out...]; the output transposed to [batch, free...,
    w_out...] is their product. None when the equation has another shape
    (a kernel axis that is also a batch-like axis of the output).
    """
    inputs, out = equation.replace(" ", "").split("->")
    x, w = inputs.split(",")
    if "." in equation or len(set(x)) != len(x) or len(set(w)) != len(w):
        return None
    batch = x[0]
    if batch in w or batch != out[0]:
        return None
    contracted = [c for c in x if c in w and c not in out]
    free = [c for c in x[1:] if c in out and c not in w]
    w_out = [c for c in w if c in out and c not in x]
    if any(c not in out and c not in w for c in x[1:]) or any(
        c in x and c in w and c in out for c in out
    ):
        return None
    if set(out) != set([batch] + free + w_out) or set(w) != set(contracted + w_out):
        return None
    x_perm = [x.index(c) for c in [batch] + free + contracted]
    w_perm = [w.index(c) for c in contracted + w_out]
    out_perm = [out.index(c) for c in [batch] + free + w_out]
    return x_perm, len(free), len(contracted), w_perm, out_perm


@register_rule(keras.layers.EinsumDense)
class EinsumDenseRule(PreActivationRule):
    """EinsumDense as rows @ matrix; its bias gets its own (small) part."""

    def supports(self, layer):
        return plain_weights(layer) and _einsum_matrix_form(layer.equation) is not None

    def parts(self, layer, records):
        parts = [einsum_linear_grads(layer.equation, [r.x for r in records],
                                     [r.grads["z"] for r in records], layer.kernel)]
        if layer.bias is not None:
            biases = [sum_to_shape(r.grads["z"], layer.bias.shape) for r in records]
            parts.append(MaterializedGrads([layer.bias], [sum_per_example(biases)]))
        return parts


def einsum_linear_grads(equation, xs, gs, kernel):
    """`LinearGrads` of Z = einsum(equation, X, kernel) over several calls.

    Args:
        equation: an EinsumDense equation with a matrix form.
        xs: the inputs X of each call; gs: the gradients at each call's Z.
        kernel: the variable the equation contracts X with.
    """
    x_perm, _, n_contracted, w_perm, out_perm = _einsum_matrix_form(equation)
    kernel_shape = [kernel.shape[p] for p in w_perm]
    fan_in = math.prod(kernel_shape[:n_contracted])
    fan_out = math.prod(kernel_shape[n_contracted:])
    rows_x, rows_g = [], []
    for x, g in zip(xs, gs):
        x = tf.transpose(x, x_perm)
        g = tf.transpose(g, out_perm)
        rows_x.append(tf.reshape(x, [tf.shape(x)[0], -1, fan_in]))
        rows_g.append(tf.reshape(g, [tf.shape(g)[0], -1, fan_out]))
    return LinearGrads(concat_positions(rows_x), concat_positions(rows_g), kernel,
                       kernel_perm=w_perm)


def sum_to_shape(grad, shape):
    """Per-example gradient [B, *shape] of a bias broadcast into `grad` [B, ...]."""
    shape = list(shape)
    rank = grad.shape.rank - 1
    aligned = [1] * (rank - len(shape)) + shape
    axes = [1 + i for i, (n, m) in enumerate(zip(aligned, grad.shape[1:])) if n == 1 and m != 1]
    axes += [1 + i for i in range(rank - len(shape))]
    summed = tf.reduce_sum(grad, axis=sorted(set(axes)), keepdims=True)
    return tf.reshape(summed, [-1] + shape)
