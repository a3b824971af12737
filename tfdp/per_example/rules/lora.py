"""Rules for LoRA-enabled Dense, EinsumDense and Embedding (Keras `enable_lora`).

LoRA replaces the kernel W by W + s A B (s = lora_alpha / rank, A and B the
small trainable factors, W frozen). The rule computes the layer's output as
X W + s (X A) B (+ bias), probing U = X A and the pre-activation Z, so that

* example i's gradient of A is X_i^T G_U,i with G_U = s G_Z B^T (autodiff
  gives it at the probe): a `LinearGrads` on recorded tensors;
* example i's gradient of B is (s U_i)^T G_Z,i: a `LinearGrads` too;

both factored, so ghost norms apply. Frozen weights (the base kernel, a frozen
bias) get no per-example work. For EinsumDense, A has the kernel's shape with
its last axis replaced by the rank and enters through the same equation; B
maps that axis to the kernel's last one. For Embedding, U is A's rows at the
ids (`EmbeddingGrads` for A).

Example:

>>> import keras
>>> layer = keras.layers.Dense(3)
>>> layer.build((None, 4))
>>> layer.enable_lora(2)
>>> LoraDenseRule().supports(layer)
True
"""

import keras
import tensorflow as tf

from tfdp.per_example.grads import LinearGrads, MaterializedGrads
from tfdp.per_example.patches import as_rows
from tfdp.per_example.registry import register_rule
from tfdp.per_example.rules.common import apply_activation, concat_positions, sum_per_example
from tfdp.per_example.rules.dense import _einsum_matrix_form, einsum_linear_grads, sum_to_shape
from tfdp.per_example.rules.embedding import EmbeddingGrads


def _scale(layer):
    return layer.lora_alpha / layer.lora_rank


def _lora_float32(layer):
    return (
        getattr(layer, "lora_enabled", False)
        and getattr(layer, "quantization_mode", None) is None
        and layer.compute_dtype == "float32"
        and all(v.dtype == "float32" for v in layer.variables)
    )


def _trainable(variable):
    return variable is not None and variable.trainable


def _bias_part(bias, grads):
    """Per-example bias gradients (small, materialized) or nothing if frozen."""
    if not _trainable(bias):
        return []
    return [MaterializedGrads([bias], [sum_per_example([sum_to_shape(g, bias.shape) for g in grads])])]


def _dense_output(layer, x, u):
    z = keras.ops.matmul(x, layer._kernel) + _scale(layer) * keras.ops.matmul(u, layer.lora_kernel_b)
    return z if layer.bias is None else z + layer.bias


@register_rule(keras.layers.Dense)
class LoraDenseRule:
    """Dense with LoRA: Z = X W + s (X A) B + b."""

    def supports(self, layer):
        return _lora_float32(layer)

    def call(self, layer, recorder, call, inputs, training=None):
        x = tf.convert_to_tensor(inputs)
        record = recorder.record(layer, x=x)
        u = record.probe("u", keras.ops.matmul(x, layer.lora_kernel_a))
        record.values["u"] = u
        return apply_activation(layer, record.probe("z", _dense_output(layer, x, u)))

    def parts(self, layer, records):
        x = concat_positions([as_rows(r.x) for r in records])
        u = concat_positions([as_rows(r.u) for r in records]) * _scale(layer)
        g_u = concat_positions([as_rows(r.grads["u"]) for r in records])
        g_z = concat_positions([as_rows(r.grads["z"]) for r in records])
        parts = []
        if _trainable(layer.lora_kernel_a):
            parts.append(LinearGrads(x, g_u, layer.lora_kernel_a))
        if _trainable(layer.lora_kernel_b):
            bias = layer.bias if _trainable(layer.bias) else None
            parts.append(LinearGrads(u, g_z, layer.lora_kernel_b, bias))
        else:
            parts += _bias_part(layer.bias, [r.grads["z"] for r in records])
        if _trainable(layer._kernel):
            parts.append(LinearGrads(x, g_z, layer._kernel))
        return parts


