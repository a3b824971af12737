"""An adaptation of a layer a model already released is charged at once (review 7, F14).

`adapt_privately` called by a callback during `fit`, or after it, puts new
state into the model: the next epoch trains on it and an export carries it.
Its release is charged to the model's ledger the moment it is set, so the
logged epsilon, `PrivacyBudget`, the statement and `export` all count it, not
only `save`.
"""

import os

import dp_accounting
import keras
import numpy as np
import pytest

import tfdp
from tfdp import preprocessing
from tfdp.accounting import PrivacyLedger, additive_delta, dpsgd_event
from tfdp.preprocessing.private_adapt import _noise_multiplier

DELTA = 1e-5
ADAPT_EPSILON, ADAPT_DELTA = 2.0, 1e-7
BATCH, NOISE = 60, 1.0
IDS = np.repeat(np.arange(1, 21), 30)


def reference_epsilon(adaptations, steps):
    """An independent ledger: `steps` DP-SGD steps and `adaptations` vocabularies."""
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(NOISE, BATCH / len(IDS)))
    ledger.advance(steps)
    sigma = _noise_multiplier(ADAPT_EPSILON - additive_delta.shift(ADAPT_DELTA / 2),
                              ADAPT_DELTA / 2)
    for i in range(adaptations):
        entry = dict(id=str(i), layer="item", state="", kind="private", what="vocabulary",
                     source="reference", unit="record", additive_delta=ADAPT_DELTA / 2)
        ledger.charge_preprocessing(entry, dp_accounting.GaussianDpEvent(sigma))
    return ledger.epsilon(DELTA)


def adapt(layer):
    return preprocessing.adapt_privately(layer, IDS, epsilon=ADAPT_EPSILON, delta=ADAPT_DELTA)


def fitted(callbacks=()):
    lookup = keras.layers.IntegerLookup(name="item")
    adapt(lookup)
    inputs = keras.Input((1,), dtype="int64")
    hidden = keras.layers.Flatten()(keras.layers.Embedding(32, 2)(lookup(inputs)))
    model = tfdp.DPModel(inputs, keras.layers.Dense(2)(hidden))
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=NOISE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(IDS[:, None], IDS % 2, batch_size=BATCH, epochs=2, steps_per_epoch=1,
                        verbose=0, callbacks=[*callbacks(lookup)] if callbacks else [])
    return model, lookup, history


class AdaptAgainAfterFirstEpoch(keras.callbacks.Callback):
    def __init__(self, lookup):
        super().__init__()
        self.lookup = lookup

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            adapt(self.lookup)


def test_an_adaptation_during_fit_is_in_the_logged_epsilon_and_the_ledger():
    budget = tfdp.callbacks.PrivacyBudget(epsilon=100, delta=DELTA)
    model, _, history = fitted(lambda lookup: [AdaptAgainAfterFirstEpoch(lookup), budget])
    due = reference_epsilon(adaptations=2, steps=2)
    assert due > reference_epsilon(adaptations=1, steps=2)  # negative control
    assert history.history["epsilon"][-1] == pytest.approx(due)
    assert model.privacy.epsilon(DELTA) == pytest.approx(due)
    assert len(model.privacy.preprocessing) == 2


def test_an_adaptation_after_fit_is_in_the_statement_and_the_export(tmp_path):
    model, lookup, _ = fitted()
    adapt(lookup)
    due = reference_epsilon(adaptations=2, steps=2)
    assert model.privacy.epsilon(DELTA) == pytest.approx(due)
    stated = float(model.privacy.statement(DELTA).split("epsilon=")[1].split(",")[0])
    assert due <= stated < due + 0.01  # the statement rounds up
    adapt(lookup)  # a third, then only an export
    model.export(os.path.join(tmp_path, "export"), verbose=False)
    assert model.privacy.epsilon(DELTA) == pytest.approx(reference_epsilon(3, steps=2))
