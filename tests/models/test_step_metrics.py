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


def test_chunked_metrics_equal_the_unsplit_ones():
    """With physical batches the compiled metrics are updated chunk by chunk
    (the chunk's predictions are dropped with it); they must add up to the
    unsplit step's values, on drawn rows only."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 5)).astype("float32")
    y = (x[:, 0] + 0.5 * rng.normal(size=300) > 0).astype("int64")

    def history(physical_batch_size):
        keras.utils.set_random_seed(1)
        model = tfdp.DPSequential([keras.Input((5,)), keras.layers.Dense(2)])
        model.compile(
            optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=0.5, seed=0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(1, name="top1")],
        )
        return model.fit(x, y, batch_size=40, epochs=3, verbose=0,
                         physical_batch_size=physical_batch_size).history

    unsplit, chunked = history(None), history(7)
    assert 0.3 < unsplit["accuracy"][-1] < 1.0  # neither empty nor trivial
    for name in ("accuracy", "top1", "loss"):
        np.testing.assert_allclose(chunked[name], unsplit[name], rtol=1e-5)
