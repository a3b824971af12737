"""Preprocessing state needs a provenance before fit's first step (issue 52, finding 1).

Crafted record: private item ids include a unique id, 99950. An
IntegerLookup adapted on them holds it in its vocabulary; a DPModel that
holds the layer is refused before any step (the message names the layer and
both fixes, never the id), and trains once the vocabulary is declared
public or adapted privately (which drops the unique id and charges the
ledger once, kept through save and load).
"""

import os
import zipfile

import keras
import numpy as np
import pytest

import tfdp
from tfdp import preprocessing
from tfdp.preprocessing import provenance

UNIQUE = 99950
DELTA = 1e-5


def private_ids(n=300, seed=0):
    ids = np.random.default_rng(seed).integers(1, 10, size=n - 1)
    return np.append(ids, UNIQUE)  # one record holds the unique id


def lookup_model(lookup, nested=False):
    inputs = keras.Input((1,), dtype="int64")
    hidden = lookup(inputs)
    if nested:  # the lookup inside a model inside the DPModel
        hidden = keras.Model(inputs, hidden, name="features")(inputs)
    outputs = keras.layers.Dense(2)(hidden)
    model = tfdp.DPModel(inputs, outputs)
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit(model, ids, **kwargs):
    return model.fit(ids[:, None], (ids % 2).astype("int32"), batch_size=30, epochs=1,
                     verbose=0, **kwargs)


def adapted_lookup(name="lookup"):
    lookup = keras.layers.IntegerLookup(name=name, output_mode="one_hot")
    lookup.adapt(private_ids())
    return lookup


@pytest.mark.parametrize("nested", [False, True])
def test_a_lookup_adapted_on_the_private_records_is_refused_before_any_step(nested):
    lookup = adapted_lookup()
    assert UNIQUE in lookup.get_vocabulary()  # the leak the refusal prevents
    model = lookup_model(lookup, nested)
    with pytest.raises(ValueError) as caught:
        fit(model, private_ids())
    message = str(caught.value)
    assert "'lookup' (IntegerLookup)" in message and "vocabulary" in message
    assert "tfdp.preprocessing.adapt_privately(layer, data" in message
    assert "tfdp.preprocessing.declare_public(layer, source=" in message
    assert str(UNIQUE) not in message
    assert model.privacy.steps == 0


@pytest.fixture(scope="module")
def declared(tmp_path_factory):
    lookup = adapted_lookup()
    preprocessing.declare_public(lookup, source="the public item catalogue of 2026")
    model = lookup_model(lookup)
    fit(model, private_ids())
    path = os.path.join(tmp_path_factory.mktemp("declared"), "model.keras")
    model.save(path)
    return model, path


def test_declared_public_it_trains_and_the_statement_names_it(declared):
    model, _ = declared
    assert model.privacy.steps > 0
    statement = model.privacy.statement(DELTA)
    assert ("Preprocessing: vocabulary of 'lookup' from data declared public: the public item "
            "catalogue of 2026.") in statement


def test_a_declaration_survives_save_and_load_and_is_not_repeated(declared):
    model, path = declared
    loaded = tfdp.load_model(path)
    assert UNIQUE in loaded.get_layer("lookup").get_vocabulary()
    before = loaded.privacy.preprocessing
    assert len(before) == 1 and before[0]["kind"] == "public"
    fit(loaded, private_ids())  # accepted from the ledger's entry, not charged again
    assert loaded.privacy.preprocessing == before


def test_adapting_again_after_the_declaration_is_refused():
    lookup = adapted_lookup()
    preprocessing.declare_public(lookup, source="a public list")
    lookup.adapt(private_ids(seed=1))  # the state changed: the declaration no longer holds
    with pytest.raises(ValueError, match="changed after it was declared public"):
        fit(lookup_model(lookup), private_ids())


def test_a_vocabulary_given_to_the_constructor_needs_a_declaration():
    lookup = keras.layers.IntegerLookup(vocabulary=[1, 2, 3], name="given",
                                        output_mode="one_hot")
    with pytest.raises(ValueError, match="'given' .*given to the layer's constructor"):
        fit(lookup_model(lookup), private_ids())


