"""Drawing a trial's hyperparameters: every trial from the same law, independently.

The hypermodel is KerasTuner's: a function `build(hp)` (or a
`keras_tuner.HyperModel`) that declares hyperparameters with `hp.Float`,
`hp.Choice`, ... and returns a compiled model. KerasTuner's RandomSearch
gives a hyperparameter its default the first time `build` declares it, so
its first trial differs from the others; Papernot & Steinke's analysis needs
identically distributed, independent trials. Here each trial draws every
active hyperparameter at random, re-building until `build` declares no new
one (conditional hyperparameters included), from a generator no other trial
reads after it.

Example:

>>> import keras_tuner
>>> def build(hp):
...     hp.Float("learning_rate", 0.01, 1.0, sampling="log")
...     return hp.Choice("units", [8, 16])
>>> values, units = draw(build, np.random.default_rng(0))
>>> sorted(values) == ["learning_rate", "units"] and units in (8, 16)
True
"""

import keras_tuner
import numpy as np

from tfdp.tuning.hiding import Refusal

# More rounds than any sane nesting of conditional hyperparameters.
_MAX_ROUNDS = 100


def build_function(hypermodel):
    """The `build(hp)` of a function or `keras_tuner.HyperModel`.

    A HyperModel that overrides `fit` is refused: the search trains every
    trial with the same `fit` arguments, so that each trial releases the
    same privacy event.
    """
    if isinstance(hypermodel, keras_tuner.HyperModel):
        if type(hypermodel).fit is not keras_tuner.HyperModel.fit:
            raise ValueError(
                "A private search trains every trial with the same fit arguments, so "
                "that all trials release the same privacy event: a HyperModel that "
                f"overrides fit() is not supported. Received: hypermodel={hypermodel!r}"
            )
        return hypermodel.build
    if not callable(hypermodel):
        raise TypeError(
            "Expected `hypermodel` to be a function build(hp) returning a compiled tfdp "
            f"model, or a keras_tuner.HyperModel. Received: hypermodel={hypermodel!r}"
        )
    return hypermodel


def defaults(build):
    """(values, model) of `build` with every hyperparameter at its default."""
    hp = keras_tuner.HyperParameters()
    model = build(hp)
    return dict(hp.values), model


def draw(build, rng):
    """(values, model): every active hyperparameter drawn from `rng`.

    Args:
        build: the hypermodel's build function.
        rng: a `numpy.random.Generator`.

    Returns:
        The drawn values (name -> value) and the model `build` returned
        for them.
    """
    hp = keras_tuner.HyperParameters()
    drawn = set()
    for _ in range(_MAX_ROUNDS):
        model = build(hp)
        new = [h for h in hp.space if h.name not in drawn and hp.is_active(h)]
        if not new:
            return {name: hp.values[name] for name in drawn if name in hp.values}, model
        for h in new:
            hp.values[h.name] = h.prob_to_value(float(rng.random()))
            drawn.add(h.name)
    raise Refusal(
        f"build(hp) kept declaring new hyperparameters after {_MAX_ROUNDS} rounds; a "
        "hyperparameter's name must not depend on the values drawn for others."
    )


def rebuild(build, values):
    """(HyperParameters, model) of `build` at exactly the drawn `values`."""
    hp = keras_tuner.HyperParameters()
    hp.values.update(values)
    model = build(hp)
    undrawn = sorted(h.name for h in hp.space if hp.is_active(h) and h.name not in values)
    if undrawn:
        raise Refusal(
            "build(hp) declared hyperparameters on a second build with the same values "
            f"that it did not declare on the first: {undrawn}. The search space must not "
            "depend on anything but the values drawn."
        )
    return hp, model
