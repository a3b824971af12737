"""`PrivacyLedger.carry`: another training's releases the weights carry
(issue 52, item 5; the models' side is tests/models/test_weights_carry_their_ledger.py)."""

import json

import pytest

from tfdp.accounting import PrivacyLedger, dpsgd_event, integrity

DELTA = 1e-5
OTHER = [(dpsgd_event(1.0, 0.01), 200)]


def ledger_with_steps(steps=100):
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(1.1, 0.02))
    ledger.advance(steps)
    return ledger


def reference(*parts):
    ledger = PrivacyLedger()
    for event, count in parts:
        ledger.record(event, count)
    return ledger.epsilon(DELTA)


def test_carried_releases_compose_with_the_own_ones_and_are_named():
    ledger = ledger_with_steps()
    own = ledger.epsilon(DELTA)
    ledger.carry("a", "model 'encoder'", OTHER)
    assert ledger.epsilon(DELTA) == pytest.approx(
        reference((dpsgd_event(1.1, 0.02), 100), *OTHER), rel=1e-12)
    assert ledger.epsilon(DELTA) > own  # the cache saw the change
    assert ledger.own_parts() == [(dpsgd_event(1.1, 0.02), 100)]
    assert "the training of model 'encoder', charged here too" in ledger.statement(DELTA)


def test_carrying_the_same_training_again_replaces_it():
    ledger = ledger_with_steps()
    ledger.carry("a", "model 'encoder'", OTHER)
    ledger.carry("a", "model 'encoder'", [(dpsgd_event(1.0, 0.01), 300)])
    assert ledger.epsilon(DELTA) == pytest.approx(
        reference((dpsgd_event(1.1, 0.02), 100), (dpsgd_event(1.0, 0.01), 300)), rel=1e-12)


def test_the_carried_releases_survive_json_and_old_ledgers_stay_version_1():
    plain = ledger_with_steps()
    assert json.loads(plain.to_json())["version"] == 1
    plain.carry("a", "model 'encoder'", OTHER, relation="zero_out")
    data = json.loads(plain.to_json())
    assert data["version"] == 3 and data["carried"][0]["label"] == "model 'encoder'"
    restored = PrivacyLedger.from_json(plain.to_json())
    assert restored.epsilon(DELTA) == plain.epsilon(DELTA)
    assert restored.relation == "zero_out"  # the carried guarantee's relation holds for all
    data["carried"][0]["releases"][0]["count"] = 0
    with pytest.raises(ValueError, match="Corrupt privacy ledger.*checksum"):
        PrivacyLedger.from_json(json.dumps(data))
    del data[integrity.KEY]  # re-sealed: the structure check itself refuses it
    with pytest.raises(ValueError, match="Corrupt privacy ledger.*carried"):
        PrivacyLedger.from_json(json.dumps(integrity.seal(data)))


def test_a_carried_training_brings_its_preprocessing_thresholds_delta():
    plain = ledger_with_steps()
    plain.carry("a", "model 'encoder'", OTHER)
    without = plain.epsilon(DELTA)
    plain.carry("a", "model 'encoder'", OTHER, additive_delta=1e-6)
    assert plain.epsilon(DELTA) > without  # dropping the carried delta is caught
    restored = PrivacyLedger.from_json(plain.to_json())
    assert restored.epsilon(DELTA) == plain.epsilon(DELTA)
    assert restored.own_additive_delta() == 0.0


def test_user_level_and_record_level_trainings_are_not_composed():
    ledger = ledger_with_steps()
    with pytest.raises(ValueError, match="carry the training of model 'people'.*fresh layers"):
        ledger.carry("a", "model 'people'", OTHER, relation="add_or_remove_user")
    fresh = PrivacyLedger()
    fresh.carry("a", "model 'people'", OTHER, relation="add_or_remove_user")
    with pytest.raises(ValueError, match="carry the training of model 'people'"):
        fresh.begin_steps(dpsgd_event(1.1, 0.02))