def test_declare_public_refuses_an_empty_source_and_a_layer_without_state():
    with pytest.raises(ValueError, match="non-empty string"):
        preprocessing.declare_public(adapted_lookup(), source=" ")
    with pytest.raises(ValueError, match="holds no data-derived state yet"):
        preprocessing.declare_public(keras.layers.IntegerLookup(), source="public")


@pytest.fixture(scope="module")
def private(tmp_path_factory):
    lookup = keras.layers.IntegerLookup(name="lookup", output_mode="one_hot")
    entry = preprocessing.adapt_privately(lookup, private_ids(), epsilon=1.0, delta=1e-7,
                                          seed=0)
    model = lookup_model(lookup)
    fit(model, private_ids())
    path = os.path.join(tmp_path_factory.mktemp("private"), "model.keras")
    model.save(path)
    return model, entry, path


def test_private_adaptation_drops_the_unique_id_and_is_charged_once(private):
    model, entry, _ = private
    vocabulary = model.get_layer("lookup").get_vocabulary()
    assert UNIQUE not in vocabulary and len(vocabulary) > 1
    assert [e["id"] for e in model.privacy.preprocessing] == [entry["id"]]
    assert "adapted privately on the training data (DP partition selection" in (
        model.privacy.statement(DELTA))
    charged = model.privacy.epsilon(DELTA)
    fit(model, private_ids())  # a second fit does not charge the adaptation again
    assert len(model.privacy.preprocessing) == 1
    assert len(model.privacy.composed_event().events) == 2  # the steps, the adaptation once
    assert model.privacy.epsilon(DELTA) > charged  # more steps


def test_a_private_adaptation_survives_save_and_load(private):
    _, entry, path = private
    with zipfile.ZipFile(path) as archive:  # the crafted id is in no file of the model
        assert not any(str(UNIQUE).encode() in archive.read(name) for name in archive.namelist())
    loaded = tfdp.load_model(path)
    assert [e["id"] for e in loaded.privacy.preprocessing] == [entry["id"]]
    assert loaded.privacy.preprocessing[0]["additive_delta"] > 0
    fit(loaded, private_ids())
    assert len(loaded.privacy.preprocessing) == 1


def test_a_model_saved_before_its_first_fit_carries_the_charge(tmp_path):
    lookup = keras.layers.IntegerLookup(name="lookup", output_mode="one_hot")
    entry = preprocessing.adapt_privately(lookup, private_ids(), epsilon=1.0, delta=1e-7,
                                          seed=0)
    path = str(tmp_path / "untrained.keras")
    lookup_model(lookup).save(path)
    loaded = tfdp.load_model(path)
    assert [e["id"] for e in loaded.privacy.preprocessing] == [entry["id"]]
    assert loaded.privacy.epsilon(DELTA) > 0  # the adaptation, before any step
    fit(loaded, private_ids())
    assert len(loaded.privacy.composed_event().events) == 2


def test_an_adaptation_per_record_is_refused_for_a_fit_per_person():
    lookup = keras.layers.IntegerLookup(name="lookup", output_mode="one_hot")
    preprocessing.adapt_privately(lookup, private_ids(), epsilon=1.0, delta=1e-7, seed=0)
    ids = private_ids()
    with pytest.raises(ValueError, match="adapted privately per record, but this fit protects"):
        fit(lookup_model(lookup), ids, user_ids=np.arange(len(ids)) // 2,
            examples_per_user=2)


def channel_statistics(ledger):
    features = np.random.default_rng(0).normal(size=(200, 3))
    return tfdp.layers.private_channel_statistics(features, ledger, 3.0, 9.0, 2.0, seed=0)


def test_private_channel_statistics_in_a_model_are_charged_to_its_ledger():
    stats = channel_statistics(tfdp.accounting.PrivacyLedger())
    inputs = keras.Input((3,))
    model = tfdp.DPModel(inputs, keras.layers.Dense(2)(stats.layer()(inputs)))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(1).normal(size=(60, 3)).astype("float32")
    model.fit(x, np.zeros(60, "int32"), batch_size=20, epochs=1, verbose=0)
    assert model.privacy.preprocessing[0]["what"] == "mean and variance"
    assert stats.event in model.privacy.composed_event().events


class _Holder:
    """A model's two parts check_model reads: its layers and its ledger."""

    def __init__(self, layer, ledger):
        self.privacy, self._layer = ledger, layer

    def _flatten_layers(self, include_self=False):
        return [self._layer]


