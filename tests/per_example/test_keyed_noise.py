"""Dropout and noise layers keyed per example (`tfdp.per_example.keyed_noise`).

Keras draws their masks by batch position: with a record inserted first,
every other example lands on another row's mask. Each layer here is checked
with the attack (each other example's per-example gradient, with a record
inserted first, against the padded batch without it; Keras's own positional
draw is the negative control) and against Keras's distributions (fixed
seeds; tolerances of 5 standard errors)."""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.auditing.neighbour_step import NeighbourStep
from tfdp.models.losses import per_example_loss
from tfdp.per_example import compute_per_example_gradients, plan_for
from tfdp.per_example.keyed_noise import keyed_noise_call

L = keras.layers

NOISE = {
    "Dropout": lambda: L.Dropout(0.5),
    "Dropout with a noise shape": lambda: L.Dropout(0.5, noise_shape=(None, 1, 3)),
    "SpatialDropout1D": lambda: L.SpatialDropout1D(0.5),
    "GaussianNoise": lambda: L.GaussianNoise(1.0),
    "GaussianDropout": lambda: L.GaussianDropout(0.5),
    "AlphaDropout": lambda: L.AlphaDropout(0.5),
}


def _model(name):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 3))
    h = L.Dense(3, activation="tanh")(inputs)
    if name == "MultiHeadAttention's dropout":
        h = L.MultiHeadAttention(1, 3, dropout=0.5)(h, h)
    elif name in RECURRENT:
        h = RECURRENT[name]()(h)
    elif name == "KerasHub's TransformerEncoder":
        h = keras_hub.layers.TransformerEncoder(6, 1, dropout=0.5)(h)
    else:
        h = NOISE[name]()(h)
    return keras.Model(inputs, L.Dense(2)(L.Flatten()(h)))


def _seed_states(model):
    return [layer.seed_generator.state for layer in model._flatten_layers()
            if getattr(layer, "seed_generator", None) is not None]


