"""The Keras layers and graph models a declared layer holds are read like a
graph's: when the plan is made at the ranks they recorded, and when the DP
step is traced at the ranks they really run on (`tfdp.per_example.declared`)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.auditing.neighbour_step import NeighbourStep
from tfdp.per_example import compute_per_example_gradients
from tfdp.per_example.declared import HeldLayerMixesExamples, held_calls_checked
from tfdp.per_example.plan import plan_for

L = keras.layers


def _mse(y_true, y_pred):
    return tf.reduce_sum(tf.square(y_true - y_pred), -1)


def _batched_pass(model, shape):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(4,) + shape), tf.float32)
    return compute_per_example_gradients(model, x, tf.zeros([4, 1]), tf.ones([4]), _mse,
                                         "batched")


def _ratio_or_refused(model, shape):
    """The largest neighbouring-step ratio (what one record moves the update,
    over its bound), or 0.0 where tfdp refuses the batched step (the plan,
    or the step when traced)."""
    keras.utils.set_random_seed(0)
    if plan_for(model).path == "vectorized":
        return 0.0
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0), loss="mse")
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(8,) + shape).astype("float32"),
            rng.normal(size=(8, 1)).astype("float32"))
    try:
        with NeighbourStep(model, data, records=7, batch_size=8, physical_batch_size=None) as step:
            return max(step.ratio((np.full(shape, s, "float32"), np.array([s], "float32")), rel)
                       for s in (1.0, 100.0, -100.0) for rel in ("add", "replace"))
    except HeldLayerMixesExamples as error:
        assert "batch axis" in str(error)
        return 0.0


def _scalar_weighting(make_norm):
    @tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
    class ScalarWeighting(L.Layer):
        """Declared, wrongly: a weightless Keras layer normalizing over the
        last axis of a [B] tensor, which is the batch."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.score = L.Dense(1)
            self.norm = make_norm()

        def call(self, x):
            return x * self.norm(self.score(x)[:, 0])[:, None]

    return ScalarWeighting()


NORMS = {"softmax": L.Softmax, "activation": lambda: L.Activation("softmax"),
         "unit": L.UnitNormalization}


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_a_held_layer_over_a_rank_1_batch_is_refused_when_the_step_is_traced(norm):
    model = keras.Sequential([keras.Input((8,)), _scalar_weighting(NORMS[norm]), L.Dense(1)])
    with pytest.raises(HeldLayerMixesExamples, match=r"batch axis.*ranks \[1\]"):
        _batched_pass(model, (8,))


