"""What Keras does not save of a model's training state, saved by tfdp.

A DP model saved and loaded must train on as it was (the same variables,
from the same values, with its optimizer's state), or the run it resumes
is not the run its ledger describes. Keras 3 loses three things for LoRA,
and tfdp keeps them:

- Which layers have LoRA. A Keras layer's config records its `lora_rank`,
  but a KerasHub backbone is built from its own config, without the LoRA
  that `backbone.enable_lora(rank)` added: it loaded as a full model.
- Which variables train. Keras saves a layer's `trainable` flag in its
  config, but not a variable's own (`bias.trainable = False`; `enable_lora`
  freezes the kernel), nor the flags of the sublayers of a KerasHub
  backbone (whose `enable_lora` freezes all but the LoRA layers). A LoRA
  BERT that trained 2,946 parameters loaded with 137,538 trainable, and
  since the optimizer had been built for other variables Keras dropped its
  state ("Skipping variable loading for optimizer").
- The LoRA factors. Keras saves a LoRA layer's kernel with its factors
  merged in and loads both factors as zeros: the function is the same, but
  both factors then get zero gradients, so LoRA cannot train on (and a
  `BackupAndRestore` resume changes the frozen kernel).

The first two go into the model's config (`training_state`, restored by
`restore_training_state` before the optimizer is built); the factors are
saved by `LoraVariables`, an object the model holds, which Keras saves and
loads after the model's layers, writing each LoRA layer's own variables
back as they were.

Example:

>>> import keras
>>> layer = keras.layers.Dense(2)
>>> model = keras.Sequential([keras.Input((3,)), layer])
>>> layer.bias.trainable = False
>>> training_state(model)["trainable_weights"]
[0]
"""

import json
import warnings
import weakref

import numpy as np
from keras.src.saving.keras_saveable import KerasSaveable


def trainable_indices(model):
    """Indices, in `model.weights`, of the variables that train.

    Indices, not paths: a loaded model's variable paths may differ
    ("dp_sequential/dense/kernel" loads as "dense/kernel").

    Args:
        model: a built Keras model.

    Returns:
        A list of ints.
    """
    trainable = {id(v) for v in model.trainable_variables}
    return [i for i, v in enumerate(model.weights) if id(v) in trainable]


def training_state(model):
    """What `restore_training_state` needs, as JSON-able lists.

    Layers are named by their index in `weighted_layers(model)` (and their
    class, checked on load: auto-generated names differ from process to
    process); weights by their index in `model.weights`.

    Args:
        model: a built Keras model.

    Returns:
        A dict: num_layers, frozen_layers ([index, class]), lora_layers
        ([index, class, rank, alpha]), num_weights, trainable_weights.
    """
    layers = weighted_layers(model)
    return {
        "num_layers": len(layers),
        "frozen_layers": [
            [i, type(layer).__name__] for i, layer in enumerate(layers) if not layer.trainable],
        "lora_layers": [
            [i, type(layer).__name__, layer.lora_rank, layer.lora_alpha]
            for i, layer in enumerate(layers) if getattr(layer, "lora_enabled", False)
        ],
        "num_weights": len(model.weights),
        "trainable_weights": trainable_indices(model),
    }


def restore_training_state(model, state):
    """Enables LoRA where it was and sets every layer's and variable's
    `trainable` flag as `training_state` saved them.

    Args:
        model: the model just built from the saved config.
        state: `training_state` of the saved model.

    Raises:
        ValueError: if the model built from the config does not have the
            saved model's layers and weights.
    """
    layers = weighted_layers(model)
    if len(layers) != state["num_layers"]:
        raise _mismatch(model, f"{state['num_layers']} layers", f"{len(layers)}")
    for index, kind, rank, alpha in state["lora_layers"]:
        layer = _layer(model, layers, index, kind)
        if not getattr(layer, "lora_enabled", False):  # a KerasHub backbone's
            layer.enable_lora(rank, lora_alpha=alpha)
    frozen = set()
    for index, kind in state["frozen_layers"]:
        _layer(model, layers, index, kind)
        frozen.add(index)
    for index, layer in enumerate(layers):  # parents before their sublayers
        layer.trainable = index not in frozen
    weights = model.weights
    if len(weights) != state["num_weights"]:
        raise _mismatch(model, f"{state['num_weights']} weights", f"{len(weights)}")
    wanted = set(state["trainable_weights"])
    for index, variable in enumerate(weights):
        variable.trainable = index in wanted
    if trainable_indices(model) != sorted(wanted):
        raise _mismatch(model, f"trainable weights {sorted(wanted)}", f"{trainable_indices(model)}")


