"""Weightless Keras operations as Functional graph nodes
(`tfdp.per_example.graph_operations`) and merge layers of unequal ranks:
the batched path where a node keeps examples independent and the batch on
axis 0, the exact vectorized path where it does not, named.

Each allowed node is checked against the exact path with an outlier beside
the example; each refused one is a configuration that would mix examples
or move the batch axis. The broadcasting attacks ([B, T, D] + [B, 1] with
B == T) are measured on the compiled step (`NeighbourStep`, noise 0): the
batched path moved a neighbouring step 3.8 times its bound there."""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.auditing.neighbour_step import NeighbourStep
from tfdp.models.losses import per_example_loss
from tfdp.per_example import compute_per_example_gradients, plan_for

O = keras.ops
L = keras.layers


def _example_0_grads(model, inputs, y, method):
    """Example 0's per-example gradients with example 1 ordinary, then an
    outlier (1000 times its input)."""
    outlier = inputs.copy()
    outlier[1] = outlier[1] * 1e3
    return [
        [g.numpy()[0] for g in compute_per_example_gradients(
            model, tf.constant(batch), tf.constant(y), tf.ones([len(y)]),
            per_example_loss("mse"), method)[0].materialize()]
        for batch in (inputs, outlier)
    ]


def _model(middle, shape=(4, 3)):
    """Dense on inputs of `shape`, `middle`, then Flatten and Dense(2)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape)
    h = O.sigmoid(L.Dense(3)(inputs)) + 0.5
    return keras.Model(inputs, L.Dense(2)(L.Flatten()(middle(h))))


def _data(shape=(4, 3), batch=4):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(batch, *shape)).astype(np.float32),
            rng.normal(size=(batch, 2)).astype(np.float32))


def _check_batched_and_exact(model, shape=(4, 3)):
    assert plan_for(model).path == "batched", plan_for(model).describe()
    x, y = _data(shape)
    batched = _example_0_grads(model, x, y, "batched")
    exact = _example_0_grads(model, x, y, "vectorized")
    for before, after, reference in zip(*batched, exact[0]):
        np.testing.assert_allclose(before, reference, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(before, after, rtol=1e-5, atol=1e-6)


# Elementwise operations, each on positive inputs t (its domain) and named
# as the class Keras 3 gives its node.
ELEMENTWISE_NODES = {
    "Absolute": lambda t: abs(t - 1.0),
    "Sign": lambda t: t * O.sign(t - 1.0),
    "Rsqrt": O.rsqrt, "Reciprocal": O.reciprocal, "Expm1": O.expm1, "Log1p": O.log1p,
    "Sin": O.sin, "Cos": O.cos, "Tan": lambda t: O.tan(t / 4.0), "Arctan": O.arctan,
    "Sinh": O.sinh, "Erf": O.erf,
    "Floor": lambda t: t + O.floor(t * 3.0), "Ceil": lambda t: t + O.ceil(t * 3.0),
    "Round": lambda t: t + O.round(t * 3.0), "Clip": lambda t: O.clip(t, 0.6, 1.2),
    "NanToNum": O.nan_to_num, "HardSigmoid": O.hard_sigmoid, "LogSigmoid": O.log_sigmoid,
    "Softsign": O.softsign, "LeakyRelu": lambda t: O.leaky_relu(t - 1.0),
    "HardSilu": O.hard_silu, "Mod": lambda t: O.mod(t, 0.7 + 0.0 * t),
    "FloorDivide": lambda t: t + O.floor_divide(t, 0.3 + 0.0 * t),
    "Isnan": lambda t: O.where(O.isnan(t), 0.0, t),
    "Isfinite": lambda t: O.where(O.isfinite(t), t, 0.0),
    "LogicalXor": lambda t: O.where(O.logical_xor(t > 1.0, t > 1.2), t, -t),
    "ConvertToTensor": lambda t: O.convert_to_tensor(t, dtype="float32"),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE_NODES))
def test_an_elementwise_operation_node_keeps_the_batched_path(name):
    """These sent their models to the vectorized path before they were
    allowed (`abs` was listed as "Abs", a name no Keras node has)."""
    model = _model(ELEMENTWISE_NODES[name])
    assert name in {type(op).__name__ for op in model.operations}
    _check_batched_and_exact(model)


# Operations along axes, inserting or moving axes: allowed away from axis 0.
ALLOWED_NODES = {
    "softmax": lambda t: O.softmax(t, axis=-1),
    "log_softmax over positions": lambda t: O.log_softmax(t, axis=1),
    "logsumexp": lambda t: O.expand_dims(O.logsumexp(t, axis=-1), -1),
    "norm": lambda t: O.expand_dims(O.norm(t, axis=-1), -1),
    "std and var": lambda t: O.stack([O.std(t, axis=1), O.var(t, axis=1)], axis=1),
    "prod": lambda t: O.prod(t, axis=2, keepdims=True),
    "cumsum": lambda t: O.cumsum(t, axis=1),
    "sort": lambda t: O.sort(t, axis=-1),
    "flip": lambda t: O.flip(t, axis=1),
    "repeat": lambda t: O.repeat(t, 2, axis=1),
    "concatenate": lambda t: O.concatenate([t, t * t], axis=-1),
    "expand_dims then squeeze": lambda t: O.squeeze(O.expand_dims(t, 2), axis=2),
    "one_hot of argmax": lambda t: t * O.sum(O.one_hot(O.argmax(t, axis=-1), 3), -1,
                                             keepdims=True),
    "transpose": lambda t: O.transpose(t, (0, 2, 1)),
    "swapaxes": lambda t: O.swapaxes(t, 1, 2),
    "moveaxis": lambda t: O.moveaxis(t, 2, 1),
    "matmul": lambda t: O.matmul(t, O.transpose(t, (0, 2, 1))),
    "reshape": lambda t: O.reshape(t, (-1, 12)),
    "pad": lambda t: O.pad(t, ((0, 0), (1, 1), (0, 0))),
    "tile": lambda t: O.tile(t, (1, 2, 1)),
    "x[..., 0]": lambda t: t[..., :2] * t[..., 0:1],
    "x[..., None]": lambda t: O.squeeze(t[..., None], -1),
    "reshape to NumPy sizes": lambda t: O.reshape(t, (-1, np.int64(12))),
    "matmul by a constant matrix": lambda t: O.matmul(t, np.eye(3, 2, dtype="float32")),
    "a constant with a first axis of 1": lambda t: t * np.full((1, 4, 3), 2.0, "float32"),
    "a constant first": lambda t: O.multiply(np.full(3, 2.0, "float32"), t),
    "clip to constant bounds per feature": lambda t: O.clip(t, 0.6, np.full(3, 1.2, "float32")),
    "max with an initial value per feature": lambda t: O.max(
        t, axis=1, initial=np.full(3, 1.1, "float32"))[:, None] * t,
}


@pytest.mark.parametrize("name", sorted(ALLOWED_NODES))
def test_an_operation_away_from_the_batch_axis_keeps_the_batched_path(name):
    _check_batched_and_exact(_model(ALLOWED_NODES[name]))


# One [4, 3] array per batch position: TensorFlow stacks the list into one
# [4, 4, 3] constant (a review moved a neighbouring step up to 2.37x its
# bound through lists of arrays, read one array at a time).
_ROWS = [np.full((4, 3), v, np.float32) for v in (-2.0, 2.0, -2.0, 2.0)]


# The same operations on the batch axis, or moving it: each would mix
# examples, or put another axis where the batched pass reads the batch.
REFUSED_NODES = {
    "softmax over the batch": lambda t: O.softmax(t, axis=0),
    "logsumexp over all axes": lambda t: t + O.logsumexp(t),
    "sort flattened": lambda t: O.reshape(O.sort(t, axis=0), (-1, 4, 3)),
    "flip every axis": lambda t: O.flip(t),
    "cumsum flattened": lambda t: O.reshape(O.cumsum(t), (-1, 4, 3)),
    "concatenate over the batch": lambda t: O.concatenate([t, t], axis=0),
    "expand_dims in front": lambda t: O.sum(O.expand_dims(t, 0), axis=1),
    "stack in front": lambda t: O.sum(O.stack([t, t], axis=0), axis=1),
    "squeeze every unit axis": lambda t: O.squeeze(O.expand_dims(t, -1)),
    "transpose the batch away": lambda t: O.transpose(O.transpose(t, (1, 0, 2)), (1, 0, 2)),
    "transpose reversed": lambda t: O.transpose(O.transpose(t)),
    "swapaxes with the batch": lambda t: O.swapaxes(O.swapaxes(t, 0, 1), 0, 1),
    "matmul with a rank-2 operand": lambda t: O.sum(O.matmul(t, O.transpose(t[:, 0])), axis=-1,
                                                    keepdims=True),
    "reshape folding the batch": lambda t: O.reshape(O.reshape(t, (3, -1)), (-1, 4, 3)),
    "pad the batch": lambda t: O.pad(t, ((1, 1), (0, 0), (0, 0))),
    "tile the batch": lambda t: O.tile(t, (2, 1, 1)),
    "densify a ragged tensor": lambda t: O.convert_to_tensor(t, ragged=False),
    "densify a sparse tensor": lambda t: O.convert_to_tensor(t, sparse=False),
    "broadcast a lower rank": lambda t: t + t[:, 0, 0:1],
    "a constant row per batch position": lambda t: t * np.array([1, 0, 1, 0], "float32").reshape(
        4, 1, 1),
    "a constant row per batch position, concatenated": lambda t: O.concatenate(
        [t, np.ones((4, 4, 3), "float32")], axis=-1),
    "nan_to_num with a replacement per batch position": lambda t: O.nan_to_num(
        t, nan=np.ones((4, 1, 1, 1), "float32")),
    "clip bounds per batch position": lambda t: O.clip(t, -10.0, np.full((4, 1, 1), 2.0,
                                                                         "float32")),
    "a replacement per batch position as nested lists": lambda t: O.nan_to_num(
        t, nan=[[[[1.0]]]] * 4),
    "an elu alpha per batch position": lambda t: O.elu(t - 3.0, alpha=[[[0.0]], [[10.0]],
                                                                       [[0.0]], [[10.0]]]),
    "matmul by a batch-led matrix": lambda t: O.sum(O.matmul(t[:, 0], O.transpose(t[:, 0])),
                                                    axis=-1, keepdims=True)[:, None] * t,
    "broadcast a constant of higher rank": lambda t: O.mean(t + np.ones((4, 1, 1, 1), "float32"),
                                                           axis=1),
    "max with an initial value per batch position": lambda t: O.max(
        t, axis=1, initial=np.full((4, 3), 2.0, "float32"))[:, None] * t,
    "min with an initial value per batch position": lambda t: O.min(
        t, axis=1, initial=np.full((4, 3), 0.0, "float32"))[:, None] * t,
    "clip bounds per batch position, as a list of arrays": lambda t: O.clip(t, _ROWS, 100.0),
    "clip bounds per batch position, as a tuple of arrays": lambda t: O.clip(
        t, tuple(_ROWS), 100.0),
    "an elu alpha per batch position, as a list of arrays": lambda t: O.elu(t - 1.0, alpha=_ROWS),
    "max with an initial value per batch position, as a list of arrays": lambda t: O.max(
        t, axis=1, initial=[row[0] for row in _ROWS])[:, None] * t,
}


@pytest.mark.parametrize("name", sorted(REFUSED_NODES))
def test_an_operation_on_the_batch_axis_is_named(name):
    plan = plan_for(_model(REFUSED_NODES[name]))
    assert plan.path == "vectorized", plan.describe()
    assert "is not known to keep examples independent" in plan.reason


def test_where_with_a_condition_alone_is_refused():
    """`where(condition)` returns the coordinates of its True entries, over
    the whole batch."""
    from tfdp.per_example.registry import node_is_per_example

    inputs = keras.Input((4, 3))
    coordinates = O.where(inputs > 1.0)
    node = coordinates._keras_history[0]._inbound_nodes[0]
    assert not node_is_per_example(node)
    chosen = O.where(inputs > 1.0, inputs, 0.0)
    assert node_is_per_example(chosen._keras_history[0]._inbound_nodes[0])


MERGES = {"Add": L.Add, "Subtract": L.Subtract, "Multiply": L.Multiply,
          "Average": L.Average, "Maximum": L.Maximum, "Minimum": L.Minimum}


@pytest.mark.parametrize("name", sorted(MERGES))
def test_a_merge_of_unequal_ranks_is_named(name):
    """[B, T, D] merged with [B, 1]: Keras broadcasts from the right, the
    second input's batch axis against T."""
    model = _model(lambda t: MERGES[name]()([t, t[:, 0, 0:1]]))
    plan = plan_for(model)
    assert plan.path == "vectorized" and "broadcasts inputs of ranks [3, 2]" in plan.reason, \
        plan.describe()


