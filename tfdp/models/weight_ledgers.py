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

A model loaded from a tfdp file (`load_model`, `load_weights`) makes its
variables and layers carry the loaded training (`note_loaded`): its own
releases and preprocessing delta, and the trainings its ledger carried
(as saved: the loaded weights are copies), so a layer reused from it
charges them. When a model trains, what it carries becomes a floor
(`PrivacyLedger.hold_carried`): the other model rolling back later does
not lower it, and what that model releases after its rollback is charged
on top (releases have an identity: `tfdp.accounting.carried_floor`).

The registry holds the variables weakly. Weights copied as arrays
(`set_weights(other.get_weights())`, assigning `.numpy()` values or
another variable with `tf.Variable.assign`, or restoring a
`tf.train.Checkpoint`) are not the same variables, so they cannot be
traced; a plain Keras `.keras` or `.weights.h5` file of traced variables
holds what they carry (`tfdp.models.keras_file_ledgers`), and so does a
SavedModel of them (`tfdp.models.saved_model_ledgers`), or of the
tf.Variables inside them (`dense.kernel.value`: each is registered beside
the Keras variable that holds it). Only DP fits
are traced (a plain Keras model training a DP model's layer is not
noticed): the docs say so next to `load_weights`'s refusal of a weights
file without a ledger.

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

import keras
import tensorflow as tf

from tfdp.accounting import PrivacyLedger
from tfdp.accounting.carried_floor import at_least
from tfdp.preprocessing import provenance

# id(variable) -> (weak reference to it, [the _Training of every model that trained it])
_trainers = {}
# Bumped when a variable gains a trainer or a training ends: a model's
# ledger recomposes what it carries only when this moved.
_registry_version = [0]
_trainings = weakref.WeakKeyDictionary()  # model -> its _Training


class _Training:
    """One DPModel's training, as the variables it trained remember it.

    Its own releases (`PrivacyLedger.own_history`, with their identity) are
    read from the model while it lives (a rollback shrinks them with the
    weights), else the
    last ones seen; `carried` are the trainings its weights carried, so a
    model that holds only what this one trained on top of them carries
    those too.
    """

    def __init__(self, label, model=None, training_id=None):
        self.id = training_id or uuid.uuid4().hex  # saved in ledgers: unique across processes
        self.label = label
        self._model = weakref.ref(model) if model is not None else lambda: None
        self.parts, self.relation, self.additive_delta = (), "add_or_remove", 0.0
        self.floors = {}  # the model's ledger's floors (PrivacyLedger.hold_carried)
        self.carried = set()
        self.seen = None  # (registry version, weak ledger) its model last composed

    def refresh(self):
        """Reads the model's own releases, if it still lives."""
        model = self._model()
        if model is not None:
            ledger = model._privacy_ledger  # pylint: disable=protected-access
            self.parts, self.relation = tuple(ledger.own_history()), ledger.relation
            self.additive_delta = ledger.own_additive_delta()
            self.floors = ledger.floors
        return self


def _training(model):
    if model not in _trainings:
        _trainings[model] = _Training(f"model '{model.name}'", model)
    return _trainings[model]


def _forget(key):
    _trainers.pop(key, None)


def _trainers_of(variable):
    entry = _trainers.get(id(variable))
    return entry[1] if entry is not None and entry[0]() is variable else []


def _holdings(model):
    """`model`'s variables and layers (a lookup's vocabulary is no variable)."""
    return list(model.weights) + model._flatten_layers(include_self=False)  # pylint: disable=protected-access


def _with_carried(stack, own=None):
    """The trainings of `stack` and those they carried in turn, but `own`."""
    found = set()
    while stack:
        training = stack.pop()
        if training is own or training in found:
            continue
        found.add(training)
        stack.extend(training.carried)
    return found


def held_trainings(model):
    """Every other training `model`'s variables carry (trainable or not),
    and the trainings those carried in turn."""
    own = _training(model)
    stack = [t for v in _holdings(model) for t in _trainers_of(v)] + list(own.carried)
    return _with_carried(stack, own)


