"""A saved model loads ready to train on as it was: the same trainable
variables, the LoRA factors as they were, and the optimizer's state.

Plain Keras loses all three for LoRA layers: it saves each LoRA kernel with
its factors merged in and loads the factors as zeros (then both factors get
zero gradients: LoRA cannot train on), it does not save a variable's own
`trainable` flag (a frozen bias trains after loading), and the optimizer's
state is then dropped ("Skipping variable loading for optimizer"), since it
was built for other variables.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp

L = keras.layers


def _lora_model():
    ids = keras.Input((6,), dtype="int32")
    embedding = L.Embedding(20, 8)
    dense = L.Dense(8, activation="tanh")
    projection = L.EinsumDense("abc,cd->abd", output_shape=(None, 4), bias_axes="d")
    h = projection(dense(embedding(ids)))
    outputs = L.Dense(2)(L.GlobalAveragePooling1D()(h))
    model = tfdp.DPModel(ids, outputs)
    for layer in (embedding, dense, projection):
        layer.enable_lora(2)
    dense.bias.trainable = False  # a variable's own flag, which Keras does not save
    return model


def _trained(model, x, y):
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=0.5,
                                                  momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model


def load_quietly(path):
    """`tfdp.load_model`, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = tfdp.load_model(path)
    return loaded, [str(w.message) for w in caught]


def trainable_mask(model):
    """Which of `model.weights` train (paths are not kept by Keras's loading:
    "dp_sequential/dense/kernel" may load as "dense/kernel")."""
    trainable = {id(v) for v in model.trainable_variables}
    return [id(v) in trainable for v in model.weights]


def assert_same_training_state(model, loaded):
    assert trainable_mask(loaded) == trainable_mask(model)
    assert [v.name for v in loaded.weights] == [v.name for v in model.weights]
    for saved, restored in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(restored.numpy(), saved.numpy(), err_msg=saved.path)
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(restored.numpy(), saved.numpy(), err_msg=saved.path)
    assert loaded.privacy.steps == model.privacy.steps


@pytest.fixture(scope="module")
def lora_trained():
    """A trained LoRA model and its data, shared: the first test only saves
    it, the second puts back every value it changes (and checks that it did)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 20, (32, 6)).astype("int32"), rng.integers(0, 2, 32)
    return _trained(_lora_model(), x, y), x, y


@pytest.mark.xdist_group("lora_trained")  # one worker: the model trains once
def test_lora_layers_load_with_their_factors_flags_and_optimizer_state(tmp_path, lora_trained):
    model, x, y = lora_trained
    factors = [v for v in model.trainable_variables if "lora" in v.path]
    assert len(factors) == 6 and all(np.any(v.numpy() != 0) for v in factors)
    path = str(tmp_path / "lora.keras")
    model.save(path)

    loaded, messages = load_quietly(path)

    assert not [m for m in messages if "Skipping variable loading" in m], messages
    assert_same_training_state(model, loaded)
    np.testing.assert_allclose(loaded.predict(x[:4], verbose=0), model.predict(x[:4], verbose=0),
                               rtol=1e-5, atol=1e-6)
    # It trains on: the factors move (zero factors would get zero gradients
    # but for the noise), the frozen kernels and bias do not.
    frozen = [(v, v.numpy()) for v, trains in zip(loaded.weights, trainable_mask(loaded))
              if not trains and v.name != "dp_steps"]
    assert len(frozen) == 4  # 3 LoRA kernels and the bias
    before = [v.numpy() for v in loaded.trainable_variables]
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert all(np.any(v.numpy() != b) for v, b in zip(loaded.trainable_variables, before))
    for v, value in frozen:
        np.testing.assert_array_equal(v.numpy(), value, err_msg=v.path)
    assert loaded.privacy.steps == 2 * model.privacy.steps


@pytest.mark.xdist_group("lora_trained")
def test_weights_files_restore_the_lora_factors(tmp_path, lora_trained):
    """`save_weights` / `load_weights` (BackupAndRestore's route) keep them too."""
    model = lora_trained[0]
    assert sum(np.any(v.numpy() != 0) for v in model.weights if "lora" in v.path) == 6
    path = str(tmp_path / "lora.weights.h5")
    model.save_weights(path)
    expected = [v.numpy() for v in model.weights]
    for v in model.weights:
        if "lora" in v.path:
            v.assign(tf.zeros_like(v))
    model.load_weights(path)
    for v, value in zip(model.weights, expected):
        np.testing.assert_array_equal(v.numpy(), value, err_msg=v.path)


def test_a_model_without_lora_or_frozen_variables_is_unchanged(tmp_path):
    """Control: nothing to restore; the file holds no extra variables."""
    keras.utils.set_random_seed(2)
    rng = np.random.default_rng(2)
    model = tfdp.DPSequential([keras.Input((4,)), L.Dense(3, activation="tanh"), L.Dense(2)])
    x, y = rng.random((32, 4), dtype=np.float32), rng.integers(0, 2, 32)
    model = _trained(model, x, y)
    path = str(tmp_path / "plain.keras")
    model.save(path)
    loaded, messages = load_quietly(path)
    assert not messages
    assert_same_training_state(model, loaded)
