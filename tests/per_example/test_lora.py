"""LoRA-enabled Dense, EinsumDense and Embedding: per-example gradients of
the LoRA factors equal batch-of-1 gradients; frozen weights get no
per-example work and never move; saved and exported models serve the
fine-tuned weights."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.per_example import plan_for
from tfdp.per_example.rules import lora

L = keras.layers


def _lora_model(freeze_bias=False, lora_alpha=None):
    ids = keras.Input((6,), dtype="int32")
    embedding = L.Embedding(20, 8)
    h = embedding(ids)
    dense = L.Dense(8, activation="tanh")
    h = dense(h)
    attention = L.MultiHeadAttention(num_heads=2, key_dim=4)
    h = attention(h, h)
    projection = L.EinsumDense("abc,cd->abd", output_shape=(None, 4), bias_axes="d")
    h = projection(h)
    outputs = L.Dense(2)(L.GlobalAveragePooling1D()(h))
    model = tfdp.DPModel(ids, outputs)
    for layer in (embedding, dense, attention._query_dense, attention._output_dense, projection):
        layer.enable_lora(2, lora_alpha=lora_alpha)
        # Non-zero B so that A's gradient is not zero (B starts at zero).
        layer.variables[-1].assign(tf.random.normal(layer.variables[-1].shape, seed=1))
    if freeze_bias:
        dense.bias.trainable = False
    return model


@pytest.mark.parametrize("freeze_bias, lora_alpha", [(False, None), (True, None), (False, 5.0)])
def test_lora_rules_match_one_example_at_a_time(freeze_bias, lora_alpha, check_batched_pass):
    """lora_alpha = 5 with rank 2 gives the factors a scale s = 2.5 (alpha =
    rank, the default, hides a dropped scale: s = 1)."""
    keras.utils.set_random_seed(2)
    model = _lora_model(freeze_bias, lora_alpha)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.integers(0, 20, (5, 6)), tf.int32)
    plan, _ = check_batched_pass(model, x, rng)
    kinds = {type(h).__name__ for _, h in plan.handlers}
    assert {"LoraDenseRule", "LoraEinsumDenseRule", "LoraEmbeddingRule"} <= kinds
    assert not plan.fallback_layers


def test_lora_parts_are_factored_and_skip_the_frozen_kernel():
    keras.utils.set_random_seed(0)
    layer = L.Dense(64)
    layer.build((None, 4, 64))
    layer.enable_lora(2)
    from tfdp.per_example.recorder import Recorder

    with tf.GradientTape() as tape:
        recorder = Recorder(tape)
        with recorder.hooked([(layer, lora.LoraDenseRule())]):
            total = tf.reduce_sum(layer(tf.ones([3, 4, 64])) ** 2)
    recorder.compute_gradients(total)
    parts = lora.LoraDenseRule().parts(layer, recorder.records_of(layer))
    assert [type(p).__name__ for p in parts] == ["LinearGrads", "LinearGrads"]
    assert [v.name for p in parts for v in p.variables] == ["lora_kernel_a", "lora_kernel_b", "bias"]


def _fit_lora_model(tmp_path):
    keras.utils.set_random_seed(3)
    model = _lora_model()
    frozen = {v.path: v.numpy().copy() for v in model.variables if not v.trainable and "lora" not in v.path
              and "dp_steps" not in v.path}
    rng = np.random.default_rng(1)
    x = rng.integers(0, 20, (64, 6)).astype("int32")
    y = rng.integers(0, 2, 64)
    model.compile(optimizer=tfdp.optimizers.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model, frozen, x


def test_frozen_weights_never_move_and_saved_models_serve_the_fine_tuned_model(tmp_path):
    model, frozen, x = _fit_lora_model(tmp_path)
    assert frozen and any("kernel" in p for p in frozen)
    for v in model.variables:
        if v.path in frozen:
            np.testing.assert_array_equal(v.numpy(), frozen[v.path], err_msg=v.path)
    expected = model.predict(x[:4], verbose=0)
    path = str(tmp_path / "lora.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x[:4], verbose=0), expected, rtol=1e-5, atol=1e-6)
    export = str(tmp_path / "served")
    model.export(export, format="tf_saved_model")
    served = tf.saved_model.load(export)
    np.testing.assert_allclose(served.serve(tf.constant(x[:4])).numpy(), expected, rtol=1e-5, atol=1e-6)
