"""Mixed precision: layers compute in bfloat16/float16, DP stays float32.

The per-example norms and the clipped sum are computed from the same
float32 values, so every clipped example's gradient norm is at most C to
float32 tolerance, and the noise and update act on float32 weights.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.mechanisms import dpsgd
from tfdp.per_example import compute_per_example_gradients

L = keras.layers
CLIP = 0.5


@pytest.fixture
def policy(request):
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_dtype_policy("float32")


def _model():
    images = keras.Input((8, 8, 1))
    h = L.Conv2D(4, 3, activation="relu")(images)
    h = L.GroupNormalization(2)(h)
    h = L.Dense(16, activation="tanh")(L.Flatten()(h))
    tokens = keras.Input((5,), dtype="int32")
    e = L.LayerNormalization()(L.GlobalAveragePooling1D()(L.Embedding(30, 6)(tokens)))
    outputs = L.Dense(3)(L.Concatenate()([h, e]))
    return tfdp.DPModel([images, tokens], outputs)


def _batch(size=32):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(size, 8, 8, 1)).astype("float32") * 20.0,  # large: clipping is active
         rng.integers(0, 30, (size, 5)).astype("int32"))
    return x, rng.integers(0, 3, size)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"], indirect=True)
def test_clipping_bound_holds_in_float32_under_mixed_precision(policy):
    model = _model()
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=CLIP, noise_multiplier=1.0, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert model.layers[-1].compute_dtype != "float32"  # the layers do compute low
    assert "batched" in model.per_example_path
    x, y = _batch()
    weights = tf.ones([len(y)])
    grads, y_pred, losses = compute_per_example_gradients(
        model, tuple(tf.constant(a) for a in x), tf.constant(y), weights, model._per_example_loss)
    assert y_pred.dtype != tf.float32 and losses.dtype == tf.float32
    sq_norms = grads.sq_norms()
    assert sq_norms.dtype == tf.float32
    factors = dpsgd.clip_factors(sq_norms, CLIP, weights)
    assert float(tf.reduce_min(factors)) < 0.5  # clipping really bites
    per_example = grads.materialize()
    assert all(g.dtype == tf.float32 for g in per_example)
    clipped_norms = tf.sqrt(tf.add_n([
        tf.reduce_sum(tf.square(tf.reshape(g, [len(y), -1]) * factors[:, None]), 1)
        for g in per_example]))
    assert float(tf.reduce_max(clipped_norms)) <= CLIP * (1 + 1e-5)
    # The sum the noise is added to is the sum of those clipped gradients.
    sums = grads.weighted_sum(factors)
    for total, g in zip(sums, per_example):
        assert total.dtype == tf.float32
        expected = tf.tensordot(factors, g, axes=1)
        np.testing.assert_allclose(total.numpy(), expected.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("policy", ["mixed_bfloat16"], indirect=True)
def test_fit_under_mixed_bfloat16_keeps_float32_weights_and_counts_steps(policy):
    model = _model()
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=CLIP, noise_multiplier=1.0, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _batch(64)
    before = [v.numpy().copy() for v in model.trainable_variables]
    history = model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0)
    assert np.isfinite(history.history["loss"][0]) and model.privacy.steps == 3
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    assert all(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))


@pytest.mark.parametrize("policy", ["bfloat16"], indirect=True)
def test_low_precision_weights_are_refused_before_training(policy):
    inputs = keras.Input((4,))
    model = tfdp.DPModel(inputs, L.Dense(2)(inputs))
    with pytest.raises(ValueError, match="float32 weights.*Received: dtype_policy=bfloat16"):
        model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_loss_scaling_is_refused(policy):
    inputs = keras.Input((4,))
    model = tfdp.DPModel(inputs, L.Dense(2)(inputs))
    with pytest.raises(ValueError, match="auto_scale_loss=True"):
        model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss="mse", auto_scale_loss=True)
