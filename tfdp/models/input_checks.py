"""Checks of `fit`'s arguments that name what is wrong before the first step.

Each function raises a ValueError naming the argument and what was
received: a record by its position, shape or dtype, never its values
(which the message would show to whoever reads the error; with
`TFDP_SHOW_STEP_ERRORS=1` an id or the model's error text is shown, for
debugging on data that is not private). None of them reads more of the
data than the check needs.

Example:

>>> import numpy as np
>>> as_array("x", [[1.0, 2.0], [3.0]])
Traceback (most recent call last):
...
ValueError: Expected `x` to be a rectangular numeric array (pad ragged rows to one length, or use a tfdp.data.RecordSource). Received: x with rows of different lengths
"""

import keras
import numpy as np
import tensorflow as tf

from tfdp.data import sources
from tfdp.models import multi_output, step_errors
from tfdp.record_values import SHOW_ENV, record_values_shown


def as_array(name, value):
    """`np.asarray(value)`, refusing ragged and non-numeric data by name."""
    try:
        array = np.asarray(value)
    except ValueError:
        array = None
    if array is None or array.dtype == object:
        several = (" (one target per output of a model with several outputs: a subclassed "
                   "model, whose outputs compile cannot see, compiles with a list or dict of "
                   "losses, one per output)" if name == "y" and isinstance(value, (list, tuple))
                   else "")
        raise ValueError(
            f"Expected `{name}` to be a rectangular numeric array (pad ragged rows to "
            f"one length, or use a tfdp.data.RecordSource){several}. Received: "
            f"{name} with rows of different lengths"
        )
    if array.ndim == 0:
        raise ValueError(
            f"Expected `{name}` to have one entry per example. Received: {name}={value!r}"
        )
    return array


def check_label_values(y, units, name="y"):
    """Labels are numbers; class indices fit a model with `units` outputs
    (`name` says whose labels, e.g. "validation_data's y"). A model with
    several outputs gives `y` as a tuple or dict of arrays and `units` as
    {output name: units} (`tfdp.models.multi_output.label_units`)."""
    if isinstance(y, (tuple, list, dict)):
        names = list(units) if isinstance(units, dict) else []
        items = y.items() if isinstance(y, dict) else enumerate(y)
        for key, labels in items:
            output = key if isinstance(y, dict) else (names[key] if key < len(names) else None)
            check_label_values(np.asarray(labels), (units or {}).get(output),
                               f"{name}[{key!r}]")
        return
    if y.dtype.kind not in "biuf":
        raise ValueError(
            "Expected numeric labels (class indices or targets); map strings to "
            f"class indices first. Received: {name} of dtype {sources._dtype_name(y.dtype)}"
        )
    is_index_vector = y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1)
    if not (units and units > 1 and is_index_vector and len(y)):
        return
    if y.dtype.kind == "f" and not np.all(np.isfinite(y) & (y == np.round(y))):
        return  # targets, not class indices
    outside = np.flatnonzero((y.reshape(len(y)) < 0) | (y.reshape(len(y)) >= units))
    if outside.size:  # the position, never a record's value (a label may be an id)
        raise ValueError(
            f"Labels must be class indices in [0, {units - 1}] for a model with "
            f"{units} outputs. Received: {name} with {outside.size} label(s) outside that "
            f"range, the first at index {outside[0]}"
        )


def class_weights_for(y, class_weight):
    """Per-example weights from a `class_weight` dict that covers every class."""
    if y.ndim > 2 or (y.ndim == 2 and y.shape[1] != 1):
        raise ValueError(
            "`class_weight` needs integer class labels of shape [N]. Received: "
            f"y of shape {y.shape}"
        )
    labels = y.reshape(-1).astype(np.int64)
    missing = sorted(set(np.unique(labels).tolist()) - set(int(k) for k in class_weight))
    if missing:
        raise ValueError(
            f"`class_weight` has no weight for classes {missing[:10]} found in y. "
            f"Received: class_weight with keys {sorted(class_weight)[:10]}"
        )
    table = {int(k): float(v) for k, v in class_weight.items()}
    return np.asarray([table[c] for c in labels], np.float32)


def check_sample_weight_shape(sample_weight, y, name="sample_weight"):
    """One weight per example ([N] or [N, 1]), or one per token (y's shape)."""
    if sample_weight.ndim == 1 or sample_weight.shape == y.shape:
        return
    if sample_weight.ndim == 2 and sample_weight.shape[1] == 1:
        return
    raise ValueError(
        "Expected `sample_weight` of shape [N] (one weight per example) or of y's "
        f"shape {y.shape} (one per token). Received: {name} of shape "
        f"{sample_weight.shape}"
    )


