"""A second `fit` on the same DPBandMF with another batch size or layout
(issue 44, item 8): refused, saying what changed (it was "this optimizer
does not hold it", though it does: on another layout)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(n=64, dim=6):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, dim)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def classifier():
    keras.utils.set_random_seed(1)
    model = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPBandMF(
        keras.optimizers.SGD(0.5), 1.0, 1.0, bands=2), loss=LOSS)
    return model


def test_a_second_fit_on_another_fixed_order_layout_says_what_changed():
    x, y = data()
    model = classifier()
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True), epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"a fixed order of 8 batches of 8.*this fit's "
                                         r"data is a fixed order of 4 batches of 16"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True), epochs=1, verbose=0)
    assert model.privacy.steps == 8


def test_a_second_fit_with_another_expected_batch_size_says_what_changed():
    x, y = data()
    model = classifier()
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=4, verbose=0)
    with pytest.raises(ValueError, match=r"expected batch size 8, .*this fit's data is cyclic "
                                         r"Poisson sampling of 64 records, expected batch size 16"):
        model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=4, verbose=0)
    assert model.privacy.steps == 4