@pytest.mark.parametrize("name", sorted(MERGES))
def test_a_merge_of_equal_ranks_keeps_the_batched_path(name):
    _check_batched_and_exact(_model(lambda t: MERGES[name]()([t, t * t])))


def _neighbour_ratio(middle):
    """Largest ||update(D') - update(D)|| over its bound, for records far
    outside the data, added and replaced, batch of 4 = the sequence length."""
    model = tfdp.DPModel(*_graph(middle))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    data = _data(batch=3)
    ratios = []
    with NeighbourStep(model, data, records=3, batch_size=4, physical_batch_size=None) as step:
        for scale in (1e2, 1e4):
            record = (np.full((4, 3), scale, np.float32), np.zeros(2, np.float32))
            ratios += [step.ratio(record, relation)
                       for relation in ("add", "add, record first", "replace")]
    return max(ratios), model.per_example_path


def _graph(middle, head=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 3))
    scalar = L.Dense(1)(L.GlobalAveragePooling1D()(inputs))  # [B, 1]
    h = middle(inputs, scalar)
    if head is not None:
        return inputs, head(h)
    return inputs, L.Dense(2)(L.Flatten()(L.Dense(3)(h)))


@pytest.mark.parametrize("middle", [
    lambda x, s: x + s,
    lambda x, s: L.Add()([x, s]),
], ids=["operation", "layer"])
def test_a_broadcast_of_unequal_ranks_keeps_the_step_bound(middle):
    """With B == T, example t's scalar lands on every example's position t on
    the batched path (3.8 times the bound before ranks were read); the
    vectorized path keeps each example alone."""
    ratio, path = _neighbour_ratio(middle)
    assert "vectorized" in path, path
    assert ratio <= 1.0 + 1e-5, ratio


