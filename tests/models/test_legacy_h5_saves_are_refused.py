"""Keras's legacy HDF5 format has no place for a ledger: saving in it is
refused where the ledger would be lost (eighth review, G1 and G7).

Keras 3 still writes the legacy format for a `.h5` / `.hdf5` name
(`model.save`, `keras.saving.save_model`), by
`legacy_h5_format.save_model_to_hdf5`, which the `.keras` / `.weights.h5`
hook (`tfdp.models.keras_file_ledgers`) never saw. Before: a DP-trained
encoder saved as `enc.h5` and loaded lost its training (a model built on it
stated its own steps only), and a DP model saved as `a.h5` gave a file no
loader reads. Now both are refused before a file is written; an untrained
plain model still saves to `.h5`.
"""

import keras
import numpy as np
import pytest

import tfdp


def encoder(name="enc"):
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(3, name="enc_dense")(inputs), name=name)


def model_on(layer, name):
    inputs = keras.Input((4,))
    return tfdp.DPModel(inputs, keras.layers.Dense(2, name="head")(layer(inputs)), name=name)


def compiled(model):
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.fixture(scope="module")
def trained():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    a = compiled(model_on(encoder(), "A"))
    a.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)
    return a


def _features(a):
    inputs = keras.Input((4,))
    return keras.Model(inputs, a.get_layer("enc")(inputs), name="features")


PLAIN_SAVES = {
    "encoder.save": lambda a, path: a.get_layer("enc").save(path),
    "keras.saving.save_model": lambda a, path: keras.saving.save_model(a.get_layer("enc"), path),
    "a keras.Model of the trained layers": lambda a, path: _features(a).save(path),
}


@pytest.mark.parametrize("name", ["enc.h5", "enc.hdf5"])
@pytest.mark.parametrize("route", PLAIN_SAVES)
def test_dp_trained_weights_saved_by_plain_keras_as_legacy_h5_are_refused(
        trained, tmp_path, route, name):
    with pytest.raises(ValueError, match="legacy HDF5") as refusal:
        PLAIN_SAVES[route](trained, tmp_path / name)
    message = str(refusal.value)
    assert "model 'A'" in message
    assert ".keras" in message and ".weights.h5" in message and "DPModel.save" in message
    assert list(tmp_path.iterdir()) == []  # nothing written


DP_SAVES = {
    "DPModel.save": lambda model, path: model.save(path),
    "keras.saving.save_model": lambda model, path: keras.saving.save_model(model, path),
    "save_format='h5'": lambda model, path: keras.saving.save_model(model, path, save_format="h5"),
}


@pytest.mark.parametrize("route", DP_SAVES)
def test_a_trained_dp_model_saved_as_legacy_h5_is_refused(trained, tmp_path, route):
    with pytest.raises(ValueError, match="legacy HDF5") as refusal:
        DP_SAVES[route](trained, tmp_path / "a.h5")
    message = str(refusal.value)
    assert "'A'" in message
    assert ".keras" in message and ".weights.h5" in message and "DPModel.save" in message
    assert list(tmp_path.iterdir()) == []  # not even DPModel.save's temporary file


def test_an_untrained_dp_model_saved_as_legacy_h5_is_refused_too(tmp_path):
    """No loader reads a DP model from a legacy file ("Unknown layer: 'DPModel'")."""
    with pytest.raises(ValueError, match="legacy HDF5"):
        compiled(model_on(encoder(), "untrained")).save(tmp_path / "u.h5")
    assert list(tmp_path.iterdir()) == []


def test_an_untrained_plain_encoder_still_saves_as_legacy_h5(tmp_path):
    """Negative control: weights that carry no training keep Keras's format."""
    plain = encoder("fresh")
    path = tmp_path / "fresh.h5"
    plain.save(path)
    loaded = keras.models.load_model(path)
    for saved, read in zip(plain.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(saved, read)


@pytest.mark.parametrize("name", ["ckpt.h5", "ckpt-{epoch:02d}.hdf5"])
def test_a_legacy_h5_model_checkpoint_is_refused_before_the_first_step(tmp_path, name):
    """Before: `keras.callbacks.ModelCheckpoint('x.h5')` was refused only at
    its first save, after the epoch's steps were taken and charged."""
    model = compiled(model_on(encoder(), "ckpt"))
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt.keras"))
    checkpoint.filepath = str(tmp_path / name)  # (its constructor takes .keras and .h5 only)
    x, y = np.ones((16, 4), "float32"), np.zeros(16, "int32")
    with pytest.raises(ValueError, match="legacy HDF5") as refusal:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[checkpoint])
    assert model.privacy.steps == 0 and int(model.optimizer.iterations.numpy()) == 0
    message = str(refusal.value)
    assert "ModelCheckpoint" in message and ".keras" in message and "DPModel.save" in message
    assert list(tmp_path.iterdir()) == []
    # Negative control: a weights-only checkpoint keeps its ledger and runs.
    weights = keras.callbacks.ModelCheckpoint(str(tmp_path / "w.weights.h5"), save_weights_only=True)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[weights])
    assert model.privacy.steps > 0 and (tmp_path / "w.weights.h5").exists()
