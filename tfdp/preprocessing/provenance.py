"""Where a preprocessing layer's state came from, checked before `fit`'s first step.

A Keras preprocessing layer adapted on the training data keeps that data in
the model: a lookup's vocabulary holds a record's unique id, a
`Normalization` layer its mean and variance, a `Discretization` layer its
quantiles. The model is saved and released with them, so `fit` accepts such
state only with a provenance:

- adapted privately by `tfdp.preprocessing.adapt_privately` (a charged
  release in the model's privacy ledger, named in its statement), or
- declared public by the user, `declare_public(layer, source="...")` (no
  charge; the statement names the layer and the source).

State given to a layer's constructor (`StringLookup(vocabulary=...)`,
`Normalization(mean=..., variance=...)`, `Discretization(bin_boundaries=...)`)
counts as data-derived too: tfdp cannot tell whether those numbers were
computed from the private data, and one `declare_public` call says they
were not.

Each provenance is tied to the state it describes by a fingerprint (a hash
of the vocabulary, weights or boundaries): a layer adapted again after
`declare_public` or `adapt_privately` is refused until declared or adapted
again. The ledger keeps the entry (with the fingerprint), so a model saved
and loaded keeps its provenance, and a second `fit` does not charge twice.

Example:

>>> import keras, numpy as np
>>> lookup = keras.layers.IntegerLookup(name="zip")
>>> lookup.adapt(np.array([75001, 75002]))
>>> data_state(lookup)[0]
'vocabulary'
>>> entry = declare_public(lookup, source="the public list of postal codes")
>>> entry["kind"], entry["layer"]
('public', 'zip')
"""

import contextlib
import hashlib
import inspect
import json
import math
import uuid
import weakref

import dp_accounting
import keras
import numpy as np

from tfdp.preprocessing import run_time_state

# Provenances not yet charged to a model's ledger: layer -> (entry, event,
# the ledger the event was already recorded in, or None).
_PENDING = weakref.WeakKeyDictionary()
# Releases the user saw that no provenance of the layer's state stands for
# (a failed attempt, an adaptation replaced by another before any fit):
# layer -> [(event, additive delta, unit)], charged with the layer's next charge.
_EARLIER = weakref.WeakKeyDictionary()
# Ids of the private entries charged to some ledger (not carried again).
_CHARGED_IDS = set()
# Models that released a layer (fit checked it, a file was saved or loaded with
# it): layer -> their WeakSet. A new provenance of the layer is charged to them
# the moment it is set, so every epsilon they report afterwards includes it.
_HOLDERS = weakref.WeakKeyDictionary()

_VOCABULARY_LAYERS = (
    keras.layers.StringLookup, keras.layers.IntegerLookup, keras.layers.TextVectorization)


def _text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, np.generic):
        value = value.item()
    return str(value)


def _floats(value):
    return np.asarray(keras.ops.convert_to_numpy(value), np.float64).ravel().tolist()


def _idf_weights(layer):
    lookup = getattr(layer, "_lookup_layer", layer)
    if getattr(lookup, "output_mode", None) != "tf_idf":
        return None
    weights = getattr(lookup, "idf_weights", None)
    return None if weights is None else _floats(weights)


