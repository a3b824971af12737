"""A DP-trained encoder saved and loaded by plain Keras keeps its ledger
(seventh review, F4).

Model A (a nested `keras.Model` encoder and a head) trains by DP-SGD; the
encoder is saved by plain Keras (its own `save_weights` / `save`, or a
`keras.Model` of A's layers) and loaded into fresh variables. A DP model
built on the loaded encoder must charge A's training: before, it stated its
own steps only. `tf.train.Checkpoint` writes values only and is documented
as untraceable (docs/guides/save-load-export.md).
"""

import h5py
import keras
import numpy as np
import pytest

import tfdp
from tests.carrier_models import encoder, model_on
from tfdp.models import keras_file_ledgers

DELTA = 1e-5
CRAFTED = 4711.0625  # a raw feature value of one record: never in a file


@pytest.fixture(scope="module")
def trained():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    x[0, 1] = CRAFTED
    y = (x[:, 0] > 0).astype("int32")
    a = model_on(encoder(), "A")
    a.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    a.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0)
    return a, a.privacy.epsilon(DELTA)


def _carries_a(b, epsilon):
    assert [c.label for c in b.privacy.carried.values()] == ["model 'A'"]
    assert b.privacy.epsilon(DELTA) == pytest.approx(epsilon, rel=1e-12)
    assert "model 'A'" in b.privacy.statement(DELTA)


def test_the_nested_encoders_save_weights_and_load_weights(trained, tmp_path):
    a, epsilon = trained
    path = tmp_path / "enc.weights.h5"
    a.get_layer("enc").save_weights(path)  # keras.Model.save_weights, not a DP model's
    loaded = encoder()
    loaded.load_weights(path)
    _carries_a(model_on(loaded, "B"), epsilon)
    with h5py.File(path, "r") as file:  # the file holds events, no record's raw value
        text = bytes(file[keras_file_ledgers.DATASET][()]).decode("utf-8")
    assert '"sha256"' in text and "4711" not in text
    assert np.float32(CRAFTED).tobytes() not in path.read_bytes()


def test_the_nested_encoders_save_and_keras_load_model(trained, tmp_path):
    a, epsilon = trained
    path = tmp_path / "enc.keras"
    a.get_layer("enc").save(path)
    _carries_a(model_on(keras.models.load_model(path), "B"), epsilon)


def test_a_keras_model_of_the_trained_layers_saved_and_loaded(trained, tmp_path):
    a, epsilon = trained
    inputs = keras.Input((4,))
    features = keras.Model(inputs, a.get_layer("enc")(inputs), name="features")
    path = tmp_path / "features.keras"
    features.save(path)
    _carries_a(model_on(keras.models.load_model(path), "B"), epsilon)


def test_weights_that_carry_nothing_get_no_ledger(tmp_path):
    """Control: a fresh encoder's file has no ledger, and loads as plain Keras's."""
    path = tmp_path / "fresh.weights.h5"
    encoder("fresh").save_weights(path)
    with h5py.File(path, "r") as file:
        assert keras_file_ledgers.DATASET not in file
    loaded = encoder()
    loaded.load_weights(path)
    assert model_on(loaded, "B").privacy.carried == {}


def test_a_damaged_file_ledger_is_refused(trained, tmp_path):
    a, _ = trained
    path = tmp_path / "enc.weights.h5"
    a.get_layer("enc").save_weights(path)
    with h5py.File(path, "r+") as file:
        text = bytes(file[keras_file_ledgers.DATASET][()]).replace(b'"count": 3', b'"count": 1')
        del file[keras_file_ledgers.DATASET]
        file.create_dataset(keras_file_ledgers.DATASET, data=np.frombuffer(text, np.uint8))
    with pytest.raises(ValueError, match="ledger that these weights carry is refused.*checksum"):
        encoder().load_weights(path)


def test_sharded_weights_that_carry_a_training_are_refused(trained, tmp_path):
    a, _ = trained
    refusal = "trained with differential privacy.*model 'A'.*DPModel.save"
    with pytest.raises(ValueError, match=refusal):
        a.get_layer("enc").save_weights(tmp_path / "enc.weights.json", max_shard_size=1)


# -- a file whose ledger dataset is gone (review 8, G2): Keras's own groups are
# marked, so a load refuses it instead of reading it as never trained.


def _without_ledger(source, target=None):
    """Deletes the ledger dataset in place (h5py), or copies every other
    group and the root's attributes into `target` (a rewriting tool)."""
    if target is None:
        with h5py.File(source, "r+") as file:
            del file[keras_file_ledgers.DATASET]
        return source
    with h5py.File(source, "r") as src, h5py.File(target, "w") as dst:
        for key in src:
            if key != keras_file_ledgers.DATASET:
                src.copy(key, dst)
        for key, value in src.attrs.items():
            dst.attrs[key] = value
    return target


def _datasets_copied(source, target):
    """Copies each weight dataset (with its attributes, as h5py's copy does)
    into groups made anew: a tool that walks the arrays (review 9, H7)."""
    with h5py.File(source, "r") as src, h5py.File(target, "w") as dst:
        names = []
        src.visititems(lambda name, item: names.append(name) if isinstance(
            item, h5py.Dataset) and name != keras_file_ledgers.DATASET else None)
        for name in names:
            parent, _, leaf = name.rpartition("/")
            src.copy(src[name], dst.require_group(parent or "/"), leaf)
    return target


@pytest.mark.parametrize("route", ["dataset_deleted", "groups_copied", "layer_group_copied",
                                   "datasets_copied"])
def test_a_file_whose_ledger_was_removed_is_refused(trained, tmp_path, route):
    a, _ = trained
    path = tmp_path / "enc.weights.h5"
    a.get_layer("enc").save_weights(path)
    if route == "dataset_deleted":
        stripped = _without_ledger(path)
    elif route == "groups_copied":
        stripped = _without_ledger(path, tmp_path / "copy.weights.h5")
    elif route == "datasets_copied":
        stripped = _datasets_copied(path, tmp_path / "arrays.weights.h5")
    else:  # only the Dense layer's group, nothing at the root
        stripped = tmp_path / "layer.weights.h5"
        with h5py.File(path, "r") as src, h5py.File(stripped, "w") as dst:
            dst.create_group("layers")
            src.copy("layers/dense", dst["layers"])
    loaded = encoder()
    with pytest.raises(ValueError, match="privacy ledger.*is missing.*tfdp_carried_ledger"):
        loaded.load_weights(stripped)


def test_a_file_without_ledger_or_mark_still_loads(tmp_path):
    """Negative control: a plain file (no training, no mark) loads as before."""
    path = tmp_path / "fresh.weights.h5"
    encoder("fresh").save_weights(path)
    with h5py.File(path, "r") as file:
        marked = [name for name, group in _groups(file) if "tfdp_ledger" in group.attrs]
    assert marked == []
    encoder().load_weights(path)


def _groups(file):
    found = [("/", file)]
    file.visititems(lambda name, item: found.append((name, item)) if isinstance(
        item, h5py.Group) else None)
    return found
