"""Recurrent rules: per-example gradients equal batch-of-1 gradients, and the
rule's own recurrence reproduces Keras's layer outputs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.per_example import compute_per_example_gradients, plan_for
from tfdp.per_example.keyed_noise import input_keys, keyed_cell_masks
from tfdp.per_example.recorder import Recorder
from tfdp.per_example.rules.recurrent import RecurrentRule

L = keras.layers


def _seq(input_shape, *layers):
    return keras.Sequential([keras.Input(input_shape)] + list(layers))


def _masked_lstm():
    inputs = keras.Input((6,), dtype="int32")
    h = L.Embedding(9, 3, mask_zero=True)(inputs)
    h = L.LSTM(4, return_sequences=True)(h)
    h = L.GRU(3, go_backwards=True)(h)
    return keras.Model(inputs, L.Dense(2)(h))


def _initial_state_model():
    inputs = keras.Input((5, 3))
    state = keras.Input((4,))
    h = L.GRU(4)(inputs, initial_state=[L.Dense(4, activation="tanh")(state)])
    return keras.Model([inputs, state], L.Dense(2)(h))


def _return_state_model():
    inputs = keras.Input((5, 3))
    out, h, c = L.LSTM(4, return_state=True)(inputs)
    return keras.Model(inputs, L.Dense(2)(L.Concatenate()([out, c])))


CASES = {
    "lstm": lambda: _seq((5, 3), L.LSTM(4), L.Dense(2)),
    "lstm_unrolled_no_bias": lambda: _seq((5, 3), L.LSTM(4, unroll=True, use_bias=False), L.Dense(2)),
    "lstm_implementation_1": lambda: _seq((5, 3), L.LSTM(4, implementation=1, activation="relu"), L.Dense(2)),
    "gru_reset_after": lambda: _seq((5, 3), L.GRU(4), L.Dense(2)),
    "gru_reset_before": lambda: _seq((5, 3), L.GRU(4, reset_after=False), L.Dense(2)),
    "gru_go_backwards_sequences": lambda: _seq((5, 3), L.GRU(4, go_backwards=True, return_sequences=True), L.Flatten(), L.Dense(2)),
    "simple_rnn": lambda: _seq((5, 3), L.SimpleRNN(4, return_sequences=True), L.SimpleRNN(3, activation="relu"), L.Dense(2)),
    "rnn_lstm_cell": lambda: _seq((5, 3), L.RNN(L.LSTMCell(4)), L.Dense(2)),
    "rnn_gru_cell": lambda: _seq((5, 3), L.RNN(L.GRUCell(4, reset_after=False), go_backwards=True), L.Dense(2)),
    "rnn_simple_cell": lambda: _seq((5, 3), L.RNN(L.SimpleRNNCell(4)), L.Dense(2)),
    "bidirectional_gru": lambda: _seq((5, 3), L.Bidirectional(L.GRU(3)), L.Dense(2)),
    "stacked_lstm": lambda: _seq((5, 3), L.LSTM(4, return_sequences=True), L.LSTM(3), L.Dense(2)),
    "masked_embedding": _masked_lstm,
    "masking_layer": lambda: _seq((6, 3), L.Masking(0.0), L.Bidirectional(L.LSTM(3, return_sequences=True)), L.GlobalAveragePooling1D(), L.Dense(2)),
    "initial_state": _initial_state_model,
    "return_state": _return_state_model,
}


def _inputs(model, batch, rng):
    def one(spec):
        shape = (batch,) + tuple(spec.shape[1:])
        if "int" in str(spec.dtype):
            ids = rng.integers(1, 9, shape)
            for i in range(batch):  # padded rows of varying length
                ids[i, shape[1] - i % shape[1]:] = 0
            return tf.constant(ids, tf.int32)
        values = rng.normal(size=shape)
        if len(shape) == 3:  # zero steps for keras.layers.Masking
            for i in range(batch):
                values[i, shape[1] - i % 3:] = 0.0
        return tf.constant(values, tf.float32)

    specs = model.inputs
    return one(specs[0]) if len(specs) == 1 else [one(s) for s in specs]


@pytest.mark.parametrize("name", sorted(CASES))
def test_recurrent_rules_match_one_example_at_a_time(name, check_batched_pass):
    keras.utils.set_random_seed(1)
    model = CASES[name]()
    rng = np.random.default_rng(0)
    x = _inputs(model, 5, rng)
    plan, y_pred = check_batched_pass(model, x, rng)
    assert not plan.fallback_layers
    np.testing.assert_allclose(y_pred.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)


def test_bidirectional_takes_its_rule():
    model = CASES["bidirectional_gru"]()
    rules = {layer.name: type(handler).__name__ for layer, handler in plan_for(model).handlers}
    assert sorted(rules.values()) == ["BidirectionalRule", "DenseRule"]


def test_bidirectional_fused_gpu_path_is_not_taken_in_the_batched_pass(
    monkeypatch, mse, reference_gradients, assert_matches_reference
):
    """On a GPU Keras may run both directions as one fused cuDNN call that
    never calls the two GRUs (so their rule would record nothing)."""
    keras.utils.set_random_seed(1)
    model = CASES["bidirectional_gru"]()
    x = tf.random.normal([4, 5, 3])
    y = tf.random.normal([4, 2])
    weights = tf.ones([4])
    reference = reference_gradients(model, x, y, weights.numpy(), mse)

    def fused(self, sequences, initial_state=None):
        raise AssertionError("the fused path bypasses the per-example rules")

    monkeypatch.setattr(L.Bidirectional, "_can_attempt_fused_gru", lambda self, *a, **k: True)
    monkeypatch.setattr(L.Bidirectional, "_call_fused_gru", fused)
    grads, _, _ = compute_per_example_gradients(model, x, y, weights, mse, "batched", training=False)
    assert_matches_reference(grads, reference)


def test_stateful_layers_are_not_taken_by_the_rule():
    layer = L.LSTM(3, stateful=True)
    layer.build((4, 5, 2))
    assert not RecurrentRule().supports(layer)


def _hooked_call(layer, *args, **kwargs):
    with tf.GradientTape() as tape:
        recorder = Recorder(tape)
        with recorder.hooked([(layer, RecurrentRule())]):
            return layer(*args, **kwargs)


def _seed_state(layer):
    return layer.cell.seed_generator.state


@pytest.mark.parametrize(
    "layer",
    [
        L.LSTM(4, return_sequences=True, return_state=True, dropout=0.3),
        L.LSTM(4, dropout=0.3, recurrent_dropout=0.4, go_backwards=True),
        L.GRU(4, dropout=0.3, recurrent_dropout=0.4, return_state=True),
        L.GRU(4, reset_after=False, dropout=0.3, recurrent_dropout=0.4, return_sequences=True),
        L.SimpleRNN(4, dropout=0.3, recurrent_dropout=0.4, unroll=True, return_sequences=True),
    ],
    ids=["lstm", "lstm_recurrent_dropout", "gru", "gru_reset_before", "simple_rnn"],
)
def test_outputs_match_keras_in_training_with_dropout(layer):
    keras.utils.set_random_seed(3)
    x = tf.random.normal([6, 5, 3])
    mask = tf.sequence_mask([5, 4, 3, 5, 1, 2], 5)
    layer.build(x.shape)
    state = _seed_state(layer).numpy()
    want = layer(x, mask=mask, training=True)
    _seed_state(layer).assign(state)
    got = _hooked_call(layer, x, mask=mask, training=True)
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "layer",
    [
        L.LSTM(4, dropout=0.3, recurrent_dropout=0.4),
        L.GRU(4, dropout=0.3, recurrent_dropout=0.4),
        L.GRU(4, reset_after=False, dropout=0.3, recurrent_dropout=0.4),
        L.SimpleRNN(4, dropout=0.3, recurrent_dropout=0.4),
    ],
    ids=["lstm", "gru", "gru_reset_before", "simple_rnn"],
)
def test_per_example_gradients_under_dropout_use_the_forward_masks(layer, mse):
    """Reference: each example's own loss differentiated through Keras's own
    batched training forward, with the same dropout masks: the seed restored
    and the cells' masks keyed per example by the inputs, as the batched
    pass keys them (`keyed_noise.keyed_cell_masks`)."""
    keras.utils.set_random_seed(4)
    model = _seq((5, 3), layer, L.Dense(2))
    x = tf.random.normal([4, 5, 3])
    y = tf.random.normal([4, 2])
    weights = tf.constant([1.0, 2.0, 0.5, 1.0])
    state = _seed_state(layer).numpy()
    grads, _, _ = compute_per_example_gradients(model, x, y, weights, mse, "batched")
    _seed_state(layer).assign(state)
    with tf.GradientTape(persistent=True) as tape, keyed_cell_masks(model, input_keys(x)):
        losses = mse(y, model(x, training=True)) * weights
        per_example_losses = [losses[i] for i in range(4)]
    reference = [
        tape.gradient(loss, model.trainable_variables) for loss in per_example_losses
    ]
    got = grads.materialize()
    scale = max(np.abs(g.numpy()).max() for g in got)
    for j, g in enumerate(got):
        want = np.stack([reference[i][j].numpy() for i in range(4)])
        np.testing.assert_allclose(g.numpy() / scale, want / scale, atol=1e-5)


def _dp_text_model(rnn, noise=1e-6):
    import tfdp

    model = tfdp.DPSequential([
        keras.Input((8,), dtype="int32"),
        L.Embedding(20, 4, mask_zero=True),
        rnn,
        L.Dense(2),
    ])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=noise),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _text_data(n, seed=0):
    """Padded token rows whose label is whether token 3 occurs."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 20, (n, 8))
    for i in range(n):
        ids[i, rng.integers(3, 9):] = 0
    return ids.astype("int32"), np.any(ids == 3, axis=1).astype("int32")


