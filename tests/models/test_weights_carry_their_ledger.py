"""Weights keep their ledger in memory (issue 52, finding 7).

A new DPModel built on a privately trained model's encoder layer (the same
variable objects) and trained on the same records released weights that
carry both trainings, but started a fresh ledger: it stated epsilon 7.12
where its weights carried 13.42. Variables a DP step trains now carry their
ledger's identity (`tfdp.models.weight_ledgers`), and a DPModel that trains
or holds them charges that ledger too, named in its statement. The negative
control (fresh layers) charges only its own steps.
"""

import gc
import types
import weakref

import keras
import numpy as np
import pytest

import tfdp
from tfdp.accounting import PrivacyLedger

N, DIM, CLASSES, BATCH, STEPS = 64, 6, 3, 16, 3
DELTA = 1e-5
# A crafted record: its raw value must not appear in any statement or ledger text.
CRAFTED = 98765.4321


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, DIM)).astype(np.float32)
    x[7] = CRAFTED
    return x, rng.integers(0, CLASSES, N)


def train(model, data):
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(*data, batch_size=BATCH, epochs=1, steps_per_epoch=STEPS, verbose=0)
    return model


def build(encoder=None, name=None):
    inputs = keras.Input((DIM,))
    encoder = encoder or keras.layers.Dense(8, activation="tanh", name="encoder")
    outputs = keras.layers.Dense(CLASSES)(encoder(inputs))
    return tfdp.DPModel(inputs, outputs, name=name)


@pytest.fixture
def first(data):
    """A privately trained model, for a test that changes it."""
    return train(build(name="pretrained"), data)


@pytest.fixture(scope="module")
def transfer(data):
    """The reviewer's construction, trained once for the tests that only read
    it: a privately trained model ("pretrained"), its charge taken before the
    transfer, and a model on its encoder layer (the same variables) retrained
    on the same records ("transfer")."""
    first = train(build(name="pretrained"), data)
    pretrained = first.privacy.composed_event()
    second = train(build(first.get_layer("encoder"), name="transfer"), data)
    return types.SimpleNamespace(first=first, pretrained=pretrained, second=second)


def composed_epsilon(model, *carried):
    """Epsilon of `model`'s own steps composed with the `carried` events,
    computed apart."""
    reference = PrivacyLedger()
    for event in carried:
        reference.record(event)
    reference.begin_steps(model.optimizer.step_event(BATCH / N))
    reference.advance(STEPS)
    return reference.epsilon(DELTA)


def test_a_model_on_a_trained_encoder_charges_the_encoders_ledger(transfer):
    """The reviewer's construction: the encoder layer reused, retrained on
    the same records."""
    first, second = transfer.first, transfer.second
    expected = composed_epsilon(second, transfer.pretrained)
    assert second.privacy.epsilon(DELTA) == pytest.approx(expected, rel=1e-9)
    statement = second.privacy.statement(DELTA)
    assert "model 'pretrained'" in statement
    # The first model's encoder is the same variables: they now carry the
    # second training too.
    assert "model 'transfer'" in first.privacy.statement(DELTA)
    for text in (statement, second.privacy.to_json(), first.privacy.to_json()):
        assert "98765" not in text


def test_a_model_holding_a_frozen_trained_encoder_charges_it(first, data):
    pretrained = first.privacy.composed_event()
    encoder = first.get_layer("encoder")
    encoder.trainable = False
    held = train(build(encoder, name="frozen_transfer"), data)
    assert held.privacy.epsilon(DELTA) == pytest.approx(
        composed_epsilon(held, pretrained), rel=1e-9)
    assert "model 'pretrained'" in held.privacy.statement(DELTA)


def test_fresh_layers_charge_only_their_own_steps(transfer, data):
    """Negative control: same data, same settings, no shared variable."""
    fresh = train(build(name="fresh"), data)
    assert fresh.privacy.epsilon(DELTA) == pytest.approx(composed_epsilon(fresh), rel=1e-9)
    assert fresh.privacy.epsilon(DELTA) < composed_epsilon(fresh, transfer.pretrained)
    assert "pretrained" not in fresh.privacy.statement(DELTA)


def test_the_charge_outlives_the_pretrained_model_and_travels_in_files(data, tmp_path):
    """The encoder's model deleted before the transfer; the transfer's
    weights file carries the charge to a model with fresh layers."""
    pretrained_model = train(build(name="pretrained"), data)
    pretrained = pretrained_model.privacy.composed_event()
    encoder = pretrained_model.get_layer("encoder")
    gone = weakref.ref(pretrained_model)
    del pretrained_model
    gc.collect()
    assert gone() is None
    second = train(build(encoder, name="transfer"), data)
    expected = composed_epsilon(second, pretrained)
    assert second.privacy.epsilon(DELTA) == pytest.approx(expected, rel=1e-9)
    second.save_weights(tmp_path / "transfer.weights.h5")
    loaded = build(name="loaded")
    loaded.load_weights(tmp_path / "transfer.weights.h5")
    assert loaded.privacy.epsilon(DELTA) == pytest.approx(expected, rel=1e-9)
    assert "model 'pretrained'" in loaded.privacy.statement(DELTA)


def test_a_head_trained_on_a_trained_encoders_features_carries_both(transfer):
    """A model holding only the transfer's head (trained on the encoder's
    outputs, so on the first training's weights) carries both trainings,
    without training itself."""
    second = transfer.second
    head = second.layers[-1]
    reference = PrivacyLedger()
    reference.record(transfer.pretrained)
    reference.begin_steps(second.optimizer.step_event(BATCH / N))
    reference.advance(STEPS)
    holder = tfdp.DPSequential([keras.Input((8,)), head], name="holder")
    assert holder.privacy.steps == 0
    assert holder.privacy.epsilon(DELTA) == pytest.approx(reference.epsilon(DELTA), rel=1e-9)
    statement = holder.privacy.statement(DELTA)
    assert "model 'pretrained'" in statement and "model 'transfer'" in statement


def test_record_level_training_on_user_level_weights_is_refused_before_a_step(data):
    """The two guarantees do not bound each other: refused, naming the model."""
    x, y = data
    user_level = build(name="per_person")
    user_level.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    user_level.fit(x, y, user_ids=np.arange(N) % 16, examples_per_user=2, batch_size=4,
                   epochs=1, steps_per_epoch=1, verbose=0)
    assert user_level.privacy.relation == "add_or_remove_user"
    second = build(user_level.get_layer("encoder"), name="per_record")
    refusal = "carry the training of model 'per_person': train fresh layers"
    with pytest.raises(ValueError, match=refusal):
        train(second, data)
    assert second.privacy.steps == 0