def _charges(held):
    """{training id: its releases to charge}: what it released, never below
    what the trainings in between trained on (a rollback does not lower it)."""
    floors = {}
    for training in held:
        for key, parts in training.refresh().floors.items():
            floors[key] = at_least(parts, floors.get(key, ()))
    for training in held:  # a live training and a loaded copy of it share an id
        floors[training.id] = at_least(training.parts, floors.get(training.id, ()))
    return floors


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
    floors = _charges(held)
    for training in sorted(held, key=lambda t: t.id):
        ledger.carry(training.id, training.label, floors[training.id], training.relation,
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
    model._privacy_ledger.hold_carried()  # pylint: disable=protected-access
    _register(model.trainable_variables, own)


def note_loaded(model):
    """After a saved ledger is loaded into `model` (`load_model`,
    `load_weights`): its variables carry the loaded training (the loaded
    ledger's own releases and preprocessing delta) and the trainings that
    ledger carried, so a model that holds them, or one built on a loaded
    layer, charges them. The loaded model itself does not carry its own."""
    own = _training(model)
    own.seen = None
    ledger = model._privacy_ledger  # pylint: disable=protected-access
    for source_id, carried in ledger.carried.items():
        own.carried.add(_saved_training(source_id, carried))
    # Its layers too: a lookup's vocabulary is no variable, yet it holds the loaded release.
    _register(_holdings(model), own.refresh())
    provenance.travel_with_layers(model, ledger.preprocessing)


def carrier_ledger(model):
    """A ledger of no releases of its own that carries every training the
    weights of `model` (a Keras model that is not a DP model) hold, for a
    file plain Keras writes (`tfdp.models.keras_file_ledgers`); None if
    they hold none.

    Raises:
        ValueError: if they hold both user-level and record-level trainings
            (`PrivacyLedger.carry`).
    """
    return carrier_ledger_of(_holdings(model))


def carrier_ledger_of(objects):
    """`carrier_ledger` of the trainings `objects` (variables, layers: what a
    SavedModel holds, `tfdp.models.saved_model_ledgers`) carry; None if none.

    Raises:
        ValueError: as `carrier_ledger`.
    """
    held = _with_carried([t for o in objects for t in _trainers_of(o)])
    if not held:
        return None
    floors = _charges(held)
    ledger = PrivacyLedger()
    for training in sorted(held, key=lambda t: t.id):
        ledger.carry(training.id, training.label, floors[training.id], training.relation,
                     training.additive_delta)
    return ledger


def note_file_ledger(model, ledger):
    """After plain Keras loaded into `model` weights whose file holds
    `ledger` (`carrier_ledger`): its variables and layers carry the
    trainings that ledger carries, as saved."""
    note_ledger_of(_holdings(model), ledger)


def note_ledger_of(objects, ledger):
    """`objects` (variables, layers, a loaded SavedModel) read from a file
    that holds `ledger` carry the trainings it carries, as saved."""
    for source_id, carried in ledger.carried.items():
        _register(objects, _saved_training(source_id, carried))


def carry_as(source, objects):
    """`objects` carry every training `source` carries (a layer that wraps
    a loaded SavedModel's variables in variables of its own)."""
    for training in list(_trainers_of(source)):
        _register(objects, training)


def _saved_training(source_id, carried):
    """A training a loaded ledger carries, with its releases as saved (the
    loaded weights are copies: what the live one does later is not in them)."""
    training = _Training(carried.label, training_id=source_id)
    training.parts, training.relation = carried.history, carried.relation
    training.additive_delta = carried.additive_delta
    return training


def _register(variables, training):
    """Makes `variables` (or layers) carry `training`, and the tf.Variable
    inside each Keras variable among them (`_wrapped`)."""
    for variable in _with_wrapped(variables):
        key = id(variable)
        if not _trainers_of(variable):
            _trainers[key] = (weakref.ref(variable, lambda _, key=key: _forget(key)), [])
        trainers = _trainers[key][1]
        if training not in trainers:
            trainers.append(training)
    _registry_version[0] += 1


def _with_wrapped(objects):
    """`objects`, each followed by the tf.Variable a Keras variable among
    them holds (`variable.value`): a SavedModel of those raw variables (a
    `tf.Module` holding `dense.kernel.value`) saves the same weights."""
    for item in objects:
        yield item
        inner = getattr(item, "_value", None) if isinstance(item, keras.Variable) else None
        if isinstance(inner, tf.Variable) and inner is not item:
            yield inner


def note_trained(model):
    """After a `fit` (also one that failed): its releases as they ended,
    for the models that hold its variables once it is gone."""
    if model in _trainings:
        _trainings[model].refresh()
        _registry_version[0] += 1
