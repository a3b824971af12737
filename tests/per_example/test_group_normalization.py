"""GroupNormalization's rule computes the layer's output as Keras does."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.per_example import compute_per_example_gradients

L = keras.layers


def _mse(y_true, y_pred):
    return tf.reduce_sum(tf.square(y_true - y_pred), -1)


LAYERS = {
    "channels_last": ((9, 9, 8), lambda: L.GroupNormalization(4)),
    "channels_first": ((8, 9, 9), lambda: L.GroupNormalization(2, axis=1)),
    "sequence": ((7, 6), lambda: L.GroupNormalization(3)),
    "offset_only": ((9, 9, 8), lambda: L.GroupNormalization(4, scale=False)),
    "scale_only": ((9, 9, 8), lambda: L.GroupNormalization(4, center=False)),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_the_batched_pass_normalizes_bit_for_bit_as_keras(name):
    """The model's output in the DP step equals its own call exactly: the
    rule runs Keras's formula, not a rounding of it."""
    shape, make = LAYERS[name]
    rng = np.random.default_rng(0)
    norm = make()
    model = keras.Sequential([keras.Input(shape), norm, L.Flatten(), L.Dense(2)])
    for weight in norm.trainable_weights:
        weight.assign(rng.uniform(-2.0, 2.0, weight.shape).astype("float32"))
    # A large mean against the spread: rounding differs between formulas.
    x = tf.constant(3.0 + rng.normal(size=(6,) + shape) * 0.1, tf.float32)
    y = tf.zeros([6, 2])
    _, y_pred, _ = compute_per_example_gradients(model, x, y, tf.ones([6]), _mse, "batched")
    np.testing.assert_array_equal(y_pred.numpy(), model(x).numpy())
