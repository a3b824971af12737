"""Privacy accounting on dp_accounting (the accountant tensorflow-privacy uses).

`PrivacyLedger` composes a training run's releases and is tfdp's single source
of truth for epsilon; `compute_epsilon` / `compute_dpsgd_epsilon` answer "what
epsilon do these settings give" and `calibrate_noise_multiplier` /
`calibrate_dpsgd` "what noise do I need" without training;
`privacy_statement` says what a guarantee means in plain language;
`tfdp.accounting.bandmf` answers both for DP-BandMF's correlated noise.

This package imports neither TensorFlow nor Keras, so it loads fast (the
`tfdp` command line uses it).

Example:

>>> from tfdp import accounting
>>> round(accounting.compute_dpsgd_epsilon(60000, 150, 1.3, epochs=15, delta=1e-5), 4)
0.7242
"""

from tfdp.accounting import bandmf
from tfdp.accounting._validation import LargeDeltaWarning
from tfdp.accounting.calibration import (
    calibrate_dpsgd,
    calibrate_noise_multiplier,
    compute_dpsgd_epsilon,
    compute_epsilon,
)
from tfdp.accounting.events import dpsgd_event, event_from_dict, event_to_dict
from tfdp.accounting.ledger import PrivacyLedger
from tfdp.accounting.statement import privacy_statement

__all__ = [
    "LargeDeltaWarning",
    "PrivacyLedger",
    "bandmf",
    "calibrate_dpsgd",
    "calibrate_noise_multiplier",
    "compute_dpsgd_epsilon",
    "compute_epsilon",
    "dpsgd_event",
    "event_from_dict",
    "event_to_dict",
    "privacy_statement",
]
