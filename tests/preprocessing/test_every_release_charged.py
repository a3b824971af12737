"""Every release of a layer that the user saw is charged, not only the state it holds.

A failed `adapt_privately` (no token passed the threshold) still drew the
noise and told the user so; an adaptation replaced by another before any
fit was seen too. Each waits on the layer and is charged with the layer's
next provenance: its Gaussian event and its threshold's delta.
"""

import dp_accounting
import keras
import numpy as np
import pytest

import tfdp
from tfdp import preprocessing
from tfdp.accounting import PrivacyLedger
from tfdp.preprocessing.private_adapt import _noise_multiplier
from tfdp.accounting import additive_delta as additive

UNIQUE = 99950
DELTA = 1e-5
ADAPT_DELTA = 1e-7


def private_ids(n=300, seed=0):
    ids = np.random.default_rng(seed).integers(1, 10, size=n - 1)
    return np.append(ids, UNIQUE)


def model_of(lookup):
    inputs = keras.Input((1,), dtype="int64")
    return tfdp.DPModel(inputs, keras.layers.Dense(2)(lookup(inputs)))


def sigma_of(epsilon):
    """The vocabulary's noise multiplier at `epsilon` (private_adapt's calibration)."""
    return _noise_multiplier(epsilon - additive.shift(ADAPT_DELTA / 2), ADAPT_DELTA / 2)


def reference_epsilon(epsilons):
    ledger = PrivacyLedger()
    for i, epsilon in enumerate(epsilons):
        entry = dict(id=str(i), layer="lookup", state="", kind="private", what="vocabulary",
                     source="reference", unit="record", additive_delta=ADAPT_DELTA / 2)
        ledger.charge_preprocessing(entry, dp_accounting.GaussianDpEvent(sigma_of(epsilon)))
    return ledger.epsilon(DELTA)


def lookup():
    return keras.layers.IntegerLookup(
        name="lookup", output_mode="one_hot", max_tokens=12, pad_to_max_tokens=True)


def test_failed_attempts_are_charged_with_the_successful_one():
    layer = lookup()
    for epsilon in (0.05, 0.1):
        with pytest.raises(ValueError, match="waits on the layer and is charged") as caught:
            preprocessing.adapt_privately(layer, private_ids(), epsilon=epsilon,
                                          delta=ADAPT_DELTA, seed=0)
        assert str(UNIQUE) not in str(caught.value)
    preprocessing.adapt_privately(layer, private_ids(), epsilon=1.0, delta=ADAPT_DELTA, seed=0)
    model = model_of(layer)
    preprocessing.charge_pending(model)
    entries = model.privacy.preprocessing
    assert [e["additive_delta"] for e in entries] == [ADAPT_DELTA / 2, ADAPT_DELTA]
    assert "2 earlier release(s)" in entries[1]["source"]
    assert model.privacy.epsilon(DELTA) == pytest.approx(reference_epsilon([1.0, 0.05, 0.1]))
    assert model.privacy.epsilon(DELTA) > reference_epsilon([1.0])  # negative control
    preprocessing.charge_pending(model)  # a second charge (a second fit) adds nothing
    assert len(model.privacy.preprocessing) == 2


def test_an_adaptation_replaced_before_any_fit_is_charged_with_its_replacement():
    layer = lookup()
    for seed in (0, 1):
        preprocessing.adapt_privately(layer, private_ids(), epsilon=1.0, delta=ADAPT_DELTA,
                                      seed=seed)
    model = model_of(layer)
    preprocessing.charge_pending(model)
    assert model.privacy.epsilon(DELTA) == pytest.approx(reference_epsilon([1.0, 1.0]))


def test_an_adaptation_already_charged_to_a_model_is_not_carried_to_the_next():
    layer = lookup()
    preprocessing.adapt_privately(layer, private_ids(), epsilon=1.0, delta=ADAPT_DELTA, seed=0)
    first = model_of(layer)
    preprocessing.charge_pending(first)
    preprocessing.adapt_privately(layer, private_ids(), epsilon=1.0, delta=ADAPT_DELTA, seed=1)
    preprocessing.charge_pending(first)
    assert first.privacy.epsilon(DELTA) == pytest.approx(reference_epsilon([1.0, 1.0]))
