"""DP-BandMF refuses coefficients whose noise recurrence is numerically
unstable for the planned steps, before a step is charged: a tiny c_0 or an
overflowing filter trained to NaN weights without an error."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.mechanisms import bandmf


def _model(coefficients):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=tfdp.optimizers.DPBandMF(
        keras.optimizers.SGD(0.1), 1.0, 1.0, bands=len(coefficients), seed=0,
        coefficients=coefficients), loss="mse")
    return model


def _pipeline():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 2)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(4, drop_remainder=True)


@pytest.mark.parametrize("coefficients", [[1e-12, 1.0], [1e-300, 1.0], [1.0, 2.0],
                                          [1.0, 0.0, 8.0]])
def test_unstable_coefficients_are_refused_before_a_step(coefficients):
    model = _model(coefficients)
    with pytest.raises(ValueError, match="numerically unstable.*coefficients="):
        model.fit(_pipeline(), epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
    assert model.privacy.composed_event().events == []
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)


def test_stable_coefficients_and_the_default_train():
    """Negative control: a dominant c_0 and the optimal coefficients pass."""
    for coefficients in ([1.0, 0.5], None):
        model = _model([1.0, 0.5]) if coefficients else None
        if model is None:
            keras.utils.set_random_seed(0)
            model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile(optimizer=tfdp.optimizers.DPBandMF(
                keras.optimizers.SGD(0.1), 1.0, 1.0, bands=4, seed=0), loss="mse")
        model.fit(_pipeline(), epochs=2, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 16
        assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)


def test_the_gain_of_the_optimal_coefficients_is_far_below_the_limit():
    for bands, steps in ((2, 100), (8, 2000), (64, 20000)):
        coefficients = bandmf.optimal_coefficients(bands, steps)
        bandmf.check_stable(coefficients, steps)
        gain = np.abs(bandmf.inverse_impulse_response(coefficients, steps)).sum()
        assert gain < bandmf.MAX_NOISE_GAIN / 100
