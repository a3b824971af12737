"""State changed after fit's provenance check is refused where it would be released.

Crafted record: private item ids include a unique id, 99950. A lookup
adapted privately (which drops it) and then adapted again with Keras's
plain `adapt` (which keeps it) must not reach a saved file, an export, a
checkpoint, the next epoch's steps, nor a statement that says "covered";
a file whose vocabulary was edited after saving is refused when its
statement is produced.
"""

import glob
import os
import shutil
import zipfile

import keras
import numpy as np
import pytest

import tfdp
from tfdp import preprocessing

UNIQUE = 99950
DELTA = 1e-5


def private_ids(n=300, seed=0):
    ids = np.random.default_rng(seed).integers(1, 10, size=n - 1)
    return np.append(ids, UNIQUE)


def private_lookup():
    lookup = keras.layers.IntegerLookup(
        name="lookup", output_mode="one_hot", max_tokens=12, pad_to_max_tokens=True)
    preprocessing.adapt_privately(lookup, private_ids(), epsilon=1.0, delta=1e-7, seed=0)
    assert UNIQUE not in lookup.get_vocabulary()
    return lookup


def lookup_model(lookup):
    inputs = keras.Input((1,), dtype="int64")
    model = tfdp.DPModel(inputs, keras.layers.Dense(2)(lookup(inputs)))
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit(model, epochs=1, **kwargs):
    ids = private_ids()
    return model.fit(ids[:, None], (ids % 2).astype("int32"), batch_size=30, epochs=epochs,
                     verbose=0, **kwargs)


def files_holding(folder, needle):
    hits = []
    for path in glob.glob(os.path.join(folder, "**"), recursive=True):
        if not os.path.isfile(path):
            continue
        blobs = [open(path, "rb").read()]
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                blobs += [archive.read(name) for name in archive.namelist()]
        hits += [path for blob in blobs if needle in blob]
    return hits


def refused_as_stale(caught):
    message = str(caught.value)
    assert "'lookup' (IntegerLookup)" in message and "changed after" in message
    assert "adapt_privately" in message and "declare_public" in message
    assert str(UNIQUE) not in message


@pytest.fixture(scope="module")
def readapted():
    lookup = private_lookup()
    model = lookup_model(lookup)
    fit(model)
    lookup.adapt(private_ids())  # plain Keras adapt after fit: the unique id is back
    assert UNIQUE in lookup.get_vocabulary()
    return model


@pytest.mark.parametrize("release", ["save", "save_weights", "export"])
def test_state_readapted_after_fit_is_refused_by_every_write(readapted, release, tmp_path):
    name = {"save": "m.keras", "save_weights": "m.weights.h5", "export": "exported"}[release]
    with pytest.raises(ValueError) as caught:
        getattr(readapted, release)(str(tmp_path / name))
    refused_as_stale(caught)
    assert files_holding(str(tmp_path), str(UNIQUE).encode()) == []
    assert files_holding(str(tmp_path), np.int64(UNIQUE).tobytes()) == []


def test_a_statement_is_refused_for_state_readapted_after_fit(readapted):
    with pytest.raises(ValueError) as caught:
        readapted.privacy.statement(DELTA)
    refused_as_stale(caught)


def test_a_callback_readapting_the_lookup_stops_fit_before_the_next_epoch(tmp_path):
    lookup = private_lookup()
    model = lookup_model(lookup)

    class Readapt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            lookup.adapt(private_ids())

    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "ck.keras"))
    with pytest.raises(ValueError) as caught:
        fit(model, epochs=2, callbacks=[Readapt(), checkpoint])
    refused_as_stale(caught)
    assert model.privacy.steps == 10  # the first epoch only: nothing trained on the new state
    assert files_holding(str(tmp_path), str(UNIQUE).encode()) == []


