"""Per-example gradients: fast (book-keeping) and vectorized paths against a
per-example loop of ordinary backward passes."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp

from tfdp.models.losses import per_example_loss
from tfdp.per_example import (
    check_per_example_support,
    compute_per_example_gradients,
    plan_for,
)


def tanh_cnn(input_shape=(12, 12, 1)):
    """A small cousin of the papers' tanh CNN: strides, both paddings, pooling."""
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Conv2D(4, 4, strides=2, padding="same", activation="tanh"),
            keras.layers.MaxPooling2D(2, strides=1),
            keras.layers.Conv2D(6, 2, strides=1, padding="valid", activation="tanh", dilation_rate=2),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


def sequence_mlp():
    inputs = keras.Input((5, 4))
    hidden = keras.layers.Dense(7, activation="relu")(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(inputs, keras.layers.Dense(3)(pooled))


def wide_sequence_model():
    """Dense on [B, S, K] with S (K + O) < K O: the Gram-matrix norm path."""
    inputs = keras.Input((2, 16))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(hidden)))


def reference_gradients(model, x, y, weights, loss_fn):
    """Per-example gradients by a Python loop, one example at a time."""
    per_example = []
    for i in range(x.shape[0]):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i : i + 1], model(x[i : i + 1], training=True)) * weights[i]
        per_example.append(tape.gradient(loss, model.trainable_variables))
    return [np.stack([g[j].numpy() for g in per_example]) for j in range(len(model.trainable_variables))]


def multichannel_cnn():
    """Nine input channels: patches come from one gather over pixels."""
    return keras.Sequential(
        [
            keras.Input((7, 7, 9)),
            keras.layers.Conv2D(5, 3, strides=2, padding="same", activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )


def dilated_wide_cnn():
    """Sixteen channels, dilation, few positions: gathered patches, Gram norms."""
    return keras.Sequential(
        [
            keras.Input((6, 7, 16)),
            keras.layers.Conv2D(32, (3, 2), padding="valid", dilation_rate=2, activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )


CASES = [
    (tanh_cnn, (6, 12, 12, 1)),
    (multichannel_cnn, (6, 7, 7, 9)),
    (dilated_wide_cnn, (6, 6, 7, 16)),
    (sequence_mlp, (6, 5, 4)),
    (wide_sequence_model, (6, 2, 16)),
]


@pytest.mark.parametrize("make_model,shape", CASES)
@pytest.mark.parametrize("method", ["fast", "vectorized"])
def test_matches_per_example_loop(make_model, shape, method):
    keras.utils.set_random_seed(1)
    model = make_model()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=shape), tf.float32)
    y = tf.constant(rng.integers(0, 3, size=shape[0]))
    weights = tf.constant([1.0, 0.5, 2.0, 1.0, 0.0, 1.0])
    loss_fn = per_example_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    grads, _, losses = compute_per_example_gradients(model, x, y, weights, loss_fn, method)
    expected = reference_gradients(model, x, y, weights.numpy(), loss_fn)
    for got, want in zip(grads.materialize(), expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-6)
    flat = np.concatenate([w.reshape(6, -1) for w in expected], axis=1)
    np.testing.assert_allclose(grads.sq_norms().numpy(), (flat**2).sum(1), rtol=2e-4, atol=1e-8)
    factors = np.array([0.3, 1.0, 0.0, 2.0, 1.0, 0.5], np.float32)
    for got, want in zip(grads.weighted_sum(tf.constant(factors)), expected):
        np.testing.assert_allclose(got.numpy(), np.tensordot(factors, want, 1), rtol=2e-4, atol=2e-6)
    vectors = [tf.constant(rng.normal(size=v.shape), tf.float32) for v in model.trainable_variables]
    dots = sum((w.reshape(6, -1) @ v.numpy().reshape(-1)) for w, v in zip(expected, vectors))
    np.testing.assert_allclose(grads.dots(vectors).numpy(), dots, rtol=2e-4, atol=1e-5)
    assert losses.shape == (6,)


def test_offsets_shift_every_example():
    keras.utils.set_random_seed(2)
    model = sequence_mlp()
    x = tf.random.normal((4, 5, 4))
    y = tf.constant([0, 1, 2, 1])
    loss_fn = per_example_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    grads, _, _ = compute_per_example_gradients(model, x, y, tf.ones([4]), loss_fn, "fast")
    offsets = [0.1 * v for v in model.trainable_variables]
    shifted = grads.with_offsets(offsets)
    flat = np.concatenate(
        [(g + o[None]).numpy().reshape(4, -1) for g, o in zip(grads.materialize(), offsets)], 1
    )
    np.testing.assert_allclose(shifted.sq_norms().numpy(), (flat**2).sum(1), rtol=1e-4)
    w = tf.constant([1.0, 0.0, 2.0, 0.5])
    for got, g, o in zip(shifted.weighted_sum(w), grads.materialize(), offsets):
        want = np.tensordot(w.numpy(), g.numpy(), 1) + 3.5 * o.numpy()
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)


def test_nan_rows_with_zero_weight_do_not_poison_the_sum():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    x = tf.constant([[1.0, 2.0, 3.0], [np.nan, 0.0, 0.0]])
    loss_fn = per_example_loss("mse")
    for method in ("fast", "vectorized"):
        grads, _, _ = compute_per_example_gradients(
            model, x, tf.zeros([2, 2]), tf.ones([2]), loss_fn, method
        )
        norms = grads.sq_norms().numpy()
        assert np.isfinite(norms[0]) and not np.isfinite(norms[1])
        sums = grads.weighted_sum(tf.constant([1.0, 0.0]))
        assert all(np.all(np.isfinite(s.numpy())) for s in sums)


def test_batched_path_survives_an_explicit_build_and_shared_layers():
    # `build` calls a Sequential's layers outside its graph once more; that
    # extra call must not send the model to the slow vectorized path. A layer
    # called twice is one rule over both calls' rows.
    model = tanh_cnn()
    model.build((None, 12, 12, 1))
    assert plan_for(model).path == "batched"
    shared = keras.layers.Dense(4)
    inputs = keras.Input((4,))
    twice = keras.Model(inputs, shared(shared(inputs)))
    assert plan_for(twice).path == "batched"


def test_a_layer_that_mixes_examples_takes_the_vectorized_path():
    # A weightless Lambda subtracting the batch mean: in a batched pass every
    # example's gradient would depend on the others (sensitivity above C).
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3),
         keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0)), keras.layers.Dense(2)]
    )
    plan = plan_for(model)
    assert plan.path == "vectorized" and "Lambda" in plan.reason
    with pytest.raises(ValueError, match="per_example_gradients='fast'"):
        compute_per_example_gradients(
            model, tf.ones([2, 4]), tf.zeros([2, 2]), tf.ones([2]), per_example_loss("mse"), "fast"
        )
    grads, _, _ = compute_per_example_gradients(
        model, tf.ones([2, 4]), tf.zeros([2, 2]), tf.ones([2]), per_example_loss("mse"), "auto"
    )
    assert grads.path == "vectorized"