def _others_moved(model, method="auto"):
    """Largest change of the three real examples' gradients when a record
    is inserted before them (a full batch of 4) instead of a padding row
    after them, each step from the same seed states."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4, 3)).astype(np.float32)
    y = rng.normal(size=(3, 2)).astype(np.float32)
    record = np.full((1, 4, 3), 5.0, np.float32)
    batches = [(np.concatenate([x, x[:1]]), np.concatenate([y, y[:1]]), [1.0, 1.0, 1.0, 0.0]),
               (np.concatenate([record, x]), np.concatenate([np.zeros((1, 2), np.float32), y]),
                [1.0] * 4)]
    states = [(v, v.numpy()) for v in _seed_states(model)]
    grads = []
    for inputs, targets, weights in batches:
        for variable, value in states:
            variable.assign(value)
        grads.append([g.numpy() for g in compute_per_example_gradients(
            model, tf.constant(inputs), tf.constant(targets), tf.constant(weights),
            per_example_loss("mse"), method)[0].materialize()])
    (padded, inserted) = grads
    return max(float(np.max(np.abs(b[1:] - a[:3]))) for a, b in zip(padded, inserted))


RECURRENT = {
    "LSTM's dropout": lambda: L.LSTM(3, dropout=0.5, recurrent_dropout=0.5,
                                     return_sequences=True),
    "GRU's dropout": lambda: L.GRU(3, dropout=0.5, return_sequences=True),
    "SimpleRNN's dropout": lambda: L.SimpleRNN(3, dropout=0.5, recurrent_dropout=0.5,
                                               return_sequences=True),
}
CASES = sorted(NOISE) + sorted(RECURRENT) + ["MultiHeadAttention's dropout",
                                             "KerasHub's TransformerEncoder"]


@pytest.mark.parametrize("name", CASES)
def test_a_record_inserted_first_moves_no_other_examples_noise(name):
    model = _model(name)
    assert plan_for(model).path == "batched", plan_for(model).describe()
    # float32 rounding only (a recurrent matmul rounds a row by its position)
    assert _others_moved(model) < 1e-6


def test_keras_own_draw_by_position_moves_the_others_negative_control(monkeypatch):
    """Without the keyed handler (Keras's call), the same attack moves them."""
    from tfdp.per_example import keyed_noise

    monkeypatch.setattr(keyed_noise, "keyed_noise_call",
                        lambda layer, call, keys, *args, **kwargs: call(*args, **kwargs))
    assert _others_moved(_model("Dropout")) > 1e-3


@pytest.mark.parametrize("physical_batch_size", [None, 2])
def test_a_neighbouring_step_with_dropout_stays_within_the_bound(physical_batch_size):
    """The compiled step, noise 0: a Dropout(0.5) moved it 2.8 times its
    bound with the record inserted first, before the masks were keyed (3.3
    in chunks of 2: each chunk drew its own key, so an example moved to the
    next chunk drew another mask)."""
    assert _step_ratios(lambda h: L.Dropout(0.5)(h), physical_batch_size) <= 1.0 + 1e-5


def _call(layer, x):
    layer.build(x.shape)
    return keyed_noise_call(layer, layer.call, None, tf.constant(x), training=True).numpy()


def test_dropout_keeps_one_minus_rate_scaled_as_keras():
    x = np.ones((4, 5000), np.float32)
    out = _call(L.Dropout(0.3, seed=1), x)
    kept = out != 0
    np.testing.assert_allclose(out[kept], 1.0 / 0.7, rtol=1e-6)
    error = 5 * np.sqrt(0.3 * 0.7 / kept.size)
    assert abs(kept.mean() - 0.7) < error, kept.mean()
    # equal inputs draw equal masks; different inputs, different ones
    assert np.array_equal(kept[0], kept[1])
    other = _call(L.Dropout(0.3, seed=1), np.stack([x[0], 2 * x[0]]))
    assert not np.array_equal(other[0] != 0, other[1] != 0)


def test_the_noise_shape_shares_a_draw_within_an_example():
    x = np.ones((6, 50, 8), np.float32)
    for layer in (L.Dropout(0.5, noise_shape=(None, 1, 8), seed=2), L.SpatialDropout1D(0.5, seed=2)):
        kept = _call(layer, x * np.arange(1, 7, dtype=np.float32)[:, None, None]) != 0
        assert (kept == kept[:, :1]).all()  # one draw along the shared axis
        assert 0 < kept.mean() < 1


@pytest.mark.parametrize("layer, mean, std", [
    (lambda: L.GaussianNoise(0.8, seed=3), 0.0, 0.8),
    (lambda: L.GaussianDropout(0.2, seed=3), 1.0, np.sqrt(0.2 / 0.8)),
])
def test_gaussian_noise_has_keras_mean_and_spread(layer, mean, std):
    x = np.ones((4, 20000), np.float32)
    out = _call(layer(), x)
    noise = out - 1.0 if mean == 0.0 else out
    n = noise.size
    assert abs(noise.mean() - mean) < 5 * std / np.sqrt(n), noise.mean()
    assert abs(noise.std() - std) < 5 * std / np.sqrt(2 * n), noise.std()
    # negative control: a spread a tenth off is told apart
    assert abs(noise.std() - 1.1 * std) > 5 * std / np.sqrt(2 * n)


def test_alpha_dropout_keeps_mean_and_variance():
    x = np.random.default_rng(4).normal(size=(4, 20000)).astype(np.float32)
    out = _call(L.AlphaDropout(0.2, seed=4), x)
    assert abs(out.mean()) < 0.03 and abs(out.std() - 1.0) < 0.03, (out.mean(), out.std())


def test_inference_and_rate_zero_are_the_layers_own_call():
    x = tf.random.stateless_normal([3, 7], [0, 1])
    layer = L.Dropout(0.5)
    layer.build(x.shape)
    np.testing.assert_array_equal(keyed_noise_call(layer, layer.call, None, x, training=False), x)
    none = L.Dropout(0.0)
    none.build(x.shape)
    np.testing.assert_array_equal(keyed_noise_call(none, none.call, None, x, training=True), x)


@tfdp.per_example.declare_per_example
class _HeldDropout(L.Layer):
    """A declared layer holding a Dropout: its weights take the per-layer
    fallback, whose re-run draws Keras's own masks."""

    def build(self, shape):
        self.dense = L.Dense(shape[-1])
        self.dense.build(shape)
        self.drop = L.Dropout(0.5)

    def call(self, x, training=None):
        return self.drop(self.dense(x), training=training)


@tfdp.per_example.declare_per_example
class _DroppedPositions(L.Layer):
    """Adds a learned [T, D] table, dropped: a tensor of one row, not the batch."""

    def build(self, shape):
        self.table = self.add_weight(shape=tuple(shape[1:]), initializer="random_normal")
        self.drop = L.Dropout(0.5)

    def call(self, x, training=None):
        return x + self.drop(self.table[None], training=training)


def _step_ratios(middle, physical_batch_size, **model_settings):
    """NeighbourStep's worst ratio over far and near records and three relations."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 3))
    h = middle(L.Dense(3, activation="tanh")(inputs))
    model = tfdp.DPModel(inputs, L.Dense(2)(L.Flatten()(h)), **model_settings)
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=0.01, noise_multiplier=1.0),
                  loss="mse")
    rng = np.random.default_rng(1)
    data = (rng.normal(size=(3, 4, 3)).astype(np.float32),
            rng.normal(size=(3, 2)).astype(np.float32))
    with NeighbourStep(model, data, records=3, batch_size=4,
                       physical_batch_size=physical_batch_size) as step:
        return max(step.ratio((np.full((4, 3), scale, np.float32), np.zeros(2, np.float32)),
                              relation)
                   for scale in (1.0, 100.0)
                   for relation in ("add", "add, record first", "replace"))


@pytest.mark.parametrize("name, middle, settings", [
    ("the whole-model vectorized path", lambda h: L.GaussianNoise(0.5)(L.Dropout(0.5)(h)),
     {"per_example_gradients": "vectorized"}),
    ("a declared layer's Dropout, re-run by the fallback", lambda h: _HeldDropout()(h), {}),
    ("a dropped table of positions in a declared layer", lambda h: _DroppedPositions()(h), {}),
])
def test_each_chunk_draws_the_steps_seeds(name, middle, settings):
    """Review of the keyed masks: in chunks of 2 each chunk's run drew the
    next seed, so a record drawn first moved an example to the next chunk,
    onto another mask (vectorized path 1.62x, the fallback's re-run 1.27x);
    a [1, T, D] table in a chunk of one row was read as that row's example
    (1.005x; 1.03x without chunks when its rows were keyed by the examples')."""
    for physical_batch_size in (None, 2):
        assert _step_ratios(middle, physical_batch_size, **settings) <= 1.0 + 1e-5, name


@pytest.mark.parametrize("layer", [L.Attention, L.AdditiveAttention])
def test_an_attention_that_draws_its_own_dropout_takes_the_exact_path(layer):
    """Attention(dropout=...) draws its mask in its own call, by batch
    position (2.1x a neighbouring step's bound, record first)."""
    inputs = keras.Input((4, 3))
    h = layer(dropout=0.5)([inputs, inputs])
    plan = plan_for(keras.Model(inputs, L.Dense(2)(L.Flatten()(h))))
    assert plan.path == "vectorized" and "draws its attention dropout mask" in plan.reason
    assert _step_ratios(lambda t: layer(dropout=0.5)([t, t]), None) <= 1.0 + 1e-5


def test_bidirectional_recurrent_dropout_is_keyed():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 3))
    h = L.Bidirectional(L.LSTM(3, dropout=0.5, return_sequences=True))(inputs)
    model = keras.Model(inputs, L.Dense(2)(L.Flatten()(h)))
    assert _others_moved(model) < 1e-6


def test_inputs_of_unknown_length_are_keyed():
    """input_keys read a static length (a TypeError on [None, None, 3])."""
    from tfdp.per_example.keyed_noise import input_keys

    keys = tf.function(input_keys, input_signature=[tf.TensorSpec([None, None, 3])])
    padded = np.zeros((2, 6, 3), np.float32)
    padded[:, :4] = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    np.testing.assert_array_equal(keys(tf.constant(padded)), keys(tf.constant(padded[:, :4])))
