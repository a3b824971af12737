"""A ledger whose step counter went back refuses to be saved.

Saving it would write the lower count: a loaded model would then report
the epsilon of fewer steps than ran (an under-count).
"""

import pytest

from tfdp.accounting import PrivacyLedger, dpsgd_event


def test_to_json_refuses_a_counter_that_went_back():
    """Broken variant caught: a to_json that writes the counter as it reads
    (the old code saved "steps": 4 after 8 had been counted)."""
    counter = {"value": 0}
    ledger = PrivacyLedger(step_counter=lambda: counter["value"])
    ledger.begin_steps(dpsgd_event(1.0, 0.1))
    counter["value"] = 8
    assert ledger.epsilon(1e-5) > 0
    counter["value"] = 4
    with pytest.raises(ValueError, match="went backwards"):
        ledger.to_json()


def test_control_a_counter_that_only_grows_saves_and_restores():
    counter = {"value": 0}
    ledger = PrivacyLedger(step_counter=lambda: counter["value"])
    ledger.begin_steps(dpsgd_event(1.0, 0.1))
    counter["value"] = 8
    assert ledger.epsilon(1e-5) > 0
    restored = PrivacyLedger.from_json(ledger.to_json())
    assert restored.steps == 8
    assert restored.epsilon(1e-5) == ledger.epsilon(1e-5)
