"""One privacy setting for every trial of a search, checked before any trial trains.

Papernot & Steinke's bound charges the search as repeats of ONE mechanism.
Each trial here trains with the same `fit` arguments, so its privacy event
is fixed by its optimizer: the mechanism and its step event at rate
batch_size / N (`DPOptimizer.mechanism_setting`). The setting of the model
`build(hp)` returns with every hyperparameter at its default is the
reference, fixed before anything is drawn; every drawn trial must have it,
or the whole search is refused before it reads any record. (A search
conditioned on its draws agreeing keeps the charged bound: it only thins
the number of trials, and every law here is charged more for a larger mean.)

Hyperparameters that do not change the event (learning rate, clipping norm
C, architecture, weight decay) are free to vary. The noise multiplier, a
target epsilon, the optimizer's class or a seed are not, and every trial
runs one step per call (`steps_per_execution=1`), so it runs the steps
`tfdp.tuning.calibrate_search_noise` counts.

Example: see `tfdp.tuning.PrivateRandomSearch`.
"""

from tfdp.optimizers import DPOptimizer, DPSGD
from tfdp.tuning.hiding import Refusal

# Mechanisms whose event is a fixed function of their settings and fit's
# arguments. Others (AdaDP, DPIS, SA-DPSGD, DP-BandMF) are refused for now.
SUPPORTED = (DPOptimizer, DPSGD)


def privacy_setting(model, num_examples, batch_size):
    """The text that fixes a trial's privacy event; raises for a model a
    search cannot charge."""
    optimizer = getattr(model, "optimizer", None)
    if not hasattr(model, "privacy") or optimizer is None:
        raise Refusal(
            "build(hp) must return a tfdp.DPModel or tfdp.DPSequential compiled with a "
            f"tfdp optimizer. Received: {type(model).__name__} with optimizer "
            f"{type(optimizer).__name__}"
        )
    if type(optimizer) not in SUPPORTED:
        raise Refusal(
            "A private search supports tfdp.optimizers.DPSGD and DPOptimizer (their event is "
            "fixed by their settings). Received: optimizer="
            f"{type(optimizer).__name__}"
        )
    if optimizer.noise_multiplier is None:
        raise Refusal(
            "Each trial needs a fixed noise_multiplier: a target_epsilon would calibrate "
            "each trial alone, not the search. Choose sigma for the search's epsilon "
            "(tfdp.tuning.calibrate_search_noise). Received: noise_multiplier=None"
        )
    steps_per_execution = getattr(model, "steps_per_execution", 1)
    if steps_per_execution != 1:
        raise Refusal(
            "A private search needs steps_per_execution=1: Keras runs whole calls of "
            "steps_per_execution steps, so an epoch would run more steps than the search's "
            "calibration (tfdp.tuning.calibrate_search_noise) counts and cost more than its "
            f"target. Received: steps_per_execution={steps_per_execution!r}"
        )
    if optimizer.seed is not None:
        raise Refusal(
            "A seeded optimizer draws the same noise in every trial, so the trials are not "
            "independent (and anyone with the seed can remove the noise). Received: "
            f"seed={optimizer.seed}"
        )
    return f"{type(optimizer).__name__}: {optimizer.mechanism_setting(num_examples, batch_size)}"


def check_fresh(model):
    """Refuses a model whose ledger already holds releases (steps or records)."""
    if model.privacy.steps or model.privacy.composed_event().events:
        raise Refusal(
            "build(hp) must return a new, untrained model: this one's ledger already holds "
            f"{model.privacy.steps} private steps, which a search would count inside every "
            "trial instead of once. Received: a model with a non-empty privacy ledger"
        )


def differing(build_at, reference, values, default_values):
    """Names the hyperparameters whose drawn value alone changes the setting."""
    changed = [name for name in values if values[name] != default_values.get(name)]
    alone = [name for name in changed
             if build_at({**default_values, name: values[name]}) != reference]
    return alone or changed