def one_weight_per_example(sample_weight):
    """`sample_weight` of shape [N, 1] as [N]: one weight per example, as
    Keras reads it (the train step takes weights of rank 2 for per-token
    weights, which need a loss with one value per token)."""
    if sample_weight.ndim == 2 and sample_weight.shape[1] == 1:
        return sample_weight[:, 0]
    return sample_weight


def check_validation_data_fits(model, validation_data, units, split_at=None):
    """Refuses validation data the built `model` could not evaluate.

    Keras evaluates `validation_data` only after an epoch of steps, so a
    wrong input width, string or out-of-range labels, a wrong weight shape
    or a RecordSource failed there, after the epoch's privacy was spent. The
    first example runs through the model here (an inference pass on data
    that is not training data), and the labels and weights are checked as
    the training ones.

    Args:
        model: the built model `fit` trains.
        validation_data: as given to `fit`.
        units: the model's number of outputs (None if unknown).
        split_at: where `validation_split` cut `x`, when it gave
            `validation_data` (its records are then named as x's).

    Returns:
        `validation_data`, with an `ArraySource` given as its arrays (which
        Keras takes).

    Example:

    >>> check_validation_data_fits(None, None, 3) is None
    True
    """
    if isinstance(validation_data, sources.ArraySource):
        validation_data = tuple(validation_data.arrays)
    elif validation_data is not None and sources.as_source(validation_data) is validation_data:
        raise ValueError(
            "Keras evaluates `validation_data` itself, and takes arrays or a "
            f"tf.data.Dataset, not a {type(validation_data).__name__}: pass arrays "
            "(for records on disk, tfdp.data.read_records(path).arrays) or a "
            f"tf.data.Dataset. Received: validation_data={validation_data!r}"
        )
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
        return validation_data
    x, y = validation_data[0], validation_data[1]
    if isinstance(units, dict) or multi_output.has_several_outputs(model):  # one target per output
        y = multi_output.check_targets(model, y, "validation_data's y")
        if len(validation_data) == 3:
            multi_output.check_sample_weight(validation_data[2], None,
                                             "validation_data's sample_weight")
    else:
        y = as_array("validation_data's y", y)
    check_label_values(y, units, "validation_data's y")
    if len(validation_data) == 3 and validation_data[2] is not None and not isinstance(units, dict):
        weights = as_array("validation_data's sample_weight", validation_data[2])
        check_sample_weight_shape(weights, y, "validation_data's sample_weight")
    x = x if not isinstance(x, list) else tuple(x)
    if split_at is None:
        check_embedding_ids(model, x, "validation_data's x")
    else:
        check_embedding_ids(model, x, "x", first_record=split_at)
    first = tf.nest.map_structure(lambda a: np.asarray(a[:1]), x)
    try:
        model(first, training=False)
    except Exception as error:  # whatever the model raises, named with its class
        failure = _forward_failure(error, model, tf.nest.map_structure(np.shape, x))
    else:
        return validation_data
    raise failure  # outside the handler: nothing chains the original unless shown


def _forward_failure(error, model, shapes):
    """The ValueError for validation data whose first example fails the
    forward pass with `error`: its class and node, not its text, which can
    quote the example (`StringToNumber` on a held-out record's field); the
    text, chained, with `TFDP_SHOW_STEP_ERRORS=1`."""
    shown = record_values_shown()
    node = step_errors.failed_node(error) if isinstance(error, tf.errors.OpError) else None
    what = type(error).__name__ + (f" in node {node!r}" if node else "")
    detail = (f"{what}: {error}" if shown else
              f"{what}; its message is withheld because it can quote the example's values: "
              f"set {SHOW_ENV}=1 to see it, on data that is not private")
    inputs = [tuple(tensor.shape) for tensor in getattr(model, "inputs", None) or []]
    takes = f" (the model's inputs take shapes {inputs})" if inputs else ""
    failure = ValueError(
        "`validation_data` does not fit the model: its first example fails the "
        f"model's forward pass ({detail}){takes}. Received: validation_data x with shape "
        f"{shapes}"
    )
    failure.__cause__ = error if shown else None
    return failure