def test_a_ragged_text_vectorization_is_named():
    """Its rows keep their own lengths, and densifying them pads every row
    to the batch's longest (a review moved a neighbouring step 6.8x the
    bound of a replacement through `convert_to_tensor(..., ragged=False)`,
    allowed at the time)."""
    texts = keras.Input((), dtype="string")
    vectorize = L.TextVectorization(vocabulary=["a", "b", "c"], ragged=True,
                                    output_sequence_length=8)
    h = L.GlobalAveragePooling1D()(L.Embedding(5, 4)(vectorize(texts)))
    plan = plan_for(keras.Model(texts, L.Dense(1)(h)))
    assert plan.path == "vectorized" and "text_vectorization" in plan.reason, plan.describe()


def test_a_rescaling_that_broadcasts_against_the_batch_is_named():
    """A scale of shape [4, 1, 1, 1] on [B, 4, 3] inputs gives [4, B, 4, 3]
    at run time while Keras reports [B, 4, 3]: a mean over axis 1 then
    averages over the batch (it moved example 0's gradient with example 1
    on the batched path). A per-channel scale keeps the batched path."""
    def model(scale):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4, 3))
        h = L.Dense(2)(L.Rescaling(scale=scale)(inputs))
        return keras.Model(inputs, O.mean(h, axis=(1, 2)))

    plan = plan_for(model(np.linspace(0.5, 1.5, 4, dtype=np.float32).reshape(4, 1, 1, 1)))
    assert plan.path == "vectorized" and "broadcasts scale of shape (4, 1, 1, 1)" in plan.reason, \
        plan.describe()
    assert plan_for(model(np.array([0.5, 1.0, 2.0], np.float32))).path == "batched"