def test_a_fit_through_such_a_block_is_refused_before_its_first_step():
    model = tfdp.DPSequential([keras.Input((8,)), _scalar_weighting(L.UnitNormalization),
                               L.Dense(1)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    with pytest.raises(HeldLayerMixesExamples):
        model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 0


class _Weighting(L.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.score, self.norm = L.Dense(1), L.UnitNormalization()


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _OnTheBatchInTraining(_Weighting):
    def call(self, x, training=None):  # the graph's node records no training=True
        s = self.score(x)
        return x * self.norm(s[:, 0])[:, None] if training else x * s


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _OnTheBatchWithStaticBatch(_Weighting):
    def call(self, x):  # the model's graph has no batch size, the step's may
        s = self.score(x)
        return x * self.norm(s) if x.shape[0] is None else x * self.norm(s[:, 0])[:, None]


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _Cell(_Weighting):
    """Run by keras.layers.RNN, never through the Functional API."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state_size, self.dense = 8, L.Dense(8)

    def call(self, x, states):
        h = self.dense(x) + states[0]
        h = h * self.norm(self.score(h)[:, 0])[:, None]
        return h, [h]


ROUTES = {
    "training": ((8,), lambda: tfdp.DPSequential(
        [keras.Input((8,)), _OnTheBatchInTraining(), L.Dense(1)])),
    "static_batch": ((8,), lambda: tfdp.DPSequential(
        [keras.Input((8,)), _OnTheBatchWithStaticBatch(), L.Dense(1)])),
    "rnn_cell": ((3, 8), lambda: tfdp.DPSequential(
        [keras.Input((3, 8)), L.RNN(_Cell(), unroll=True), L.Dense(1)])),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_held_layer_on_the_batch_by_a_route_the_graph_does_not_show_keeps_the_bound(route):
    """Branches on `training` or the static batch size, and a cell run by an
    RNN, run a held layer over the batch only in the step: a review moved a
    neighbouring step 2.4x to 6.2x its bound through them."""
    shape, make = ROUTES[route]
    assert _ratio_or_refused(make(), shape) <= 1 + 1e-5


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _AttentionPooling(L.Layer):
    """Legitimate: a softmax over the time axis (-2) of [B, T, 1]."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.score = L.Dense(1)
        self.softmax = L.Softmax(axis=-2)

    def call(self, x):
        return keras.ops.sum(self.softmax(self.score(x)) * x, axis=1)


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _ScalarMix(L.Layer):
    """Legitimate: a softmax over a learned [K] weight vector, not the batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.softmax, self.dense = L.Softmax(), [L.Dense(1) for _ in range(3)]

    def build(self, shape):
        self.logits = self.add_weight(shape=(3,), initializer="zeros", name="logits")

    def call(self, x):
        w = self.softmax(self.logits)
        return sum(w[i] * self.dense[i](x) for i in range(3))


@pytest.mark.parametrize("block, shape", [(_AttentionPooling, (6, 8)), (_ScalarMix, (8,))])
def test_legitimate_held_layers_keep_the_batched_path(block, shape):
    model = keras.Sequential([keras.Input(shape), block(), L.Dense(1)])
    assert plan_for(model).path == "batched", plan_for(model).reason
    grads, _, _ = _batched_pass(model, shape)
    assert grads.path == "batched"


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _HoldsCentering(L.Layer):
    """Declared, wrongly: holds a Functional model with a batch-mean node."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        inputs = keras.Input((8,))
        self.inner = keras.Model(inputs, L.Dense(8)(inputs) - keras.ops.mean(inputs, axis=0))

    def call(self, x):
        return self.inner(x)


def test_a_graph_model_held_by_a_declared_layer_is_read_like_the_graph():
    model = keras.Sequential([keras.Input((8,)), _HoldsCentering(), L.Dense(1)])
    assert plan_for(model).path == "vectorized"


def test_the_checks_put_back_an_instance_call():
    """A `call` the user set on a held layer's instance is there again after
    the plan and the checked pass."""
    @tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
    class Block(L.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.act = L.Activation("relu")

        def call(self, x):
            return self.act(x)

    block = Block()
    hook = lambda x: 2.0 * L.Activation.call(block.act, x)  # noqa: E731
    block.act.call = hook
    model = keras.Sequential([keras.Input((3,)), block])
    plan_for(model)
    with held_calls_checked(model):
        out = model(tf.ones([2, 3]))
    assert block.act.__dict__.get("call") is hook
    np.testing.assert_array_equal(out.numpy(), 2.0 * np.ones([2, 3]))


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _MixWithTemperature(L.Layer):
    """Legitimate: a softmax over learned [3] logits over a temperature (a
    tensor, not the variable, reaches the Softmax)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.softmax, self.dense = L.Softmax(), [L.Dense(1) for _ in range(3)]

    def build(self, shape):
        self.logits = self.add_weight(shape=(3,), initializer="zeros", name="logits")
        for dense in self.dense:
            dense.build(shape)

    def call(self, x):
        w = self.softmax(self.logits / 0.5)
        return sum(w[i] * self.dense[i](x) for i in range(3))


@tfdp.per_example.declare_per_example  # its own vjp: may call sublayers on positions
class _PositionMix(L.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.softmax = L.Softmax()

    def build(self, shape):
        self.pos = self.add_weight(shape=(shape[1],), initializer="zeros", name="pos")

    def call(self, x):
        return keras.ops.einsum("t,btd->bd", self.softmax(self.pos * 1.0), x)


@pytest.mark.parametrize("block, shape", [(_MixWithTemperature, (8,)), (_PositionMix, (4, 8))])
def test_a_held_layer_over_weights_alone_trains(block, shape):
    """A tensor whose first axis cannot be the batch (a static length where
    the step's batch has none) is not read (refused on 6ca1f8e)."""
    model = tfdp.DPSequential([keras.Input(shape), block(), L.Dense(1)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    x = np.random.default_rng(0).normal(size=(16,) + shape).astype("float32")
    model.fit(x, np.zeros((16, 1), "float32"), batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps > 0


@pytest.mark.parametrize("kind", ["dot", "additive"])
def test_a_held_attention_over_rank_2_inputs_is_refused(kind):
    make = L.Attention if kind == "dot" else L.AdditiveAttention

    @tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
    class Block(L.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.query, self.attention = L.Dense(8), make()

        def call(self, x):
            q = self.query(x)
            return self.attention([q, q])

    model = tfdp.DPSequential([keras.Input((8,)), Block(), L.Dense(1)])
    assert _ratio_or_refused(model, (8,)) <= 1 + 1e-5


def test_the_step_puts_back_an_instance_call_of_a_layer_with_a_rule():
    """The batched pass's rule hooks kept no `call` the user had set on the
    instance (it was deleted after one step)."""
    dense = L.Dense(1)
    hook = lambda *a, **k: L.Dense.call(dense, *a, **k)  # noqa: E731
    dense.call = hook
    model = tfdp.DPSequential([keras.Input((3,)), dense])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    x = np.ones((8, 3), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
    assert dense.__dict__.get("call") is hook


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _PoolsTheBatchWhenTraining(L.Layer):
    """Declared, wrongly: a held Attention built on [B, 1, D] sequences pools
    the batch with a learned [1, D] query in training (its first argument
    cannot be the batch, its second is)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.value, self.attention = L.Dense(4), L.Attention()

    def build(self, shape):
        self.query = self.add_weight(shape=(1, 4), initializer="ones", name="query")
        self.value.build(shape)

    def call(self, x, training=None):
        v = self.value(x)
        if training:
            return v + self.attention([keras.ops.convert_to_tensor(self.query) * 1.0, v])
        v3 = v[:, None, :]
        return v + self.attention([v3, v3])[:, 0, :]


def test_a_held_layer_is_read_at_every_argument_that_can_be_the_batch():
    """A review moved a neighbouring step 6.6x its bound through this block
    when only the first argument was read."""
    model = tfdp.DPSequential([keras.Input((4,)), _PoolsTheBatchWhenTraining(), L.Dense(1)])
    assert _ratio_or_refused(model, (4,)) <= 1 + 1e-5


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _MaskedSelfAttention(L.Layer):
    """Legitimate: padded self-attention over [B, T, D] with [B, T] masks."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.project, self.attention = L.Dense(4), L.Attention()

    def call(self, x):
        h = self.project(x)
        mask = keras.ops.not_equal(x[..., 0], 0.0)
        return keras.ops.mean(self.attention([h, h], mask=[mask, mask]), axis=1)


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _RankFourQuery(L.Layer):
    """Declared, wrongly: a [B, 1, T, D] query over [B, T, D] values."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.project, self.attention = L.Dense(4), L.Attention()

    def call(self, x):
        h = self.project(x)
        return keras.ops.mean(self.attention([h[:, None], h]), axis=(1, 2))


def test_a_held_masked_attention_trains_on_the_batched_path():
    model = keras.Sequential([keras.Input((5, 4)), _MaskedSelfAttention(), L.Dense(1)])
    assert plan_for(model).path == "batched"
    grads, _, _ = _batched_pass(model, (5, 4))
    assert grads.path == "batched"


def test_a_held_attention_over_inputs_of_unequal_ranks_keeps_the_bound():
    model = tfdp.DPSequential([keras.Input((3, 4)), _RankFourQuery(), L.Dense(1)])
    assert _ratio_or_refused(model, (3, 4)) <= 1 + 1e-5