def weighted_layers(model):
    """The layers of `model` that hold weights (their own or their
    sublayers'), parents before their sublayers. Layers without weights are
    left out: their flags change nothing, and a loaded model may hold more
    of them (a KerasHub backbone's own copies of the model's inputs)."""
    return [layer for layer in model._flatten_layers(include_self=False) if layer.weights]


def _layer(model, layers, index, kind):
    if type(layers[index]).__name__ != kind:
        raise _mismatch(model, f"a {kind} as weighted layer {index}",
                        f"a {type(layers[index]).__name__}")
    return layers[index]


def _mismatch(model, saved, built):
    return ValueError(
        f"The saved model had {saved}; the model {model.name!r} built from its config has "
        f"{built}, so it cannot train on as it was saved. Received: a config that does not "
        "rebuild the saved model"
    )


def lora_layers(model):
    """The layers of `model` with LoRA enabled, in a fixed order."""
    return [
        layer for layer in model._flatten_layers(include_self=False)
        if getattr(layer, "lora_enabled", False)
    ]


class LoraVariables(KerasSaveable):
    """Saves the variables of a model's LoRA layers as they are (Keras merges
    the factors into the kernel) and restores them after Keras loaded the
    layers. A model without LoRA layers saves nothing here.

    Args:
        model: the model that holds this object (as a private attribute).
    """

    def __init__(self, model):
        self._model = weakref.ref(model)

    def _obj_type(self):
        # Keras walks a saveable's attributes, skipping those of this type's
        # reference object; this object's own attributes hold no saveable.
        return "Operation"

    def _variables(self):
        return [v for layer in lora_layers(self._model()) for v in layer.weights]

    def save_own_variables(self, store):
        for i, variable in enumerate(self._variables()):
            store[str(i)] = variable

    def load_own_variables(self, store):
        variables = self._variables()
        saved = len(store.keys())
        if saved == 0 and variables:
            warnings.warn(
                f"This file holds {len(lora_layers(self._model()))} LoRA layers but not their "
                "own variables (it was saved by an older tfdp): Keras merged the factors into "
                "the kernels and loads them as zeros. The model predicts as it was saved, but "
                "its LoRA factors cannot train on from zero (both get zero gradients).",
                stacklevel=2,
            )
            return
        if saved != len(variables):
            raise ValueError(
                f"This file holds {saved} LoRA variables; the model has {len(variables)} "
                "in its LoRA layers. Received: a file saved from a different model"
            )
        for i, variable in enumerate(variables):
            value = np.asarray(store[str(i)])
            if tuple(value.shape) != tuple(variable.shape):
                raise ValueError(
                    f"The saved LoRA variable {i} has shape {tuple(value.shape)}; "
                    f"{variable.path} has shape {tuple(variable.shape)}."
                )
            variable.assign(value)


class NoiseStreamRecord(KerasSaveable):
    """Which DP-BandMF noise stream, and which branch of it, a model's steps
    ran: saved with the model's weights (`model.save`, `save_weights`,
    `keras.callbacks.BackupAndRestore`), so that a resumed or rolled-back
    model continues only the noise history its released weights carry.

    `lineage` is None (no stream recorded) or a list of `[step, token]`:
    first `[start, stream_id]`, then one `[step, token]` per `fit` that
    drew noise from the stream from model step `step` on. Nothing in it is
    secret: the ids are random, not derived from the noise key
    (`tfdp.optimizers.bandmf_state.lineage_matches` compares two).

    Example:

    >>> record = NoiseStreamRecord()
    >>> record.lineage = [[0, "a1b2"], [0, "c3d4"]]
    >>> store = {}
    >>> record.save_own_variables(store)
    >>> loaded = NoiseStreamRecord()
    >>> loaded.load_own_variables(store)
    >>> loaded.lineage
    [[0, 'a1b2'], [0, 'c3d4']]
    """

    KEY = "noise_stream_lineage"

    def __init__(self):
        self.lineage = None

    def _obj_type(self):
        return "Operation"  # no saveable attributes of its own (see LoraVariables)

    def save_own_variables(self, store):
        if self.lineage is not None:
            text = json.dumps(self.lineage).encode("utf-8")
            store[self.KEY] = np.frombuffer(text, dtype=np.uint8)

    def load_own_variables(self, store):
        # A file without it (saved before any DP-BandMF step, or by an older
        # tfdp) records no stream: a DP-BandMF resume from it is refused.
        self.lineage = None
        if self.KEY in list(store.keys()):
            text = bytes(np.asarray(store[self.KEY], dtype=np.uint8)).decode("utf-8")
            self.lineage = [[int(step), str(token)] for step, token in json.loads(text)]