def data_state(layer):
    """What of `layer`'s state was computed from data, or None if nothing.

    Args:
        layer: a Keras layer.

    Returns:
        (what, state): `what` names the state in words ("vocabulary",
        "vocabulary and TF-IDF weights", "mean and variance", "bin
        boundaries", "state"), `state` a JSON-able value it is fingerprinted
        by; None for a layer without data-derived state (an empty lookup,
        or a layer without `adapt`).
    """
    if isinstance(layer, _VOCABULARY_LAYERS):
        vocabulary = [_text(v) for v in layer.get_vocabulary(include_special_tokens=False)]
        if not vocabulary:
            return None
        idf = _idf_weights(layer)
        if idf is None:
            return "vocabulary", {"vocabulary": vocabulary}
        return "vocabulary and TF-IDF weights", {"vocabulary": vocabulary, "idf": idf}
    if isinstance(layer, keras.layers.Normalization):
        if layer.input_mean is not None:
            state = {"mean": _floats(layer.input_mean), "variance": _floats(layer.input_variance)}
        elif layer.built and getattr(layer, "adapt_mean", None) is not None:
            state = {"mean": _floats(layer.adapt_mean), "variance": _floats(layer.adapt_variance)}
        else:
            return None
        return "mean and variance", state
    if isinstance(layer, keras.layers.Discretization):
        if layer.bin_boundaries is None:
            return None
        return "bin boundaries", {"bin_boundaries": _floats(layer.bin_boundaries)}
    if callable(getattr(layer, "adapt", None)):  # any other adaptable layer: all its state
        return "state", _composite_state(layer)
    return None


def _composite_state(layer):
    """All of an adaptable layer's state: its weights and each descendant's own
    `data_state` (a lookup's vocabulary is a table, not a weight), at every
    depth: `_data_layers` looks no further into the layer. Descendants
    without such state are left out (building adds an `InputLayer`)."""
    flatten = layer._flatten_layers  # pylint: disable=protected-access
    sublayers = []
    for sublayer in flatten(include_self=False, recursive=True):
        found = data_state(sublayer)
        if found is not None:
            sublayers.append([sublayer.name, found[1]])
    return {"weights": [_floats(w) for w in layer.get_weights()], "sublayers": sublayers}


