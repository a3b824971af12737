"""Weights keep their ledger in memory: variables a DP step trained carry
the identity of that training, and a model that holds them charges it.

A `DPModel` built on another DPModel's trained layer (the same variable
objects: `keras.Model(inputs, head(pretrained.get_layer("encoder")(inputs)))`)
releases weights that carry both trainings. Each model that trains
registers its trainable variables here before its first step
(`mark_trained`); whenever a model's ledger is read (`model.privacy`), saved,
or its `fit` starts, every training its variables carry, held frozen or
trained further, directly or through the model that trained them on top, is
composed into its ledger (`PrivacyLedger.carry`) and named in its
statement: "These weights also carry the releases of the training of
model 'encoder'". Composition is a valid bound whatever data each training read;
on the same records it is the right one.

The registry holds the variables weakly. Weights copied as arrays
(`set_weights(other.get_weights())`, assigning `.numpy()` values) are not
the same variables, so they cannot be traced: the docs say so next to
`load_weights`'s refusal of a weights file without a ledger.

Example:

>>> import keras, numpy as np, tfdp
>>> x, y = np.ones((8, 2), "float32"), np.zeros(8, "int32")
>>> def trained(model):
...     model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0,
...                   noise_multiplier=1.0), loss="sparse_categorical_crossentropy")
...     model.fit(x, y, batch_size=4, steps_per_epoch=1, verbose=0)
...     return model
>>> encoder = keras.layers.Dense(3)
>>> first = trained(tfdp.DPSequential([keras.Input((2,)), encoder], name="first"))
>>> second = trained(tfdp.DPSequential([keras.Input((2,)), encoder, keras.layers.Dense(2)],
...                                     name="second"))
>>> [c.label for c in second.privacy.carried.values()]
["model 'first'"]
>>> "model 'first'" in second.privacy.statement(1e-5)
True
>>> [c.label for c in first.privacy.carried.values()]  # its encoder trained on in second
["model 'second'"]
"""

import uuid
import weakref

# id(variable) -> (weak reference to it, [the _Training of every model that trained it])
_trainers = {}
# Bumped when a variable gains a trainer or a training ends: a model's
# ledger recomposes what it carries only when this moved.
_registry_version = [0]
_trainings = weakref.WeakKeyDictionary()  # model -> its _Training


class _Training:
    """One DPModel's training, as the variables it trained remember it.

    Its own releases (`PrivacyLedger.own_parts`) are read from the model
    while it lives (a rollback shrinks them with the weights), else the
    last ones seen; `carried` are the trainings its weights carried, so a
    model that holds only what this one trained on top of them carries
    those too.
    """

    def __init__(self, model):
        self.id = uuid.uuid4().hex  # saved in ledgers: unique across processes
        self.label = f"model '{model.name}'"
        self._model = weakref.ref(model)
        self.parts, self.relation, self.additive_delta = (), "add_or_remove", 0.0
        self.carried = set()
        self.seen = None  # (registry version, weak ledger) its model last composed

    def refresh(self):
        """Reads the model's own releases, if it still lives."""
        model = self._model()
        if model is not None:
            ledger = model._privacy_ledger  # pylint: disable=protected-access
            self.parts, self.relation = tuple(ledger.own_parts()), ledger.relation
            self.additive_delta = ledger.own_additive_delta()
        return self


def _training(model):
    if model not in _trainings:
        _trainings[model] = _Training(model)
    return _trainings[model]


def _forget(key):
    _trainers.pop(key, None)


def _trainers_of(variable):
    entry = _trainers.get(id(variable))
    return entry[1] if entry is not None and entry[0]() is variable else []


def held_trainings(model):
    """Every other training `model`'s variables carry (trainable or not),
    and the trainings those carried in turn."""
    own = _training(model)
    found, stack = set(), [t for v in model.weights for t in _trainers_of(v)]
    stack += list(own.carried)
    while stack:
        training = stack.pop()
        if training is own or training in found:
            continue
        found.add(training)
        stack.extend(training.carried)
    return found


def charge_held(model):
    """Composes into `model.privacy` every training its weights carry.

    Cheap when no model trained since the last call (`model.privacy` calls
    it on every read).

    Raises:
        ValueError: if a carried training is user-level and this model's
            record-level, or the reverse (`PrivacyLedger.carry`).
    """
    own = _training(model)
    ledger = model._privacy_ledger  # pylint: disable=protected-access
    if own.seen is not None and own.seen[0] == _registry_version[0] and own.seen[1]() is ledger:
        return  # nothing trained since, and no ledger loaded
    held = held_trainings(model)
    for training in sorted(held, key=lambda t: t.id):
        training.refresh()
        ledger.carry(training.id, training.label, training.parts, training.relation,
                     training.additive_delta)
    own.carried |= held
    own.seen = (_registry_version[0], weakref.ref(ledger))


def mark_trained(model):
    """Before `model`'s first DP step of a `fit`: charges what its weights
    carry (refusing, before any step, what cannot be composed), then makes
    its trainable variables carry its own training."""
    own = _training(model)
    own.seen = None
    charge_held(model)
    for variable in model.trainable_variables:
        key = id(variable)
        if not _trainers_of(variable):
            _trainers[key] = (weakref.ref(variable, lambda _, key=key: _forget(key)), [])
        trainers = _trainers[key][1]
        if own not in trainers:
            trainers.append(own)
    _registry_version[0] += 1


def note_trained(model):
    """After a `fit` (also one that failed): its releases as they ended,
    for the models that hold its variables once it is gone."""
    if model in _trainings:
        _trainings[model].refresh()
        _registry_version[0] += 1
