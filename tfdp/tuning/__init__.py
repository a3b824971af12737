"""Private hyperparameter search (Papernot & Steinke, ICLR 2022).

`PrivateRandomSearch(build, mean_trials=...)` runs a random number of DP
trials of a KerasTuner hypermodel and releases only the best, charged to its
ledger as one `RepeatAndSelectDpEvent`; `tfdp.accounting.search` prices a
search without running it, and `calibrate_search_noise` finds the DP-SGD
noise multiplier for which the whole search costs a target epsilon. The
trials run in a child process (`tfdp.tuning.process`). Needs `keras-tuner`
and `cloudpickle` (`pip install -e ".[tuning]"` from a checkout).
Guide: docs/guides/private-tuning.md.

Example:

>>> from tfdp import tuning
>>> sorted(tuning.DISTRIBUTIONS)
['geometric', 'logarithmic', 'negative_binomial', 'poisson']
"""

from tfdp.accounting.search import DISTRIBUTIONS, calibrate_search_noise, search_epsilon
from tfdp.tuning.search import PrivateRandomSearch

__all__ = ["DISTRIBUTIONS", "PrivateRandomSearch", "calibrate_search_noise", "search_epsilon"]