def check_record_source(source, units):
    """Checks record 0 of a RecordSource against the model before the first
    step, and returns the source to read, with every batch's class-index
    labels checked against the model's `units` outputs.

    A label out of range, which the loss reports without a record index
    (or, on a GPU, turns into NaN), is an error naming the record: record 0
    now, any other when a step reads it (before the step runs). Integer
    labels of shape () or (1,) are class indices when the model has more
    than one output.

    Args:
        source: the `RecordSource` `fit` trains on.
        units: the model's number of outputs (None if unknown).

    Returns:
        `source`, or a source reading it with the label check
        (`tfdp.data.sources.with_batch_check`).

    Example:

    >>> records = [(np.zeros(2, np.float32), 1)] * 4
    >>> check_record_source(sources.RecordSource(records), units=3)
    RecordSource(list, num_records=4)
    """
    first = source[0]
    if len(first) == 3 and not isinstance(first[2], (tuple, dict)):
        weight, label = np.shape(first[2]), np.shape(first[1])
        if weight not in ((), label):
            raise ValueError(
                "Expected the sample_weight of record 0 to be a scalar (one weight per "
                f"example) or of its label's shape {label} (one per token). Received: "
                f"sample_weight of record 0 with shape {weight}"
            )
    spec = source.element_spec[1]
    if not (
        isinstance(spec, tf.TensorSpec) and isinstance(units, int) and units > 1
        and (spec.dtype.is_integer or spec.dtype.is_bool) and spec.shape[1:] in ((), (1,))
    ):
        return source
    position = len(tf.nest.flatten(source.element_spec[0]))

    def check(arrays, indices):
        labels = np.asarray(arrays[position]).reshape(len(indices), -1)[:, 0]
        bad = (labels < 0) | (labels >= units)
        if bad.any():
            row = int(np.argmax(bad))
            raise ValueError(  # the record's position, never its value
                f"Record {int(indices[row])} has a label outside [0, {units - 1}]: a model "
                f"with {units} outputs takes class indices 0 to {units - 1}. Training "
                "stopped before the step that read it. Received: a label out of range at "
                f"record {int(indices[row])}"
            )

    check([np.asarray(leaf)[None] for leaf in tf.nest.flatten(first)], [0])
    return sources.with_batch_check(source, check)


def check_validation_data(validation_data):
    """Validation arrays of equal lengths, found before any budget is spent."""
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) < 2:
        return
    lengths = []
    for part in validation_data:
        leaves = keras.tree.flatten(part) if isinstance(part, (dict, tuple, list)) else [part]
        lengths += [len(leaf) for leaf in leaves if hasattr(leaf, "__len__")]
    if len(set(lengths)) > 1:
        raise ValueError(
            "Expected the arrays of `validation_data` to have one entry per example "
            f"each. Received: validation_data with lengths {lengths}"
        )


def check_embedding_ids(model, x, name="x", first_record=0):
    """Refuses ids outside an Embedding's vocabulary before any record is used.

    A `keras.layers.Embedding` that a model input feeds directly (a layer
    of the model's own graph called on the Input) receives ids in
    [0, input_dim): the input's values after Keras casts them to the
    Input's dtype and the Embedding casts floats to integers (toward zero).
    An id beyond it crashes the step that samples its record (a gather out
    of range on CPU), so whether and when training fails would depend on
    one record: a release no epsilon covers. The ids are checked here, from
    the arrays alone (no layer of the model runs), naming the first record
    that breaks the range by its position (its id only with
    `TFDP_SHOW_STEP_ERRORS=1`: an id can identify a person). `fit` checks in-memory arrays and validation
    data this way. Not seen: ids read from a RecordSource or a tf.data
    pipeline, ids that `fit(augment=...)` produces, an Embedding behind any
    layer or op (a slice, a Lambda), inside a nested model (which casts
    again, to its own Input's dtype), a layer's own `call` (KerasHub's
    token-and-position embedding) or a subclassed model, and lookup layers
    without an out-of-vocabulary index: check their ids yourself.

    Args:
        model: the built model.
        x: its inputs (arrays, as `fit` takes them; dicts structured as the
            model's inputs, or by Input name for a model built from a list).
        name: what to call `x` in the error.
        first_record: the index in `name` of x's first record.

    Example:

    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,), dtype="int32"),
    ...                           keras.layers.Embedding(5, 3, name="tokens")])
    >>> check_embedding_ids(model, np.array([[1, 4], [0, 7]]))
    Traceback (most recent call last):
    ...
    ValueError: Expected the ids in `x` that feed Embedding 'tokens' to lie in [0, 4] (its input_dim is 5). Received: record 1, which gives it an id outside that range (its value is withheld, as an id can identify a person: set TFDP_SHOW_STEP_ERRORS=1 to see it)
    """
    for tensor in getattr(model, "inputs", None) or []:
        layers = list(_embeddings_reading(model, tensor))
        if not layers:
            continue
        array = np.asarray(_array_of(model, x, tensor, name))
        if array.dtype.kind not in "biuf" or array.size == 0:
            continue
        for start in range(0, len(array), _CHUNK):  # as Keras casts it to the Input's dtype
            ids = tf.cast(array[start:start + _CHUNK], tensor.dtype).numpy()
            for layer in layers:
                _check_ids_in_range(ids, layer, name, first_record + start)