def fingerprint(state):
    """A SHA-256 hex digest of a `data_state` value (stable across save and load)."""
    text = json.dumps(state, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _entry(layer, what, state, kind, source, unit, additive_delta=0.0):
    return dict(id=uuid.uuid4().hex, layer=layer.name, state=fingerprint(state), kind=kind,
                what=what, source=source, unit=unit, additive_delta=float(additive_delta))


def partition_digest(users):
    """A SHA-256 hex digest of which records belong together, whatever the ids.

    Each record is labelled by the smallest record index of its person, so
    two `UserRecords` that group the same records into people have the same
    digest, whatever the ids' values, types or order.

    Args:
        users: a `tfdp.data.users.UserRecords`.

    Example:

    >>> from tfdp.data.users import UserRecords
    >>> partition_digest(UserRecords(["b", "a", "b"])) == partition_digest(UserRecords([7, 1, 7]))
    True
    >>> partition_digest(UserRecords([0, 1, 2])) == partition_digest(UserRecords([0, 0, 2]))
    False
    """
    first = np.minimum.reduceat(users.order, users.starts) if users.num_records else users.order
    label = np.empty(users.num_records, np.int64)
    label[users.order] = np.repeat(first, users.counts)
    return hashlib.sha256(label.astype("<i8").tobytes()).hexdigest()


def register_private(layer, source, unit, event, additive_delta, charged=None, partition=None):
    """Records that `layer`'s current state was adapted privately (`adapt_privately`).

    The entry waits on the layer until `fit` charges it to the model's
    ledger (`check_model`). `charged` is a ledger that already recorded
    `event` (`tfdp.layers.private_channel_statistics`): that ledger gets
    the entry without the event again. `partition` is the
    `partition_digest` of a per-person adaptation's people: `fit` accepts
    the entry only with the same grouping of records into people. Returns
    the entry.
    """
    what, state = data_state(layer)
    entry = _entry(layer, what, state, "private", source, unit, additive_delta)
    if partition is not None:
        entry["partition"] = partition
    _replace_pending(layer, (entry, event, charged))
    _charge_holders(layer)
    return dict(entry)


def _hold(layer, model):
    _HOLDERS.setdefault(layer, weakref.WeakSet()).add(model)


def _charge_holders(layer):
    """Charges `layer`'s new provenance at once to each model that released the
    layer (its own or `fit(augment=...)`'s): an adaptation during or after
    `fit` is in the model from now on, so its logs, budget, statement and
    exports count it."""
    what = data_state(layer)[0]
    for model in list(_HOLDERS.get(layer, ())):
        _charge(model.privacy, layer, what, _PENDING[layer])


# How many private search builds (`tfdp.tuning`) are running now.
_SEARCH_BUILDS = [0]


class AdaptationInSearch(ValueError):
    """`adapt_privately` called inside a private search's `build(hp)`."""


@contextlib.contextmanager
def inside_search_build():
    """Marks a private search's `build(hp)`: `adapt_privately` refuses to run in it."""
    _SEARCH_BUILDS[0] += 1
    try:
        yield
    finally:
        _SEARCH_BUILDS[0] -= 1


def refuse_inside_search(layer):
    """Raises `AdaptationInSearch` inside a private search's `build(hp)`.

    Each trial would run its own adaptation (its own noise and threshold)
    while the chosen model's ledger counts one.
    """
    if _SEARCH_BUILDS[0]:
        raise AdaptationInSearch(
            f"adapt_privately({layer.name!r}) was called inside a private search's "
            "build(hp): every trial would adapt the layer again on the private data (its own "
            "noise and threshold), and the chosen model's ledger would count only one of "
            "these releases. Adapt the layer once, outside build(hp), before the search, "
            "and use it in the model that build(hp) returns.")


def note_release(layer, event, additive_delta, unit):
    """Keeps a release of `layer` that set no state (a failed `adapt_privately`).

    It waits on the layer and is charged with the layer's next provenance,
    to the ledger of the model that `fit`s (or saves) it.
    """
    _EARLIER.setdefault(layer, []).append((event, float(additive_delta), unit))


def _replace_pending(layer, pending):
    """Sets `layer`'s provenance; an earlier private adaptation that no
    ledger holds yet waits on the layer as an earlier release."""
    previous = _PENDING.get(layer)
    if previous is not None:
        entry, event, charged = previous
        if entry["kind"] == "private" and charged is None and entry["id"] not in _CHARGED_IDS:
            note_release(layer, event, entry["additive_delta"], entry["unit"])
    _PENDING[layer] = pending


def _charge_earlier(ledger, layer, what):
    """Charges the releases waiting on `layer` (`note_release`) as one entry."""
    earlier = _EARLIER.pop(layer, [])
    if not earlier:
        return
    units = {unit for _, _, unit in earlier}
    entry = dict(
        id=uuid.uuid4().hex, layer=layer.name, state="", kind="private", what=what,
        source=(f"{len(earlier)} earlier release(s) of this layer that the model does not "
                "hold (a failed or replaced adaptation), charged too"),
        unit="person" if units == {"person"} else "record",
        additive_delta=math.fsum(delta for _, delta, _ in earlier))
    events = [event for event, _, _ in earlier]
    ledger.charge_preprocessing(
        entry, events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events))


def declare_public(layer, source):
    """Declares that `layer`'s current state was computed from public data.

    One call per layer, after its `adapt` (or construction with a
    vocabulary, mean and variance, or bin boundaries): `fit` then accepts
    the state without charging epsilon, and the privacy statement names
    the layer and `source` ("Preprocessing: vocabulary of 'lookup' from
    data declared public: ..."). Adapting the layer again afterwards
    undoes the declaration (the state is fingerprinted).

    Declare only data that is not the private training data nor derived
    from it: the guarantee does not cover what is declared public.

    Args:
        layer: a Keras preprocessing layer with data-derived state
            (`StringLookup`, `IntegerLookup`, `TextVectorization`,
            `Normalization`, `Discretization`, or another layer with
            `adapt`).
        source: a non-empty string saying where the data came from; it is
            written in the privacy statement.

    Returns:
        The provenance entry (a dict) that `fit` will write in the ledger.

    Raises:
        TypeError: if `layer` is not a Keras layer or `source` not a string.
        ValueError: if `source` is empty or the layer holds no state yet.

    Example:

    >>> import keras
    >>> colors = keras.layers.StringLookup(vocabulary=["red", "green"], name="color")
    >>> declare_public(colors, source="the product catalogue's colour list")["what"]
    'vocabulary'
    """
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(
            "Expected `layer` to be a Keras layer. Received: layer of type "
            f"{type(layer).__name__}")
    if not isinstance(source, str):
        raise TypeError(
            f"Expected `source` to be a string. Received: source of type {type(source).__name__}")
    if not source.strip():
        raise ValueError(
            "declare_public needs `source`, a non-empty string saying where the public data "
            f"came from (it is written in the privacy statement). Received: source={source!r}")
    found = data_state(layer)
    if found is None:
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}) holds no data-derived state yet: "
            "adapt it on the public data (or build it with its public vocabulary, mean and "
            "variance, or bin boundaries) first, then declare it public.")
    what, state = found
    entry = _entry(layer, what, state, "public", source.strip(), "")
    _replace_pending(layer, (entry, None, None))
    _charge_holders(layer)
    return dict(entry)


