"""Scattering2D against kymatio 0.3.0, and as a Keras layer (fit, save, export).

The reference file is written by benchmarks/scattering_reference.py in a
separate environment with kymatio (see its docstring), so this test needs no
kymatio.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.layers import Scattering2D, compute_features
from tfdp.layers.scattering import num_coefficients

REFERENCE = os.path.join(os.path.dirname(__file__), "data", "scattering_reference.npz")
TOLERANCE = 1e-3


def relative_error(actual, expected):
    return np.linalg.norm(actual - expected) / np.linalg.norm(expected)


def order_channels(J, L, channels):
    """Output channels of scattering orders 0, 1 and 2."""
    k = num_coefficients(J, L)
    bounds = {0: (0, 1), 1: (1, 1 + J * L), 2: (1 + J * L, k)}
    return {
        order: [c * k + i for c in range(channels) for i in range(*bounds[order])]
        for order in bounds
    }


@pytest.fixture(scope="module")
def reference():
    return np.load(REFERENCE)


@pytest.mark.parametrize("case", ["fmnist28", "rect"])
def test_matches_kymatio_per_image_and_order(reference, case):
    x, expected = reference[f"{case}_x"], reference[f"{case}_s"]
    J, L = (int(v) for v in reference[f"{case}_JL"])
    actual = np.asarray(Scattering2D(J=J, L=L)(x))
    assert actual.shape == expected.shape
    for a, e in zip(actual, expected):
        assert relative_error(a, e) < TOLERANCE
    # Second-order coefficients carry little energy: check each order alone.
    for idx in order_channels(J, L, x.shape[-1]).values():
        assert relative_error(actual[..., idx], expected[..., idx]) < TOLERANCE


def test_reference_check_catches_a_wrong_angle_order(reference):
    """Negative control: first-order angles in reverse order (a wrong filter
    angle convention) must fail the tolerance, in order 1 and overall."""
    x, expected = reference["fmnist28_x"], reference["fmnist28_s"]
    actual = np.asarray(Scattering2D(J=2, L=8)(x))
    swapped = actual.copy()
    for j in range(2):
        first = 1 + 8 * j
        swapped[..., first:first + 8] = actual[..., first:first + 8][..., ::-1]
    first_order = order_channels(2, 8, 1)[1]
    assert relative_error(swapped[..., first_order], expected[..., first_order]) > 10 * TOLERANCE
    assert relative_error(swapped, expected) > TOLERANCE


@pytest.mark.parametrize("J, L, max_order, shape", [
    (2, 8, 2, (28, 28, 1)), (1, 4, 2, (8, 12, 3)), (3, 2, 1, (16, 16, 2)),
])
def test_output_shape_and_channel_count(J, L, max_order, shape):
    layer = Scattering2D(J=J, L=L, max_order=max_order)
    out = layer(np.zeros((2,) + shape, np.float32))
    expected = (2, shape[0] // 2**J, shape[1] // 2**J, shape[2] * num_coefficients(J, L, max_order))
    assert tuple(out.shape) == expected == layer.compute_output_shape((2,) + shape)
    assert layer.weights == []


def test_channels_are_transformed_independently(reference):
    """Input channel c fills output channels c*K..(c+1)*K-1 with its own
    single-channel transform."""
    x = reference["rect_x"]
    both = np.asarray(Scattering2D(J=3, L=4)(x))
    k = num_coefficients(3, 4)
    for c in range(2):
        alone = np.asarray(Scattering2D(J=3, L=4)(x[..., c:c + 1]))
        np.testing.assert_allclose(both[..., c * k:(c + 1) * k], alone, atol=1e-6)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="J"):
        Scattering2D(J=0)
    with pytest.raises(ValueError, match="max_order"):
        Scattering2D(max_order=3)
    with pytest.raises(ValueError, match="2\\^J"):
        Scattering2D(J=3)(np.zeros([1, 6, 6, 1], np.float32))


def scatter_model():
    return tfdp.DPSequential([
        keras.Input((28, 28, 1)),
        Scattering2D(J=2, L=8),
        keras.layers.GroupNormalization(27, center=False, scale=False),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])


def test_fit_save_and_export(tmp_path, reference):
    x = np.repeat(reference["fmnist28_x"], 8, axis=0)
    y = np.arange(len(x)) % 10
    model = scatter_model()
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(1.0, l2_norm_clip=0.1, noise_multiplier=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = model.layers[-1].kernel.numpy().copy()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not np.allclose(model.layers[-1].kernel.numpy(), before)
    assert model.privacy.epsilon(delta=1e-5) > 0
    expected = model.predict(x[:4], verbose=0)

    model.save(tmp_path / "scatter.keras")
    loaded = keras.saving.load_model(tmp_path / "scatter.keras")
    assert loaded.layers[0].get_config()["J"] == 2
    np.testing.assert_allclose(loaded.predict(x[:4], verbose=0), expected, atol=1e-5)

    model.export(str(tmp_path / "export"), verbose=False)
    exported = tf.saved_model.load(str(tmp_path / "export"))  # kept: it owns the variables
    np.testing.assert_allclose(exported.serve(x[:4]).numpy(), expected, atol=1e-5)


def test_cached_features_equal_the_layer(reference):
    x = reference["fmnist28_x"]
    layer = Scattering2D(J=2, L=8)
    cached = compute_features(layer, x, batch_size=2)
    np.testing.assert_allclose(cached, np.asarray(layer(x)), atol=1e-6)
    with pytest.raises(ValueError, match="trainable weights"):
        compute_features(keras.layers.Dense(3), x)