_CHUNK = 65536  # records cast at once


def _array_of(model, x, tensor, name):
    """The array of `x` that Keras feeds to the Input `tensor`: paired with
    the model's inputs structure (dicts by key, at any depth), a flat dict
    by Input name, else by position."""
    inputs = list(model.inputs)
    struct = getattr(model, "_inputs_struct", None)
    if isinstance(x, dict) and isinstance(struct, dict):
        # Keras feeds flatten(x) by position (warning, not refusing, when the
        # keys differ), so only x of the model's own structure is paired here.
        same_struct, same_x = keras.tree.lists_to_tuples(struct), keras.tree.lists_to_tuples(x)
        try:
            keras.tree.assert_same_structure(same_struct, same_x)
        except (ValueError, TypeError):
            pass
        else:
            for candidate, array in zip(keras.tree.flatten(same_struct),
                                        keras.tree.flatten(same_x)):
                if candidate is tensor:
                    return array
    elif isinstance(x, dict) and tensor.name in x:  # Keras reads a dict by Input name
        return x[tensor.name]
    arrays = keras.tree.flatten(x) if isinstance(x, (list, tuple)) else [x]
    if not isinstance(x, dict) and len(arrays) == len(inputs):
        return arrays[next(i for i, candidate in enumerate(inputs) if candidate is tensor)]
    raise ValueError(
        f"Expected `{name}` structured as the model's inputs, so that the ids of Input "
        f"'{tensor.name}' (it feeds an Embedding) can be checked. Received: {name} with "
        f"structure {keras.tree.map_structure(lambda a: np.shape(a), x)}"
    )


def _embeddings_reading(model, tensor):
    """The Embedding layers of `model`'s graph called on `tensor` itself."""
    for layer in getattr(model, "layers", ()):
        if isinstance(layer, keras.layers.Embedding) and any(
                len(node.input_tensors) == 1 and node.input_tensors[0] is tensor
                for node in getattr(layer, "_inbound_nodes", ())):
            yield layer


def embedding_vocabularies(model):
    """For each model input, its dtype and the sorted input_dims of the
    Embeddings it feeds directly: what `check_embedding_ids` checks ids
    against.

    Example:

    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(5, 3)])
    >>> embedding_vocabularies(model)
    [('int32', [5])]
    """
    return [(str(tensor.dtype), sorted(layer.input_dim for layer in _embeddings_reading(model, tensor)))
            for tensor in getattr(model, "inputs", None) or []]


def check_input_names(model):
    """Refuses a model built from a dict of Inputs whose keys differ from
    the Inputs' names. Keras asks for matching names (it warns when such a
    model is built), and an array's key and its Input's name would then
    disagree on which input it feeds: a check that pairs by name (as an
    earlier version of `check_embedding_ids` did) would read another array
    than the one Keras feeds.

    Example:

    >>> import keras
    >>> check_input_names(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    """
    struct = getattr(model, "_inputs_struct", None)
    if not isinstance(struct, dict):
        return
    renamed = {key: tensor.name for key, tensor in struct.items()
               if isinstance(tensor, keras.KerasTensor) and key != tensor.name}
    if renamed:
        raise ValueError(
            "Name each Input as its key in the model's inputs dict (keras.Input(..., "
            "name=key)), as Keras asks: with other names, an array's key and its Input's name "
            "disagree on which input it feeds. Received: keys mapped to Inputs named "
            f"{renamed}"
        )


def _check_ids_in_range(ids, layer, name, first_record):
    """`ids` [records, ...] as `layer` receives them: floats are cast toward zero."""
    limit = layer.input_dim
    flat = ids.reshape(len(ids), -1)
    if flat.dtype.kind == "f":
        finite = np.isfinite(flat)
        whole = np.trunc(np.where(finite, flat, 0))
        wrong = ~finite | (whole < 0) | (whole >= limit)
    else:
        wrong = (flat < 0) | (flat >= limit)
    if wrong.any():
        row = int(np.argmax(wrong.any(axis=1)))
        value = flat[row][wrong[row]][0]
        given = (f"id {value.item()!r}" if record_values_shown() else
                 f"an id outside that range (its value is withheld, as an id can identify a "
                 f"person: set {SHOW_ENV}=1 to see it)")
        raise ValueError(
            f"Expected the ids in `{name}` that feed Embedding '{layer.name}' to lie in "
            f"[0, {limit - 1}] (its input_dim is {limit}). Received: record "
            f"{first_record + row}, which gives it {given}"
        )
