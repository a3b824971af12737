"""Training metrics count the drawn examples only, never the padding rows."""

import keras
import numpy as np
import pytest

import tfdp


@pytest.mark.parametrize("physical_batch_size", [None, 3])
def test_accuracy_ignores_padding_rows(physical_batch_size):
    # Padding rows repeat record 0 (label 0), which the model always predicts;
    # every other record has label 1. Counting padding would lift accuracy.
    n = 400
    x = np.ones((n, 2), "float32")
    y = np.ones(n, "int64")
    y[0] = 0
    model = tfdp.DPSequential([
        keras.Input((2,)),
        keras.layers.Dense(2, kernel_initializer="zeros",
                           bias_initializer=keras.initializers.Constant([10.0, 0.0])),
    ])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(1e-6, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(x, y, batch_size=2, epochs=1, steps_per_epoch=20, verbose=0,
                        physical_batch_size=physical_batch_size)
    assert history.history["accuracy"][0] < 0.1