def test_a_file_whose_vocabulary_was_edited_is_refused_at_its_statement(tmp_path):
    model = lookup_model(private_lookup())
    fit(model)
    path = str(tmp_path / "m.keras")
    model.save(path)
    edited = str(tmp_path / "edited.keras")
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(edited, "w") as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename.endswith("vocabulary.txt"):
                data = data.rstrip(b"\n").rsplit(b"\n", 1)[0] + f"\n{UNIQUE}\n".encode()
            target.writestr(item, data)
    tfdp.load_model(path).privacy.statement(DELTA)  # the unedited file: accepted
    loaded = tfdp.load_model(edited)
    assert UNIQUE in loaded.get_layer("lookup").get_vocabulary()
    with pytest.raises(ValueError) as caught:
        loaded.privacy.statement(DELTA)
    refused_as_stale(caught)


def test_a_clone_whose_lookup_lost_its_vocabulary_is_refused_before_any_step():
    original = lookup_model(private_lookup())
    clone = keras.models.clone_model(original)
    clone.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"'lookup' \(IntegerLookup\) has no vocabulary.*"
                                         r"clone_model") as caught:
        fit(clone)
    assert "adapt_privately" in str(caught.value) and "declare_public" in str(caught.value)
    assert clone.privacy.steps == 0


class ReadaptForOneBatch(keras.callbacks.Callback):
    """Adapts the lookup on the raw private ids (the unique id back in its
    vocabulary) as batch `at` begins and restores the private vocabulary as
    it ends: every check at an epoch's start, a save or a statement sees the
    private state, and on main the compiled step, traced at the first batch,
    looked values up in the plain vocabulary for the whole fit."""

    def __init__(self, lookup, at):
        super().__init__()
        self.lookup, self.at = lookup, at
        self.private = lookup.get_vocabulary(include_special_tokens=False)

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.at:
            self.lookup.adapt(private_ids())

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            self.lookup.set_vocabulary(self.private)


@pytest.mark.parametrize("at", [0, 3])
def test_a_callback_readapting_the_lookup_for_one_batch_is_refused_before_that_step(at, tmp_path):
    lookup = private_lookup()
    model = lookup_model(lookup)
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "ck.keras"))
    with pytest.raises(ValueError) as caught:
        fit(model, callbacks=[ReadaptForOneBatch(lookup, at), checkpoint])
    refused_as_stale(caught)
    assert model.privacy.steps == at  # no step ran through the plain vocabulary
    assert files_holding(str(tmp_path), str(UNIQUE).encode()) == []


class Centre(keras.layers.Layer):
    """An adaptable layer of one's own whose state is a variable the step
    reads as it runs: a change needs no retrace to reach the steps."""

    def build(self, shape):
        self.centre = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False,
                                      name="centre")

    def adapt(self, data):
        self.build(data.shape)
        self.centre.assign(np.mean(data, 0))

    def call(self, x):
        return x - self.centre


class ShiftForOneBatch(keras.callbacks.Callback):
    """Sets the centre to the crafted id for batch `at` and restores it."""

    def __init__(self, layer, at):
        super().__init__()
        self.layer, self.at = layer, at
        self.saved = layer.centre.numpy()

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.at:
            self.layer.centre.assign(np.full(self.saved.shape, float(UNIQUE), "float32"))

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            self.layer.centre.assign(self.saved)


def test_a_callback_changing_a_variable_state_for_one_batch_is_refused_before_that_step():
    centre = Centre(name="centre")
    centre.adapt(np.ones((4, 1), "float32"))
    preprocessing.declare_public(centre, source="a public sample")
    inputs = keras.Input((1,))
    model = tfdp.DPModel(inputs, keras.layers.Dense(2)(centre(inputs)))
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids = private_ids().astype("float32")
    with pytest.raises(ValueError, match=r"'centre' \(Centre\).*changed after") as caught:
        model.fit(ids[:, None], (ids % 2).astype("int32"), batch_size=30, epochs=1, verbose=0,
                  callbacks=[ShiftForOneBatch(centre, 3)])
    assert str(UNIQUE) not in str(caught.value)
    assert model.privacy.steps == 3