def test_dp_fit_with_dropout_and_recurrent_dropout_trains_on_the_batched_path():
    keras.utils.set_random_seed(0)
    model = _dp_text_model(L.Bidirectional(L.LSTM(4, dropout=0.2, recurrent_dropout=0.2)))
    x, y = _text_data(128)
    before = model.evaluate(x, y, verbose=0)[0]
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    assert model.per_example_path == "per-example gradients: batched pass with per-layer rules"
    assert np.all(np.isfinite(history.history["loss"]))
    assert history.history["loss"][-1] < before


def test_one_examples_clipped_contribution_is_bounded_by_the_clip():
    """Replacing one example (by one with huge inputs) moves the clipped sum
    by at most 2C: the rule's norms bound what it sums."""
    from tfdp.mechanisms.dpsgd import clip_factors

    keras.utils.set_random_seed(2)
    model = _seq((5, 3), L.GRU(6, return_sequences=True), L.LSTM(4), L.Dense(2))
    loss = lambda y, p: tf.reduce_sum(tf.square(y - p), -1)  # noqa: E731
    x = tf.random.normal([6, 5, 3])
    y = tf.random.normal([6, 2]) * 10.0
    neighbour = tf.concat([x[:-1], 100.0 * tf.random.normal([1, 5, 3])], 0)
    ones = tf.ones([6])

    def clipped_sum(inputs, clip=True):
        grads, _, _ = compute_per_example_gradients(model, inputs, y, ones, loss, "batched")
        factors = clip_factors(grads.sq_norms(), 1.0, ones) if clip else ones
        sums = grads.weighted_sum(factors)
        return tf.concat([tf.reshape(s, [-1]) for s in sums], 0)

    assert float(tf.norm(clipped_sum(x) - clipped_sum(neighbour))) <= 2.0 + 1e-5
    # Negative control: without clipping the one example moves the sum far more.
    assert float(tf.norm(clipped_sum(x, False) - clipped_sum(neighbour, False))) > 10.0


def test_saved_mid_training_model_resumes(tmp_path):
    keras.utils.set_random_seed(1)
    model = _dp_text_model(L.GRU(6, dropout=0.1))
    x, y = _text_data(64)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = str(tmp_path / "rnn.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    np.testing.assert_allclose(restored.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    restored.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert restored.per_example_path == "per-example gradients: batched pass with per-layer rules"
    assert restored.privacy.steps == 2 * model.privacy.steps