class Add(keras.Operation):
    """A user's operation named like Keras's elementwise Add, which mixes
    examples (a batch mean)."""

    def call(self, x, y):
        return x + keras.ops.mean(y, axis=0, keepdims=True)

    def compute_output_spec(self, x, y):
        return keras.KerasTensor(x.shape, x.dtype)


def test_a_users_operation_named_like_a_keras_one_is_named():
    """Names are read for Keras's own operation classes only (a review moved
    a neighbouring step 2.8x its bound with this one on the batched path)."""
    inputs = keras.Input((3,))
    h = L.Dense(3)(inputs)
    plan = plan_for(keras.Model(inputs, L.Dense(1)(Add()(h, h))))
    assert plan.path == "vectorized" and "(Add) is not known" in plan.reason, plan.describe()


def test_multi_head_attention_reads_its_querys_own_mask():
    """Keras's MultiHeadAttention takes the query's own mask and drops a
    query_mask argument: an explicit one hid a batch-led mask from Masking
    (a review moved a neighbouring step 1.74x its bound)."""
    inputs = keras.Input((4, 4, 3))
    masked = L.Masking(0.0)(inputs)
    h = L.MultiHeadAttention(1, 2, attention_axes=(1, 2))(masked, L.Dense(3)(inputs),
                                                           query_mask=True)
    plan = plan_for(keras.Model(inputs, L.Dense(2)(L.Flatten()(h))))
    assert plan.path == "vectorized" and "query mask with 2 attention axes" in plan.reason, \
        plan.describe()


