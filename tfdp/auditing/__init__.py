"""Privacy auditing: lower bounds on epsilon from attacks on neighbouring datasets.

Unit tests check formulas; an audit checks the implementation. It runs a
mechanism many times on D and on D plus one canary record, scores each output
with an attack, and turns the attack's error rates into a lower bound on
epsilon with Clopper-Pearson confidence intervals. A correct mechanism's
bound stays below the epsilon tfdp reports; a bound above it is a caught bug.

Example:

>>> import numpy as np
>>> from tfdp import auditing
>>> rng = np.random.default_rng(0)
>>> result = auditing.epsilon_from_scores(
...     rng.normal(0, 1, 20000), rng.normal(1, 1, 20000), delta=1e-5)
>>> round(result.confidence, 2)
0.95

Before training, check that no record can move your model's real train step
beyond the DP bound (`sensitivity_search`, a search with crafted records):

>>> result = auditing.sensitivity_search(model, x, y)  # doctest: +SKIP
>>> result.check()                                      # doctest: +SKIP

and that the sampler keeps every other unit's draws when one is removed
(`sampler_coupling`, the real sampler and step on D and D minus one person):

>>> people = auditing.UserSampling(user_ids, examples_per_user=2, expected_users=64)  # doctest: +SKIP
>>> auditing.sampler_coupling(model, x, y, sampling=people).check()                  # doctest: +SKIP

White-box audit of a tfdp optimizer (about ten seconds on two CPU cores):

>>> import tfdp
>>> make = lambda seed: tfdp.optimizers.DPSGD(
...     1.0, l2_norm_clip=1.0, noise_multiplier=2.0, seed=seed)
>>> result = auditing.audit_optimizer(make, steps=300)  # doctest: +SKIP
>>> print(result.summary())                              # doctest: +SKIP
DPSGD: epsilon >= 1.2... (95% confidence, delta=1e-05) vs claimed 2.166; ...
"""

from tfdp.auditing.audit import (
    AuditResult,
    adadp_normalizer,
    audit_optimizer,
    audit_training,
    default_normalizer,
    dpis_normalizer,
    epsilon_from_scores,
    loss_score,
    one_step_epsilon,
    weight_decay_normalizer,
)
from tfdp.auditing.bounds import clopper_pearson_upper, epsilon_lower_bound

# Imported on first use: they load TensorFlow and Keras, the rest does not.
_SENSITIVITY = ("SensitivityExceeded", "SensitivityResult", "sensitivity_search")
_COUPLING = ("CouplingResult", "CyclicPoissonSampling", "FixedOrderSampling", "PoissonSampling",
             "UserSampling", "sampler_coupling")


def __getattr__(name):
    if name in _SENSITIVITY:
        from tfdp.auditing import sensitivity

        return getattr(sensitivity, name)
    if name in _COUPLING:
        from tfdp.auditing import coupling

        return getattr(coupling, name)
    raise AttributeError(f"module 'tfdp.auditing' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SENSITIVITY) | set(_COUPLING))


__all__ = [
    "AuditResult",
    "CouplingResult",
    "CyclicPoissonSampling",
    "FixedOrderSampling",
    "PoissonSampling",
    "UserSampling",
    "SensitivityExceeded",
    "SensitivityResult",
    "adadp_normalizer",
    "audit_optimizer",
    "audit_training",
    "clopper_pearson_upper",
    "default_normalizer",
    "dpis_normalizer",
    "epsilon_from_scores",
    "epsilon_lower_bound",
    "loss_score",
    "one_step_epsilon",
    "sampler_coupling",
    "sensitivity_search",
    "weight_decay_normalizer",
]