def test_statistics_recorded_in_the_models_own_ledger_are_not_charged_twice():
    ledger = tfdp.accounting.PrivacyLedger()
    stats = channel_statistics(ledger)
    layer = stats.layer()
    layer.build((None, 3))
    preprocessing.check_model(_Holder(layer, ledger))
    assert len(ledger.preprocessing) == 1
    assert ledger.composed_event().events == [stats.event]  # recorded once, by the release


class _Adaptable(keras.layers.Layer):
    """A custom layer with `adapt`: its weights count as data-derived state."""

    def build(self, input_shape):
        self.offset = self.add_weight(shape=(1,), initializer="zeros", trainable=False)

    def adapt(self, data):
        self.offset.assign([float(np.mean(data))])

    def call(self, x):
        return x - self.offset


def test_every_kind_of_data_derived_state_is_found_and_nothing_else():
    normalization = keras.layers.Normalization()
    normalization.adapt(np.ones((4, 2)))
    bins = keras.layers.Discretization(num_bins=2)
    bins.adapt(np.arange(10.0))
    custom = _Adaptable()
    custom.build((None, 1))
    found = {
        "adapted mean": normalization,
        "given mean": keras.layers.Normalization(mean=3.0, variance=4.0),
        "adapted bins": bins,
        "given bins": keras.layers.Discretization(bin_boundaries=[0.5]),
        "given words": keras.layers.StringLookup(vocabulary=["a"]),
        "tf-idf": keras.layers.TextVectorization(output_mode="tf_idf", vocabulary=["a"],
                                                 idf_weights=[0.5]),
        "custom": custom,
    }
    kinds = {name: provenance.data_state(layer)[0] for name, layer in found.items()}
    assert kinds == {"adapted mean": "mean and variance", "given mean": "mean and variance",
                     "adapted bins": "bin boundaries", "given bins": "bin boundaries",
                     "given words": "vocabulary", "tf-idf": "vocabulary and TF-IDF weights",
                     "custom": "state"}
    for empty in (keras.layers.StringLookup(), keras.layers.Discretization(num_bins=2),
                  keras.layers.Dense(2), keras.layers.Normalization()):
        assert provenance.data_state(empty) is None


def test_a_vectorizers_own_lookup_is_part_of_its_state_not_another_layer():
    vectorizer = keras.layers.TextVectorization(vocabulary=["a", "b"], name="words")
    inputs = keras.Input((1,), dtype="string")
    model = keras.Model(inputs, vectorizer(inputs))
    assert [layer.name for layer, _, _ in provenance._data_layers(model)] == ["words"]


def test_a_target_epsilon_counts_the_adaptation_and_its_thresholds_delta():
    lookup = keras.layers.IntegerLookup(name="lookup", output_mode="one_hot")
    preprocessing.adapt_privately(lookup, private_ids(), epsilon=1.0, delta=1e-6, seed=0)
    model = lookup_model(lookup)
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, target_epsilon=3.0,
                                                  target_delta=DELTA, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit(model, private_ids())  # 10 planned steps: sigma calibrated with what the ledger holds
    assert model.privacy.steps == 10
    assert 2.99 < model.privacy.epsilon(DELTA) <= 3.0


class _Featurizer(keras.layers.Layer):
    """A custom adaptable layer without weights of its own: its state is its lookup's."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lookup = keras.layers.IntegerLookup(
            output_mode="one_hot", max_tokens=12, pad_to_max_tokens=True)

    def adapt(self, data):
        self.lookup.adapt(data)

    def call(self, x):
        return self.lookup(x)


def test_a_custom_layer_is_fingerprinted_with_its_sublayers_vocabularies():
    featurizer = _Featurizer(name="featurizer")
    preprocessing.declare_public(featurizer, source="nothing yet")  # declared while empty
    featurizer.adapt(private_ids())  # then its lookup adapted on the private records
    assert UNIQUE in featurizer.lookup.get_vocabulary()
    model = lookup_model(featurizer)
    with pytest.raises(ValueError, match="'featurizer' .* changed after") as caught:
        fit(model, private_ids())
    assert str(UNIQUE) not in str(caught.value)
    assert model.privacy.steps == 0