def _layer_model(middle, batch_size=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 3), batch_size=batch_size)
    return keras.Model(inputs, L.Dense(2)(L.Flatten()(middle(L.Dense(3)(inputs)))))


def _shared_softmax(t):
    softmax = L.Softmax(axis=-2)
    softmax(keras.Input((2, 4, 3)))  # built at rank 4: axis -2 is a feature axis there
    return softmax(t[:, 0])[:, None] * t  # at rank 2 it is the batch axis


CONFIGURED_LAYERS = {
    "a Masking value per batch position": (
        lambda t: L.Masking(mask_value=np.ones((4, 1, 1, 1), "float32"))(t),
        "broadcasts mask_value of shape (4, 1, 1, 1)"),
    "a dropout mask of another rank": (
        lambda t: L.Dropout(0.5, noise_shape=(4, 1, 1, 1))(t), "draws a dropout mask"),
    "a Normalization statistic per batch position": (
        lambda t: L.Normalization(axis=(0, 2), mean=np.ones((4, 3)), variance=np.ones((4, 3)))(t),
        "keeps a statistic per position of the batch axis"),
    "a Rescaling built at rank 5, called at rank 3": (
        lambda t: _rescaling_built_at_rank_5()(t), "broadcasts scale of shape (4, 1, 1, 1)"),
    "a Softmax built at rank 4, called at rank 2": (
        _shared_softmax, "reduces over the batch axis"),
    "an Add layer with a constant per batch position": (
        lambda t: L.Add()([t, np.ones((4, 1, 1), "float32")]), "lines up with the batch axis"),
    "a Concatenate layer with a constant per batch position": (
        lambda t: L.Concatenate()([t, np.ones((4, 4, 3), "float32")]), "lines up with the batch axis"),
    "a constant mask per batch position": (
        lambda t: L.GlobalAveragePooling1D()(t, mask=np.eye(4, dtype=bool))[:, None] * t,
        "lines up with the batch axis"),
    "a constant mask per batch position, as nested lists": (
        lambda t: L.Attention()([t, t], mask=[None, np.eye(4, dtype=bool).tolist()]),
        "lines up with the batch axis"),
    "a constant mask per batch position, by position": (
        lambda t: L.GlobalAveragePooling1D()(t, np.eye(4, dtype=bool))[:, None] * t,
        "lines up with the batch axis"),
    "a constant mask per batch position, as 0-d arrays": (
        lambda t: L.Attention()([t, t], mask=[None, [[np.array(bool(v)) for v in row]
                                                    for row in np.eye(4)]]),
        "lines up with the batch axis"),
    "an initial state per batch position": (
        lambda t: L.SimpleRNN(3, return_sequences=True)(
            t, initial_state=5.0 * np.eye(4, 3, dtype="float32")),
        "lines up with the batch axis"),
    "an Attention over a constant per batch position": (
        lambda t: L.Attention()([t, np.ones((4, 4, 3), "float32")]), "lines up with the batch axis"),
    "KerasHub's rotary positions per batch position": (
        lambda t: keras_hub.layers.RotaryEmbedding()(L.Dense(4)(t), positions=np.tile(
            np.arange(4), (4, 1))), "lines up with the batch axis"),
    "KerasHub's position embedding at positions per batch position": (
        lambda t: keras_hub.layers.PositionEmbedding(4)(t, positions=np.tile(
            np.arange(4), (4, 1))) + t, "lines up with the batch axis"),
    "KerasHub's constant padding mask per batch position": (
        lambda t: keras_hub.layers.TransformerEncoder(4, 1)(
            t, padding_mask=np.tril(np.ones((4, 4), bool))), "lines up with the batch axis"),
    "KerasHub's rotary positions per batch position, as a list of arrays": (
        lambda t: keras_hub.layers.RotaryEmbedding()(L.Dense(4)(t)[:, :1], positions=[
            np.array([v]) for v in (0, 7, 2, 9)]), "lines up with the batch axis"),
    "an initial state per batch position, as a list of rows": (
        lambda t: L.SimpleRNN(1, return_sequences=True)(t, initial_state=[[
            np.array([v], np.float32) for v in (-3.0, 3.0, -3.0, 3.0)]]),
        "lines up with the batch axis"),
    "a LayerNormalization epsilon per batch position": (
        lambda t: L.LayerNormalization(epsilon=np.array([1e-3, 1.0, 1e-3, 1.0], "float32").reshape(
            4, 1, 1))(t), "broadcasts epsilon of shape (4, 1, 1)"),
    "an RMSNormalization epsilon per batch position": (
        lambda t: L.RMSNormalization(epsilon=np.ones((4, 1, 1), "float32"))(t),
        "broadcasts epsilon of shape (4, 1, 1)"),
    "a constant mask that converts to an array per batch position": (
        lambda t: L.MultiHeadAttention(1, 2)(t, t, value_mask=_ArrayOnly(np.eye(4, dtype=bool))),
        "lines up with the batch axis"),
    "a declared MultiHeadAttention's rank-2 mask": (
        lambda t: _PaddingMaskAttention(1, 2)(t, t, attention_mask=np.eye(4, dtype=bool)),
        "lines up with the batch axis"),
    "a MultiHeadAttention mask per batch position": (
        lambda t: L.MultiHeadAttention(1, 2)(t, t, attention_mask=np.stack(
            [np.eye(4, dtype=bool), np.ones((4, 4), bool)] * 2)), "lines up with the batch axis"),
    "a declared layer's positional constant": (
        lambda t: _PositionalMaskPooling()(t, np.eye(4, dtype="float32"))[:, None] * t,
        "lines up with the batch axis"),
}


