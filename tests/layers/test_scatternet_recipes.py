"""ScatterNet recipes: cached features are the same mechanism as the inline
transform, and `tfdp train --features scatternet` runs end to end."""

import json
import struct

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp import cli, recipes
from tfdp.per_example import compute_per_example_gradients


@pytest.mark.parametrize("features", ["scatternet", "scatternet_cnn"])
def test_cached_features_give_the_inline_per_example_gradients(features):
    """Same weights: the model on cached features and the one with
    Scattering2D as first layer have equal per-example gradient norms and
    outputs, and both take the batched path (Scattering2D is declared
    per-example; undeclared, the inline model would go to the vectorized
    path)."""
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(6, 28, 28, 1)).astype(np.float32)
    y = np.arange(6) % 10
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    inline = recipes.build_model("fashion_mnist", features=features, cached=False)
    cached = recipes.build_model("fashion_mnist", features=features)
    cached.set_weights(inline.get_weights())
    (feats,) = recipes.prepare_inputs("fashion_mnist", features, x)
    assert feats.shape == (6, 7, 7, 81)
    g_inline, p_inline, _ = compute_per_example_gradients(
        inline, tf.constant(x), tf.constant(y), tf.ones([6]), loss)
    g_cached, p_cached, _ = compute_per_example_gradients(
        cached, tf.constant(feats), tf.constant(y), tf.ones([6]), loss)
    assert g_inline.path == g_cached.path == "batched"
    np.testing.assert_allclose(g_inline.sq_norms(), g_cached.sq_norms(), rtol=1e-4)
    np.testing.assert_allclose(p_inline, p_cached, atol=1e-5)


def test_recipe_settings_and_errors():
    linear = recipes.defaults("fashion_mnist", "scatternet")
    assert (linear["batch_size"], linear["learning_rate"], linear["momentum"]) == (8192, 16.0, 0.9)
    cnn = recipes.defaults("fashion_mnist", "scatternet_cnn")
    assert (cnn["batch_size"], cnn["learning_rate"], cnn["l2_norm_clip"]) == (2048, 4.0, 0.1)
    assert recipes.defaults("digits") == recipes.DEFAULTS["digits"]
    with pytest.raises(ValueError, match="28x28"):
        recipes.build_model("digits", features="scatternet")
    with pytest.raises(ValueError, match="features"):
        recipes.defaults("fashion_mnist", "wavelets")


def _write_idx(path, array):
    array = np.asarray(array, np.uint8)
    header = struct.pack(">I", 0x0800 + array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.tobytes())


def test_cli_trains_on_scatternet_features(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 64), ("t10k", 16)):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    cli.main(["train", "--dataset", "fashion_mnist", "--features", "scatternet",
              "--data-dir", str(tmp_path), "--epochs", "1", "--batch-size", "16",
              "--epsilon", "3", "--verbose", "0", "--seed", "0"])
    result = json.loads(capsys.readouterr().out)
    assert result["features"] == "scatternet"
    assert result["steps"] == 4 and 2.97 <= result["epsilon"] <= 3.0  # calibrated to spend 3
    assert result["learning_rate"] == 16.0
