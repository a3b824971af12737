"""Loaded weights carry their ledger, and a carried charge never shrinks
below what a model trained on (review 3 of issue 52 finding 7, C1 and C2).

C1: a layer reused from a model loaded with `keras.models.load_model` (or
`load_weights`) started a fresh ledger: a new model built on it stated only
its own steps. The loaded model's variables now carry the loaded training,
and its privately adapted lookup keeps its provenance in the new model.

C2: rolling the source model back (`load_weights` of an earlier file)
lowered the charge of a model whose head had trained on the discarded
weights. What a model carries when it trains is now its floor.
"""

import keras
import numpy as np
import pytest

import tfdp
from tfdp.accounting import PrivacyLedger, dpsgd_event
from tfdp.preprocessing import adapt_privately

N, DIM, BATCH, STEPS = 64, 4, 16, 3
DELTA = 1e-5
CRAFTED_ID = 99950  # a unique raw id: it must not reach the vocabulary


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, DIM)).astype(np.float32), rng.integers(0, 2, N)


def train(model, x, y, steps=STEPS):
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=steps, verbose=0)
    return model


def source(name="pretrained"):
    return tfdp.DPSequential(
        [keras.Input((DIM,)), keras.layers.Dense(3, name="encoder"), keras.layers.Dense(2)],
        name=name)


def on(encoder, name):
    inputs = keras.Input((DIM,))
    return tfdp.DPModel(inputs, keras.layers.Dense(2, name="head")(encoder(inputs)), name=name)


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    """A trained model's .keras and .weights.h5 files, and its epsilon."""
    model = train(source(), *data)
    folder = tmp_path_factory.mktemp("saved")
    model.save(folder / "m.keras")
    model.save_weights(folder / "m.weights.h5")
    return folder, model.privacy.epsilon(DELTA)


def test_a_layer_of_a_loaded_model_carries_its_ledger(saved):
    folder, epsilon = saved
    loaded = keras.models.load_model(folder / "m.keras")
    assert loaded.privacy.carried == {}  # the loaded model does not carry itself
    assert loaded.privacy.epsilon(DELTA) == pytest.approx(epsilon, rel=1e-12)
    holder = on(loaded.get_layer("encoder"), "holder")
    assert [c.label for c in holder.privacy.carried.values()] == ["model 'pretrained'"]
    assert holder.privacy.epsilon(DELTA) == pytest.approx(epsilon, rel=1e-12)
    assert "model 'pretrained'" in holder.privacy.statement(DELTA)
    control = on(keras.layers.Dense(3), "control")  # fresh layers: nothing carried
    assert control.privacy.carried == {} and control.privacy.epsilon(DELTA) == 0


def test_a_layer_of_a_model_given_load_weights_carries_its_ledger(saved, data):
    folder, epsilon = saved
    loaded = source("copy")
    loaded.load_weights(folder / "m.weights.h5")
    holder = train(on(loaded.get_layer("encoder"), "holder"), *data, steps=1)
    assert "model 'copy'" in [c.label for c in holder.privacy.carried.values()]
    assert holder.privacy.epsilon(DELTA) > epsilon


def test_a_loaded_private_lookup_travels_with_its_provenance_and_delta(tmp_path):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 20, 400).astype("int64")
    ids[0] = CRAFTED_ID
    y = (ids % 2).astype("int32")

    def build(lookup, embedding, name):
        inputs = keras.Input((1,), dtype="int64")
        hidden = keras.layers.Flatten()(embedding(lookup(inputs)))
        return tfdp.DPModel(inputs, keras.layers.Dense(2)(hidden), name=name)

    lookup = keras.layers.IntegerLookup(name="lookup")
    adapt_privately(lookup, ids, epsilon=1.0, delta=1e-6)
    first = build(lookup, keras.layers.Embedding(lookup.vocabulary_size(), 2, name="emb"), "A")
    first.save(tmp_path / "a.keras")  # saved before any fit: the adaptation is its charge
    own_delta = first.privacy.own_additive_delta()
    assert own_delta > 0
    loaded = keras.models.load_model(tmp_path / "a.keras")
    second = build(loaded.get_layer("lookup"), keras.layers.Embedding(
        lookup.vocabulary_size(), 2, name="emb2"), "C")
    train(second, ids[:, None], y, steps=1)  # not refused: the provenance came along
    assert [e["kind"] for e in second.privacy.preprocessing] == ["private"]
    assert second.privacy._additive_delta() == pytest.approx(own_delta)  # once, carried
    assert second.privacy.epsilon(DELTA) > loaded.privacy.epsilon(DELTA)
    assert str(CRAFTED_ID) not in second.privacy.to_json() + second.privacy.statement(DELTA)


def test_a_source_rollback_does_not_lower_what_a_trained_head_carries(data, tmp_path):
    first = train(source("A"), *data, steps=1)
    first.save_weights(tmp_path / "earlier.weights.h5")
    train(first, *data, steps=4)
    encoder = first.get_layer("encoder")
    holder = on(encoder, "B")
    encoder.trainable = False
    train(holder, *data, steps=1)  # its head learns on the 5-step encoder's features
    encoder.trainable = True
    charged = holder.privacy.epsilon(DELTA)
    first.load_weights(tmp_path / "earlier.weights.h5")  # rolled back to 1 step
    train(tfdp.DPSequential([keras.Input((DIM,)), keras.layers.Dense(2)]), *data, steps=1)
    assert holder.privacy.epsilon(DELTA) == pytest.approx(charged, rel=1e-12)
    (carried,) = holder.privacy.carried.values()
    assert sum(n for _, n in carried.parts) == 5
    holder.save(tmp_path / "b.keras")
    assert keras.models.load_model(tmp_path / "b.keras").privacy.epsilon(
        DELTA) == pytest.approx(charged, rel=1e-12)


def test_a_holder_that_never_trained_follows_the_rollback(data, tmp_path):
    """Control: without its own training on them, a holder's weights ARE
    the rolled-back variables, so its charge drops with them."""
    first = train(source("A"), *data, steps=1)
    first.save_weights(tmp_path / "earlier.weights.h5")
    train(first, *data, steps=4)
    holder = on(first.get_layer("encoder"), "B")
    before = holder.privacy.epsilon(DELTA)
    first.load_weights(tmp_path / "earlier.weights.h5")
    assert holder.privacy.epsilon(DELTA) < before


def test_a_ledger_keeps_its_floor_in_memory_and_in_json():
    step = dpsgd_event(1.0, 0.01)
    ledger = PrivacyLedger()
    ledger.carry("a", "model 'a'", [(step, 100)])
    ledger.hold_carried()
    ledger.carry("a", "model 'a'", [(step, 10)])  # the source rolled back
    assert ledger.carried["a"].parts == ((step, 100),)
    ledger.carry("a", "model 'a'", [(step, 120)])  # and may grow
    assert ledger.carried["a"].parts == ((step, 120),)
    loaded = PrivacyLedger.from_json(ledger.to_json())
    loaded.carry("a", "model 'a'", [(step, 10)])
    assert loaded.carried["a"].parts == ((step, 120),)
    fresh = PrivacyLedger()  # control: without a floor, carrying again replaces
    fresh.carry("a", "model 'a'", [(step, 100)])
    fresh.carry("a", "model 'a'", [(step, 10)])
    assert fresh.carried["a"].parts == ((step, 10),)