def _lora_einsum(equation):
    """(last kernel letter's axis in the output, equation applying B) or None
    when the kernel's last axis is not an output axis."""
    if _einsum_matrix_form(equation) is None:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    x, w = inputs.split(",")
    last = w[-1]
    if last in x or last not in out:
        return None
    fresh = next(c for c in "zyxwvutsrqponmlkjihgfedcba" if c not in equation)
    return out.index(last), f"{out},{last}{fresh}->{out.replace(last, fresh)}"


@register_rule(keras.layers.EinsumDense)
class LoraEinsumDenseRule:
    """EinsumDense with LoRA on a kernel whose last axis is an output axis
    (every projection of MultiHeadAttention and KerasHub's backbones)."""

    def supports(self, layer):
        return _lora_float32(layer) and _lora_einsum(layer.equation) is not None

    def call(self, layer, recorder, call, inputs, training=None):
        x = tf.convert_to_tensor(inputs)
        record = recorder.record(layer, x=x)
        u = record.probe("u", keras.ops.einsum(layer.equation, x, layer.lora_kernel_a))
        record.values["u"] = u
        _, apply_b = _lora_einsum(layer.equation)
        z = keras.ops.einsum(layer.equation, x, layer._kernel) + _scale(layer) * keras.ops.einsum(
            apply_b, u, layer.lora_kernel_b)
        if layer.bias is not None:
            z = z + layer.bias
        return apply_activation(layer, record.probe("z", z))

    def parts(self, layer, records):
        axis, _ = _lora_einsum(layer.equation)
        parts = []
        if _trainable(layer.lora_kernel_a):
            parts.append(einsum_linear_grads(layer.equation, [r.x for r in records],
                                             [r.grads["u"] for r in records], layer.lora_kernel_a))
        if _trainable(layer.lora_kernel_b):
            def rows(t):
                rank = t.shape.rank
                return as_rows(tf.transpose(t, [a for a in range(rank) if a != axis] + [axis]))

            u = concat_positions([rows(r.u) for r in records]) * _scale(layer)
            g = concat_positions([rows(r.grads["z"]) for r in records])
            parts.append(LinearGrads(u, g, layer.lora_kernel_b))
        parts += _bias_part(layer.bias, [r.grads["z"] for r in records])
        if _trainable(layer._kernel):
            parts.append(einsum_linear_grads(layer.equation, [r.x for r in records],
                                             [r.grads["z"] for r in records], layer._kernel))
        return parts


@register_rule(keras.layers.Embedding)
class LoraEmbeddingRule:
    """Embedding with LoRA: rows E[id] + s A[id] B."""

    def supports(self, layer):
        return _lora_float32(layer)

    def call(self, layer, recorder, call, inputs, **kwargs):
        ids = tf.cast(inputs, tf.int32)
        record = recorder.record(layer, ids=ids)
        u = record.probe("u", tf.gather(layer.lora_embeddings_a, ids))
        record.values["u"] = u
        rows = tf.gather(layer._embeddings, ids) + _scale(layer) * keras.ops.matmul(
            u, layer.lora_embeddings_b)
        return record.probe("rows", rows)

    def parts(self, layer, records):
        batch = [tf.shape(r.ids)[0] for r in records]
        ids = concat_positions([tf.reshape(r.ids, [b, -1]) for r, b in zip(records, batch)])
        rank, dim = layer.lora_rank, layer.output_dim
        u = concat_positions([tf.reshape(r.u, [b, -1, rank]) for r, b in zip(records, batch)])
        g_u = concat_positions([tf.reshape(r.grads["u"], [b, -1, rank]) for r, b in zip(records, batch)])
        g = concat_positions([tf.reshape(r.grads["rows"], [b, -1, dim]) for r, b in zip(records, batch)])
        parts = []
        if _trainable(layer.lora_embeddings_a):
            parts.append(EmbeddingGrads(ids, g_u, layer.lora_embeddings_a))
        if _trainable(layer.lora_embeddings_b):
            parts.append(LinearGrads(u * _scale(layer), g, layer.lora_embeddings_b))
        if _trainable(layer._embeddings):
            parts.append(EmbeddingGrads(ids, g, layer._embeddings))
        return parts
