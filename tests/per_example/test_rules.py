"""Every layer rule: per-example gradients equal those of the same example run
alone (batch of 1), as Opacus tests its grad samplers."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.per_example import plan_for

L = keras.layers


def _seq(input_shape, *layers):
    return keras.Sequential([keras.Input(input_shape)] + list(layers))


MODELS = {
    "dense_3d": lambda: _seq((5, 4), L.Dense(6, activation="tanh"), L.Flatten(), L.Dense(2)),
    "conv1d_causal_dilated": lambda: _seq((12, 3), L.Conv1D(4, 3, padding="causal", dilation_rate=2, activation="tanh"), L.Flatten(), L.Dense(2)),
    "conv1d_strided_same": lambda: _seq((11, 9), L.Conv1D(4, 3, strides=2, padding="same"), L.GlobalAveragePooling1D(), L.Dense(2)),
    "conv2d_groups": lambda: _seq((7, 7, 4), L.Conv2D(6, 3, groups=2, padding="same", activation="relu"), L.Flatten(), L.Dense(2)),
    "conv2d_grouped_filter_route": lambda: _seq((9, 9, 8), L.Conv2D(8, 3, padding="same", activation="tanh"), L.Conv2D(9, 3), L.Flatten(), L.Dense(2)),
    "conv2d_multichannel": lambda: _seq((7, 7, 9), L.Conv2D(5, 3, strides=2, padding="same"), L.Flatten(), L.Dense(2)),
    "conv3d": lambda: _seq((5, 5, 5, 2), L.Conv3D(3, 2, strides=(1, 2, 1)), L.Flatten(), L.Dense(2)),
    "depthwise2d": lambda: _seq((6, 6, 3), L.DepthwiseConv2D(3, depth_multiplier=2, padding="same"), L.Flatten(), L.Dense(2)),
    "depthwise1d": lambda: _seq((9, 3), L.DepthwiseConv1D(3, depth_multiplier=2, strides=2), L.Flatten(), L.Dense(2)),
    "separable2d": lambda: _seq((6, 6, 3), L.SeparableConv2D(4, 3, depth_multiplier=2, padding="same"), L.Flatten(), L.Dense(2)),
    "separable1d": lambda: _seq((9, 3), L.SeparableConv1D(4, 3, strides=2), L.Flatten(), L.Dense(2)),
    "conv2d_transpose": lambda: _seq((4, 4, 3), L.Conv2DTranspose(2, 3, strides=2, padding="same"), L.Flatten(), L.Dense(2)),
    "conv1d_transpose_valid": lambda: _seq((5, 3), L.Conv1DTranspose(2, 3, strides=2), L.Flatten(), L.Dense(2)),
    "layer_norm": lambda: _seq((5, 4), L.Dense(6), L.LayerNormalization(), L.Flatten(), L.Dense(2)),
    "layer_norm_rms": lambda: _seq((5, 4), L.Dense(6), L.LayerNormalization(rms_scaling=True), L.Flatten(), L.Dense(2)),
    "group_norm": lambda: _seq((6, 6, 4), L.Conv2D(6, 3), L.GroupNormalization(3), L.Flatten(), L.Dense(2)),
    "group_norm_channels_first": lambda: _seq((4, 5, 5), L.Dense(5), L.GroupNormalization(2, axis=1), L.Flatten(), L.Dense(2)),
    "group_norm_offset_only": lambda: _seq((6, 6, 4), L.Conv2D(6, 3), L.GroupNormalization(3, scale=False), L.Flatten(), L.Dense(2)),
    "group_norm_scale_only_sequence": lambda: _seq((5, 4), L.Dense(6), L.GroupNormalization(2, center=False), L.Flatten(), L.Dense(2)),
    "rms_norm": lambda: _seq((5, 4), L.Dense(6), L.RMSNormalization(), L.Flatten(), L.Dense(2)),
    "einsum_dense": lambda: _seq((5, 4), L.EinsumDense("abc,cde->abde", output_shape=(5, 2, 3), bias_axes="de"), L.Flatten(), L.Dense(2)),
    "prelu_fallback": lambda: _seq((5,), L.Dense(4), L.PReLU(), L.Dense(2)),
}


def _batch_norm_model():
    """A trainable BatchNormalization in inference mode (the harness calls
    with training=False), with statistics that are not the identity."""
    norm = L.BatchNormalization()
    model = _seq((6, 6, 4), L.Conv2D(5, 3), norm, L.Flatten(), L.Dense(2))
    rng = np.random.default_rng(3)
    for variable, low in ((norm.moving_mean, -1.0), (norm.moving_variance, 0.2),
                          (norm.gamma, 0.5), (norm.beta, -1.0)):
        variable.assign(rng.uniform(low, low + 2.0, 5).astype("float32"))
    return model


def _embedding_model(mask_zero):
    inputs = keras.Input((7,), dtype="int32")
    h = L.Embedding(11, 4, mask_zero=mask_zero)(inputs)
    h = L.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, L.Dense(2)(h))


def _attention_model():
    inputs = keras.Input((6, 8))
    attended = L.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    h = L.LayerNormalization()(inputs + attended)
    return keras.Model(inputs, L.Dense(2)(h[:, 0]))


def _shared_dense_model():
    inputs = keras.Input((4,))
    shared = L.Dense(4, activation="tanh")
    return keras.Model(inputs, L.Dense(2)(shared(shared(inputs))))


def _shared_group_norm_model():
    inputs = keras.Input((5, 6))
    shared = L.GroupNormalization(3)
    h = shared(L.Dense(6)(shared(inputs)))
    return keras.Model(inputs, L.Dense(2)(L.Flatten()(h)))


def _multi_input_model():
    numeric = keras.Input((3,))
    categorical = keras.Input((2,), dtype="int32")
    embedded = L.Flatten()(L.Embedding(5, 2)(categorical))
    h = L.Concatenate()([L.Dense(3)(numeric), embedded])
    return keras.Model([numeric, categorical], L.Dense(2)(h))


def _inputs(model, batch, rng):
    def one(tensor):
        shape = (batch,) + tuple(tensor.shape[1:])
        if "int" in str(tensor.dtype):
            return tf.constant(rng.integers(0, 5, shape), tf.int32)
        return tf.constant(rng.normal(size=shape), tf.float32)

    specs = model.inputs
    return one(specs[0]) if len(specs) == 1 else [one(s) for s in specs]


CASES = dict(MODELS)
CASES.update(
    batch_norm_inference=_batch_norm_model,
    embedding=lambda: _embedding_model(False),
    embedding_mask_zero=lambda: _embedding_model(True),
    multi_head_attention=_attention_model,
    shared_layer=_shared_dense_model,
    shared_group_norm=_shared_group_norm_model,
    multi_input=_multi_input_model,
)


@pytest.mark.parametrize("name", sorted(CASES))
def test_batched_rules_match_one_example_at_a_time(name, check_batched_pass):
    keras.utils.set_random_seed(1)
    model = CASES[name]()
    rng = np.random.default_rng(0)
    check_batched_pass(model, _inputs(model, 5, rng), rng)


def test_prelu_takes_the_per_layer_fallback():
    plan = plan_for(MODELS["prelu_fallback"]())
    assert plan.fallback_layers and "p_re_lu" in plan.fallback_layers[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_grouped_rules_match_each_user_summed_one_example_at_a_time(
        name, mse, reference_gradients, assert_matches_reference):
    """User-level DP joins every k consecutive examples (a user's records):
    its gradient is the sum of theirs, on every rule (6 records, 3 users)."""
    from tfdp.per_example import compute_per_example_gradients

    keras.utils.set_random_seed(1)
    model = CASES[name]()
    rng = np.random.default_rng(0)
    x = _inputs(model, 6, rng)
    y = tf.constant(rng.normal(size=(6, 2)), tf.float32)
    weights = tf.constant([1.0, 0.5, 2.0, 1.0, 0.0, 0.25])
    grads, _, _ = compute_per_example_gradients(model, x, y, weights, mse, "batched", training=False)
    per_record = reference_gradients(model, x, y, weights.numpy(), mse)
    per_user = [r.reshape((3, 2) + r.shape[1:]).sum(1) for r in per_record]
    assert_matches_reference(grads.grouped(2), per_user)