def _refusal(layer, what, stale):
    why = (
        "its state changed after it was declared public or adapted privately (adapted or "
        "set again since)" if stale else
        "it was computed from data (adapt(), or given to the layer's constructor) and tfdp "
        "cannot tell whether that data was the private training data")
    return ValueError(
        f"Layer {layer.name!r} ({type(layer).__name__}) holds a {what} that the trained model "
        f"would carry and release with no privacy guarantee: {why}. Either adapt it "
        "privately, tfdp.preprocessing.adapt_privately(layer, data, epsilon=..., "
        "delta=..., ...), which charges the adaptation to this model's privacy "
        "ledger, or, if the data it came from is public, declare it so in one call: "
        f"tfdp.preprocessing.declare_public(layer, source=\"where the data came from\"), "
        "which the privacy statement then names.")


def _unit_refusal(layer):
    return ValueError(
        f"Layer {layer.name!r} was adapted privately per record, but this fit protects "
        "each person: a person with several records moves the adaptation's counts by "
        "more than one, so the two guarantees do not compose into one. Pass user_ids=... "
        "(the training's user_ids) to adapt_privately. Received: fit(user_ids=...)")


def _partition_refusal(layer):
    return ValueError(
        f"Layer {layer.name!r} was adapted privately per person, but with user_ids that "
        "group the records into people differently from this fit's user_ids: a person of "
        "this fit may be several people of the adaptation, and count more than once in its "
        "vocabulary. Adapt it again with adapt_privately(layer, data, ..., user_ids=...) "
        "passing the same user_ids (one per record, records in the same order) as fit.")


def _data_layers(model, extra=()):
    """(layer, what, state) of every layer of `model` (nested models too), and of
    the layers `extra` (with theirs), holding data-derived state; a layer inside
    such a layer (TextVectorization's lookup) is part of its state, not another one."""
    found, inside, seen = [], set(), set()
    flat = list(model._flatten_layers(include_self=False))  # pylint: disable=protected-access
    for root in extra:
        flat += root._flatten_layers(include_self=True)  # pylint: disable=protected-access
    for layer in flat:
        if id(layer) in inside or id(layer) in seen:
            continue
        seen.add(id(layer))
        state = data_state(layer)
        if state is None:
            continue
        found.append((layer, *state))
        inner = layer._flatten_layers(include_self=False)  # pylint: disable=protected-access
        inside.update(id(sublayer) for sublayer in inner)
    return found


def _pending_for(layer, digest):
    """The provenance waiting on `layer` if it still describes its state."""
    pending = _PENDING.get(layer)
    return pending if pending is not None and pending[0]["state"] == digest else None


def _charge(ledger, layer, what, pending):
    entry, event, charged = pending
    if ledger.charge_preprocessing(entry, None if charged is ledger else event):
        _charge_earlier(ledger, layer, what)
        if entry["kind"] == "private":
            _CHARGED_IDS.add(entry["id"])


