"""Privacy accounting on dp_accounting (the accountant tensorflow-privacy uses).

`PrivacyLedger` composes a run's releases; `compute_epsilon` and
`calibrate_noise_multiplier` answer "what epsilon do these settings give" and
"what noise do I need" without training. Imports no TensorFlow.
"""

from tfdp.accounting.calibration import (
    calibrate_dpsgd,
    calibrate_noise_multiplier,
    compute_dpsgd_epsilon,
    compute_epsilon,
)
from tfdp.accounting.events import dpsgd_event, event_from_dict, event_to_dict
from tfdp.accounting.ledger import PrivacyLedger, classic_epsilon
from tfdp.accounting.statement import privacy_statement

__all__ = [
    "PrivacyLedger",
    "calibrate_dpsgd",
    "calibrate_noise_multiplier",
    "classic_epsilon",
    "compute_dpsgd_epsilon",
    "compute_epsilon",
    "dpsgd_event",
    "event_from_dict",
    "event_to_dict",
    "privacy_statement",
]
