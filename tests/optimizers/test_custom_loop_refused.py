"""A custom training loop (tf.GradientTape + apply_gradients) with a tfdp
optimizer is refused before anything is applied, and the error says what
to do: DP training runs through `fit` of a DPModel / DPSequential. The
advice used to be "build a DPSequential", which the loop already had."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp


def test_custom_loop_on_a_dp_sequential_is_told_to_use_fit():
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    optimizer = tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.1)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.copy() for w in model.get_weights()]
    x = np.ones((8, 4), "float32")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x)))
    gradients = tape.gradient(loss, model.trainable_variables)
    with pytest.raises(ValueError) as caught:
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    message = str(caught.value)
    assert "custom training loop" in message
    assert "through `model.fit`" in message
    assert "DPSGD" in message
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)  # nothing was applied