def charge_pending(model):
    """Charges every provenance waiting on `model`'s layers to its ledger, refusing nothing.

    `DPModel` calls it before writing its ledger into a saved file, before
    `export` and before a statement, so that a model released before its
    first `fit` carries its adaptations' charge (and its declarations);
    `check_model` refuses what has none at `fit`. The model then holds its
    layers: a later provenance of one is charged to it at once.
    """
    for layer, what, state in _data_layers(model):
        _hold(layer, model)
        pending = _pending_for(layer, fingerprint(state))
        if pending is not None:
            _charge(model.privacy, layer, what, pending)


def augment_layers(augment):
    """The Keras layers `fit(augment=fn)`'s function names: in its closure, the
    globals it reads, its defaults and a bound method's object (in lists,
    tuples and dicts too). A layer reached only through another function or
    object is not seen."""
    if augment is None:
        return []
    function = getattr(augment, "__func__", augment)
    values = [getattr(augment, "__self__", None), *(getattr(function, "__defaults__", None) or ())]
    try:
        names = inspect.getclosurevars(function)
        values += [*names.nonlocals.values(), *names.globals.values()]
    except TypeError:  # not a Python function (a callable object, a builtin)
        values.append(augment)
    layers = []
    for value in values:
        items = list(value.values()) if isinstance(value, dict) else (
            list(value) if isinstance(value, (list, tuple)) else [value])
        layers += [item for item in items if isinstance(item, keras.layers.Layer)]
    return layers


def check_model(model, users=None, augment=None):
    """Accepts every data-derived layer state of `model`, charging it once, or refuses it.

    Called by `DPModel.fit` before the first step. A layer whose state
    matches a provenance waiting on it (`adapt_privately`,
    `declare_public`) is charged to `model.privacy` (once per provenance:
    a second fit finds it already there); one whose state matches an entry
    the ledger already holds (a saved and loaded model) is accepted.

    Args:
        model: a built `tfdp.DPModel`.
        users: this fit's `tfdp.data.users.UserRecords` when it protects
            people (`user_ids`), else None.
        augment: `fit`'s augment function, or None: the preprocessing
            layers it names (`augment_layers`) shape every step's inputs,
            so they are checked (and charged) as the model's own.

    Raises:
        ValueError: naming the layer and both fixes, for state without a
            provenance, or adapted privately per record for a per-person
            fit, or per person with people grouped unlike this fit's. (A
            per-person adaptation is accepted for a per-record fit: a
            record is in one person, so it protects each record too.)
    """
    _check_vocabularies(model)
    partition = None if users is None else partition_digest(users)
    ledger = model.privacy
    for layer, what, state in _data_layers(model, augment_layers(augment)):
        digest = fingerprint(state)
        pending = _pending_for(layer, digest)
        if pending is not None:
            _check_unit(layer, pending[0], partition)
            _charge(ledger, layer, what, pending)
            _hold(layer, model)
            continue
        known = [e for e in ledger.preprocessing
                 if e["state"] == digest and e["layer"] == layer.name]
        if known:
            _check_unit(layer, known[0], partition)
            continue
        raise _refusal(layer, what, stale=layer in _PENDING)


def check_released(model, extra=()):
    """Refuses a layer whose state no longer matches the provenance it had.

    `fit` checks provenance before its first step; a layer adapted or set
    again afterwards (after `fit`, or by a callback during it) would carry
    state the statement says is covered. `DPModel` calls this before it
    writes a file (`save`, `save_weights`, checkpoints), before `export`
    (and a SavedModel written by `tf.saved_model.save` or `ExportArchive`), at
    each epoch's start during `fit`, when its train step is traced (the
    step keeps the tables and tensors it captured then), before a step whose
    run-time state changed (`ProvenanceWatch`), and when the statement is
    produced (`tfdp.load_model` of a file whose state does not match its
    ledger too). A layer that never had a provenance is `fit`'s to refuse.

    Args:
        model: a `tfdp.DPModel`.
        extra: other layers the step runs (`fit(augment=fn)`'s).

    Raises:
        ValueError: naming the layer and both fixes.
    """
    entries = model.privacy.preprocessing
    for layer, what, state in _data_layers(model, extra):
        digest = fingerprint(state)
        if _pending_for(layer, digest) is not None:
            continue
        named = [e for e in entries if e["layer"] == layer.name]
        if any(e["state"] == digest for e in named):
            continue
        if named or layer in _PENDING:
            raise _refusal(layer, what, stale=True)