def test_one_examples_gradient_does_not_move_with_another_example():
    # The review's attack: an outlier substituted for example 1 moved the
    # batched update far beyond 2C/b. Example 0's per-example gradient must
    # not depend on example 1 at all, whichever path "auto" picks.
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3),
         keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0)), keras.layers.Dense(2)]
    )
    loss_fn = per_example_loss("mse")
    x = np.ones([2, 4], np.float32)
    outlier = x.copy()
    outlier[1] = 1e3
    first = [
        compute_per_example_gradients(model, tf.constant(batch), tf.zeros([2, 2]), tf.ones([2]), loss_fn)[0]
        .materialize()
        for batch in (x, outlier)
    ]
    for a, b in zip(*first):
        np.testing.assert_allclose(a.numpy()[0], b.numpy()[0], rtol=1e-6, atol=1e-6)


def test_vectorized_path_matches_the_reference_with_layer_normalization():
    # The vectorized path's gradients (LayerNorm's gamma and beta included) are
    # the one-example-at-a-time reference, in norms and in a weighted sum.
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.LayerNormalization(), keras.layers.Dense(2)]
    )
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(5, 4)).astype(np.float32))
    y = tf.constant(rng.normal(size=(5, 2)).astype(np.float32))
    loss_fn = per_example_loss("mse")
    grads, _, _ = compute_per_example_gradients(model, x, y, tf.ones([5]), loss_fn, "vectorized")
    expected = reference_gradients(model, x, y, np.ones(5), loss_fn)
    flat = np.concatenate([w.reshape(5, -1) for w in expected], axis=1)
    np.testing.assert_allclose(grads.sq_norms().numpy(), (flat**2).sum(1), rtol=1e-4)
    factors = np.array([0.5, -1.0, 2.0, 0.0, 1.5], np.float32)
    for got, want in zip(grads.weighted_sum(tf.constant(factors)), expected):
        np.testing.assert_allclose(got.numpy(), np.tensordot(factors, want, axes=1), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("method", ["auto", "vectorized"])
def test_batch_normalization_in_training_mode_is_refused_where_it_is_called(method):
    """Not by class (a trainable one in inference mode is accepted) but call
    by call, when the per-example pass is traced."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    check_per_example_support(model)
    loss = lambda y, p: tf.reduce_sum(tf.square(y - p), -1)  # noqa: E731
    args = (model, tf.ones([2, 4]), tf.zeros([2, 2]), tf.ones([2]), loss, method)
    with pytest.raises(ValueError, match="BatchNormalization.*training mode"):
        compute_per_example_gradients(*args, training=True)
    grads, _, _ = compute_per_example_gradients(*args, training=False)
    assert grads.sq_norms().shape == (2,)


def tanh_mlp():
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)]
    )


@pytest.mark.parametrize("make_model,shape", [(tanh_mlp, (6, 4)), (wide_sequence_model, (6, 2, 16))])
def test_huge_input_on_saturated_units_has_a_finite_norm(make_model, shape):
    # |x|^2 overflows float32 at 1e30, but tanh saturates, so the example's
    # first-layer gradient x g^T is exactly 0: factored norms must not
    # compute inf * 0 (which would drop a legitimate record as non-finite).
    keras.utils.set_random_seed(0)
    model = make_model()
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    x[2] = 1e30
    y = tf.constant([0, 1, 2, 0, 1, 2])
    loss_fn = per_example_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    grads, _, _ = compute_per_example_gradients(model, tf.constant(x), y, tf.ones([6]), loss_fn, "fast")
    expected = reference_gradients(model, tf.constant(x), y, np.ones(6), loss_fn)
    flat = np.concatenate([w.reshape(6, -1) for w in expected], axis=1)
    assert np.all(np.isfinite(flat))
    np.testing.assert_allclose(grads.sq_norms().numpy(), (flat**2).sum(1), rtol=2e-4, atol=1e-8)


def test_a_declared_custom_layer_takes_the_batched_path():
    @tfdp.per_example.declare_per_example
    class Scale(keras.layers.Layer):
        def build(self, input_shape):
            self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

        def call(self, x):
            return x * self.scale

    class Undeclared(Scale):
        pass

    declared = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), Scale(), keras.layers.Dense(2)])
    plan = plan_for(declared)
    assert plan.path == "batched" and len(plan.fallback_layers) == 1
    loss_fn = per_example_loss("mse")
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 3)), tf.float32)
    y = tf.zeros([4, 2])
    grads, _, _ = compute_per_example_gradients(declared, x, y, tf.ones([4]), loss_fn, "batched")
    for got, want in zip(grads.materialize(), reference_gradients(declared, x, y, np.ones(4), loss_fn)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    undeclared = keras.Sequential([keras.Input((3,)), Undeclared(), keras.layers.Dense(2)])
    assert plan_for(undeclared).path == "vectorized"


def test_the_model_names_its_path_and_warns_for_an_unknown_layer(caplog):
    model = tfdp.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Lambda(lambda t: 2.0 * t),
         keras.layers.Dense(2)]
    )
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    with caplog.at_level("WARNING", logger="tfdp"):
        model.fit(np.ones((16, 4), np.float32), np.zeros((16, 2), np.float32), batch_size=4, verbose=0)
    assert "vectorized_map" in model.per_example_path and "lambda" in model.per_example_path
    assert any("Lambda" in r.getMessage() for r in caplog.records)


def test_a_stateful_recurrent_layer_is_refused_at_compile():
    model = tfdp.DPSequential(
        [keras.Input((5, 3), batch_size=4), keras.layers.LSTM(2, stateful=True), keras.layers.Dense(2)]
    )
    with pytest.raises(ValueError, match="stateful"):
        model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss="mse")


@pytest.mark.parametrize(
    "op,batched",
    [
        (lambda t: keras.ops.mean(t, axis=-1, keepdims=True) + t, True),
        (lambda t: t[:, :2], True),
        (lambda t: t - keras.ops.mean(t, axis=0), False),
        (lambda t: keras.ops.where(keras.ops.any(t > 0), t, -t), False),
        (lambda t: keras.ops.max(t, axis=0, keepdims=True) + t, False),
    ],
)
def test_graph_operations_keep_the_batched_path_only_when_per_example(op, batched):
    inputs = keras.Input((4,))
    hidden = op(keras.layers.Dense(4)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    assert (plan_for(model).path == "batched") is batched