class _ArrayOnly:
    """An array behind `__array__` alone (no `shape`), as TensorFlow converts it."""

    def __init__(self, array):
        self.array = array

    def __array__(self, dtype=None, copy=None):
        return self.array if dtype is None else self.array.astype(dtype)


@tfdp.per_example.declare_per_example
class _PaddingMaskAttention(L.MultiHeadAttention):
    """A MultiHeadAttention that reads a rank-2 attention mask as one
    padding mask per example ([B, S]), not as Keras's [T, S]."""

    def call(self, query, value, key=None, attention_mask=None, **kwargs):
        return super().call(query, value, key, attention_mask=attention_mask[:, None, :], **kwargs)


@tfdp.per_example.declare_per_example
class _PositionalMaskPooling(L.Layer):
    """Averages each example's positions under its own row of a mask,
    passed by position through `*args` (no parameter named mask)."""

    def call(self, inputs, *args):
        weights = args[0][:, :, None]
        return O.sum(inputs * weights, axis=1) / (O.sum(weights, axis=1) + 1.0)


def _rescaling_built_at_rank_5():
    layer = L.Rescaling(np.linspace(0.5, 1.5, 4, dtype=np.float32).reshape(4, 1, 1, 1))
    layer(keras.Input((1, 1, 4, 3)))
    return layer


@pytest.mark.parametrize("name", sorted(CONFIGURED_LAYERS))
def test_a_layer_with_a_constant_on_the_batch_axis_is_named(name):
    """Constants a layer broadcasts against its input, or is called with,
    that meet the batch axis; and a layer read at every rank it is called
    at (a review moved a neighbouring step 4.0x its bound through Masking
    and 4.17x through a Rescaling built at another rank, and 1.07x through
    an Attention over a constant with a record inserted first)."""
    middle, reason = CONFIGURED_LAYERS[name]
    plan = plan_for(_layer_model(middle, batch_size=4))
    assert plan.path == "vectorized" and reason in plan.reason, plan.describe()