def before_release(model):
    """`check_released`, then `charge_pending`: what `model` is about to release
    (an export, a statement) is covered, and every adaptation it holds charged."""
    check_released(model)
    charge_pending(model)


def before_release_if_alive(model_ref):
    """`before_release` of the model `model_ref` (a weak reference) still refers to."""
    model = model_ref()
    if model is not None:
        before_release(model)


def step_layers(model):
    """(the layers `model`'s `fit(augment=fn)` function names, every layer the
    DP step runs that may hold data-derived state: the adaptable ones),
    found without reading their state."""
    augmentation = getattr(model, "_augmentation", None)
    extra = augment_layers(getattr(augmentation, "augment", None))
    flat = list(model._flatten_layers(include_self=False))  # pylint: disable=protected-access
    for root in extra:
        flat += root._flatten_layers(include_self=True)  # pylint: disable=protected-access
    adaptable = [layer for layer in flat if callable(getattr(layer, "adapt", None))]
    return extra, adaptable


class ProvenanceWatch(keras.callbacks.Callback):
    """`fit`'s callback, after the user's: each epoch starts only if every
    layer's state still matches its provenance (`check_released`), and so
    does each step whose run-time state (`run_time_state.token`: the
    variables a step reads, the lookup tables held) changed since the last
    check: a callback that adapts a layer on the raw data for a few steps
    and restores it before the epoch ends is refused before those steps."""

    def on_train_begin(self, logs=None):
        self._extra, self._layers = step_layers(self.model)
        self._checked = None

    def on_epoch_begin(self, epoch, logs=None):
        check_released(self.model, self._extra)
        self._checked = run_time_state.token(self._layers)

    def on_train_batch_begin(self, batch, logs=None):
        now = run_time_state.token(self._layers)
        if self._checked is None or not run_time_state.same(self._checked, now):
            check_released(self.model, self._extra)
            self._checked = now


def _check_vocabularies(model):
    """Refuses a lookup without a vocabulary, which no step could run."""
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        if isinstance(layer, _VOCABULARY_LAYERS) and not layer.get_vocabulary(
                include_special_tokens=False):
            raise ValueError(
                f"Layer {layer.name!r} ({type(layer).__name__}) has no vocabulary, so no step "
                "could look a value up. keras.models.clone_model copies a layer's "
                "configuration, not an adapted vocabulary: build the model again with the "
                "adapted layer, or adapt this one, tfdp.preprocessing.adapt_privately(layer, "
                "data, epsilon=..., delta=..., ...), or declare a public vocabulary with "
                "tfdp.preprocessing.declare_public(layer, source=...).")


def _check_unit(layer, entry, partition):
    if entry["kind"] != "private" or partition is None:
        return  # a per-person adaptation protects each record too
    if entry["unit"] != "person":
        raise _unit_refusal(layer)
    if entry.get("partition") != partition:
        raise _partition_refusal(layer)


def travel_with_layers(model, entries):
    """Lets the layers of a loaded `model` take their provenance along.

    Each layer named in one of `entries` (the loaded ledger's) waits with
    that entry as after `adapt_privately` (Keras loads the layers' state
    after the model's ledger; `check_model` compares the fingerprint when a
    model trains), so a new model built on the loaded layer accepts it. The
    entry's release and threshold delta are not charged again there: that
    model carries the loaded ledger's (`tfdp.models.weight_ledgers`), so the
    waiting copy has none.
    """
    by_name = {entry["layer"]: entry for entry in entries}
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        if layer.name in by_name:
            _hold(layer, model)
            if layer not in _PENDING:
                _PENDING[layer] = (dict(by_name[layer.name], additive_delta=0.0), None, None)