def test_a_constant_that_puts_an_axis_before_the_batch_keeps_the_step_bound():
    """nan_to_num(t, nan=c) with c of shape [4, 1, 1, 1] gives [4, B, 4, 3]
    while Keras reports [B, 4, 3]; a mean over axes 1 and 2 then averages
    over the batch (4.0x the bound on the batched path, when the operation's
    own constants were not read)."""
    model = tfdp.DPModel(*_graph(lambda x, s: L.Dense(2)(O.nan_to_num(
        x, nan=np.ones((4, 1, 1, 1), "float32"))), head=lambda h: O.mean(h, axis=(1, 2))))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    x, y = _data(batch=3)
    ratios = []
    with NeighbourStep(model, (x, y), records=3, batch_size=4, physical_batch_size=None) as step:
        for scale in (1e2, 1e4):
            record = (np.full((4, 3), scale, np.float32), np.zeros(2, np.float32))
            ratios += [step.ratio(record, relation)
                       for relation in ("add", "add, record first", "replace")]
    assert "vectorized" in model.per_example_path, model.per_example_path
    assert max(ratios) <= 1.0 + 1e-5, max(ratios)


POSITION_DEPENDENT = {
    "max with an initial value per batch position": lambda t: O.max(
        t, axis=1, initial=np.linspace(-1.0, 2.0, 12, dtype="float32").reshape(4, 3))[:, None] * t,
    "KerasHub's rotary positions per batch position": lambda t: keras_hub.layers.RotaryEmbedding()(
        L.Dense(4)(t), positions=np.arange(16).reshape(4, 4) * 3),
    "a LayerNormalization epsilon per batch position": lambda t: L.LayerNormalization(
        epsilon=np.array([1e-3, 10.0, 1e-3, 10.0], "float32").reshape(4, 1, 1))(t),
}


@pytest.mark.parametrize("name", sorted(POSITION_DEPENDENT))
def test_a_record_inserted_first_moves_no_other_examples_gradient(name):
    """A constant whose rows give each example a value by its position in
    the batch: a record inserted first shifts every other example to the
    next row (a review moved a neighbouring step 1.77x its bound through
    max's `initial`, 1.87x through KerasHub's rotary `positions`, 2.61x
    through a LayerNormalization's epsilon). The exact path gives each
    example the same gradient either way."""
    model = _model(POSITION_DEPENDENT[name])
    x, y = _data(batch=3)
    record = (np.full((1, 4, 3), 50.0, np.float32), np.zeros((1, 2), np.float32))
    padded = (np.concatenate([x, x[:1]]), np.concatenate([y, y[:1]]), [1.0, 1.0, 1.0, 0.0])
    inserted = (np.concatenate([record[0], x]), np.concatenate([record[1], y]), [1.0] * 4)
    grads = [
        [g.numpy() for g in compute_per_example_gradients(
            model, tf.constant(inputs), tf.constant(targets), tf.constant(weights),
            per_example_loss("mse"))[0].materialize()]
        for inputs, targets, weights in (padded, inserted)
    ]
    for alone, shifted in zip(*grads):
        np.testing.assert_allclose(shifted[1:], alone[:3], rtol=1e-5, atol=1e-6)
    assert plan_for(model).path == "vectorized", plan_for(model).describe()


def test_a_model_that_cannot_run_on_one_example_is_named_before_the_first_step():
    """A constant with one row per batch position cannot run on one example,
    which fit builds the model on and the exact path runs: Keras raised its
    own broadcasting error, which said nothing of why a batch of one ran."""
    model = tfdp.DPModel(*_graph(lambda x, s: O.elu(x - 1.0, alpha=_ROWS)))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    x, y = _data(batch=8)
    before = [w.numpy() for w in model.trainable_weights]
    with pytest.raises(ValueError, match="(?s)fails on a batch of one example.*Elu.*first axis of 1"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert model.privacy.steps == 0
    for w, old in zip(model.trainable_weights, before):
        np.testing.assert_array_equal(w.numpy(), old)
