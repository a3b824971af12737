"""Nothing but tfdp's and the optimizer's state changes in a DP step.

A layer that writes a variable while it trains (a running mean, a queue, a
memory bank: what BatchNormalization does with its moving statistics) puts
training records' data into that variable, and the variable is released with
the model, outside the noise and the accounting. Two checks refuse it:

- `checked_per_example_pass`, the line that holds: the DP step (whole, or
  chunk by chunk in physical batches) runs its per-example forward and
  backward pass inside it, and as the step is traced it scans the ops that
  pass added to the step's own graph. What runs is what is checked, whatever
  changed since fit began (a callback's `on_train_begin`, a Python attribute
  a layer's `call()` reads, a recompile). A DP step never runs eagerly
  (`run_eagerly=True` is refused): eager Python in a layer's `call()`
  (`.numpy()`, a list, a file) has no graph to check.
- `check_dp_model`, fit's early check: it traces the same pass
  (`tfdp.per_example.compute_per_example_gradients`, on the model's path)
  before any step, for a clear error before training starts.

In either, every op that writes a resource (`AssignVariableOp`,
`AssignAddVariableOp`, `ResourceScatter*`, `ResourceApply*`, a lookup
table's insert ...), in the pass and in every function it calls (`tf.cond`
branches, loop bodies), is a write by a layer: the optimizer's update and
tfdp's own counters are not part of the pass. The check sees what `call()`
does in training, not what the layer class is: a frozen layer whose
`call()` writes nothing passes.

Which ops write is decided by an allowlist: any op given a resource that
was not created inside the traced function by a known creator of fresh
local resources (`_LOCAL_RESOURCES`: a handle passed through a `tf.cond` or
a loop counts as from outside) is a write unless it only reads (`_READS`), so
queues, random generators' states and ops tfdp does not know are refused
too, and so is Python run inside the step (`tf.py_function`), whose writes
the graph cannot show. One write is allowed: a `keras.random.SeedGenerator`'s
state (`Dropout`'s random seed) assigned a value computed only from reads of
that same state, constants and pure arithmetic; anything else reaching it
(an input, another resource, a stateful op such as a queue) is refused.

Example:

>>> import keras, tensorflow as tf
>>> class RunningMean(keras.layers.Layer):
...     def build(self, shape):
...         self.mean = self.add_weight(shape=shape[1:], initializer="zeros",
...                                     trainable=False, name="running_mean")
...     def call(self, x, training=None):
...         if training:
...             self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(x, 0))
...         return x
>>> model = keras.Sequential([keras.Input((3,)), RunningMean(name="stats"), keras.layers.Dense(2)])
>>> loss = lambda y, p: tf.reduce_sum(tf.square(y - p), -1)
>>> check_no_state_writes(model, (tf.zeros([1, 3]), tf.zeros([1, 2])), loss)
Traceback (most recent call last):
...
ValueError: Layer 'stats' (RunningMean) writes its variable 'running_mean' ...
"""

import contextlib

import keras
import tensorflow as tf

from tfdp.per_example import compute_per_example_gradients
from tfdp.per_example.inference_mode import BatchNormalizationInTraining

# Ops that only read a resource, or pass a handle on (a call or control flow
# whose body is checked in turn). Any other op given a resource that comes
# from outside the traced function (a model variable, a table, a queue, a
# random generator's state) is treated as a write: an allowlist, so that an
# op this list does not know is refused rather than missed.
_READS = {
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
    "VarIsInitializedOp", "LookupTableFindV2", "LookupTableSizeV2", "Identity",
    "IdentityN", "PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf",
    "While", "StatelessWhile", "Case", "StatelessCase",
}
# Python inside the step: what it writes (a variable's assign, a file, a
# global) is invisible in the graph, so it is refused; and ops that write a
# tensor outside the model (a file, a log, a summary) release it as it is.
_PYTHON_OPS = {"EagerPyFunc", "PyFunc", "PyFuncStateless"}
_OUTPUT_OPS = {"WriteFile", "PrintV2", "Print", "Save", "SaveV2", "SaveSlices",
               "MergeV2Checkpoints"}
_OUTPUT_PREFIXES = ("Write",)  # WriteSummary, WriteScalarSummary, ...
_CALL_ATTRS = ("f", "then_branch", "else_branch", "body", "cond", "branches")
# Ops that create a fresh resource inside the traced function, no one else's:
# what is done to it stays in the step.
_LOCAL_RESOURCES = {"TensorArrayV3", "StackV2"}


def check_dp_model(model, sample):
    """`check_no_state_writes` for a compiled `tfdp.DPModel` on a sample batch
    of its training data (its loss, its per-example path): fit's early check,
    made once per model and configuration (layers' `trainable` flags, path,
    shapes). What changes the step without changing those (a callback, a
    Python attribute) is refused by `checked_per_example_pass` as the step
    is traced.

    Args:
        model: a built, compiled `tfdp.DPModel`.
        sample: `(x, y)` or `(x, y, sample_weight)`, batch first (NumPy
            arrays or tensors; one example is enough).
    """
    sample = tf.nest.map_structure(tf.convert_to_tensor, tuple(s for s in sample if s is not None))
    x, targets, loss_fn = _step_inputs(model, sample)
    method = model.per_example_gradients
    key = (method, tuple(layer.trainable for layer in model._flatten_layers()),  # pylint: disable=protected-access
           str(tf.nest.map_structure(lambda t: (t.shape[1:], t.dtype), (x, targets))))
    checked = model.__dict__.setdefault("_state_writes_checked", set())
    if key in checked:
        return
    check_no_state_writes(model, (x, targets), loss_fn, method)
    checked.add(key)


def _step_inputs(model, arrays):
    """(x, targets, per-example loss) as the step takes them."""
    # pylint: disable=protected-access
    if len(arrays) > 2 and arrays[2] is not None and arrays[2].shape.rank > 1:
        return arrays[0], (arrays[1], arrays[2]), model._per_token_loss  # per-token weights
    return arrays[0], arrays[1], model._per_example_loss


@contextlib.contextmanager
def checked_per_example_pass(model):
    """Refuses the model if the ops made inside it write state: the DP step
    runs its per-example pass in it.

    As the step is traced, the ops added to the graph being built inside the
    block (and the functions they call: `tf.cond` branches, loop bodies) are
    checked as `check_no_state_writes` checks them, when the block ends:
    before the step has ever run, so a refused step is not charged. Run
    eagerly there is nothing to scan: the DP step refuses to run eagerly
    before it gets here.

    Example:

    >>> import keras, tensorflow as tf
    >>> class RunningMean(keras.layers.Layer):
    ...     def build(self, shape):
    ...         self.mean = self.add_weight(shape=shape[1:], initializer="zeros",
    ...                                     trainable=False, name="running_mean")
    ...     def call(self, x):
    ...         self.mean.assign(tf.reduce_mean(x, 0))
    ...         return x
    >>> model = keras.Sequential([keras.Input((3,)), RunningMean(name="stats")])
    >>> @tf.function(autograph=False)
    ... def step(x):
    ...     with checked_per_example_pass(model):
    ...         return model(x)
    >>> step(tf.ones([2, 3]))
    Traceback (most recent call last):
    ...
    ValueError: Layer 'stats' (RunningMean) writes its variable 'running_mean' ...
    """
    if tf.executing_eagerly():
        yield
        return
    graph = tf.compat.v1.get_default_graph()
    start = len(graph.get_operations())
    yield
    _refuse_writes(model, graph, graph.get_operations()[start:])


def check_no_state_writes(model, sample, loss_fn, method="auto", training=True):
    """Refuses a model whose DP step would write a variable of its own.

    Args:
        model: a built Keras model.
        sample: a batch `(x, y)` or `(x, y, sample_weight)` shaped like the
            training data (one example is enough; only its shapes are used).
        loss_fn: the per-example loss, callable(y_true, y_pred) -> [B]
            (for per-token weights, the model's token-weighted loss and
            `(y, weights)` as y).
        method: the per-example path the step takes ("auto", "batched",
            "vectorized").
        training: as the step calls the layers.

    Raises:
        ValueError: naming the layer and the variable it writes (or the op,
            for a resource that is not a model variable).
    """
    x, targets = sample[0], sample[1]

    def forward_backward(x, targets):
        size = tf.shape(tf.nest.flatten(x)[0])[0]
        grads, _, _ = compute_per_example_gradients(
            model, x, targets, tf.ones([size]), loss_fn, method, training)
        return grads.sq_norms()

    try:
        graph = tf.function(forward_backward).get_concrete_function(x, targets).graph
    except BatchNormalizationInTraining:
        raise  # refused by name before the first step, not at the step's trace
    except Exception:  # pylint: disable=broad-except
        # A step that cannot be traced cannot run either: nothing is released,
        # and the step's own trace raises its error (named there) first.
        return
    _refuse_writes(model, graph, graph.get_operations())


def _refuse_writes(model, graph, operations):
    """Raises a ValueError for the first op of `operations` (ops of `graph`),
    or of a function they call, that writes state or runs Python."""
    variables = _model_variables(model)
    seeds = _seed_states(model)
    for op, owner in _writes(graph, operations):
        if op.type in _PYTHON_OPS:
            raise ValueError(_python_message(model, op))
        if op.type in _OUTPUT_OPS or op.type.startswith(_OUTPUT_PREFIXES):
            raise ValueError(_output_message(model, op))
        variable = _resolve(op.inputs[0], owner, variables) if op.inputs else None
        if (variable is not None and id(variable) in seeds and op.type == "AssignVariableOp"
                and _advanced_from_itself(op, owner, variable, variables)):
            continue  # an RNG state advanced from itself
        raise ValueError(_message(model, op, variable))


def _model_variables(model):
    """{id of a variable's resource handle: the Keras variable}."""
    found = {}
    for variable in model.variables:
        value = getattr(variable, "value", variable)
        # A distributed variable has one component per replica.
        for component in (value, *getattr(value, "values", ())):
            handle = getattr(component, "handle", None)
            if handle is not None:
                found[id(handle)] = variable
    return found


def _seed_states(model):
    """ids of the Keras variables that hold SeedGenerator states."""
    states = set()
    for layer in model._flatten_layers(include_self=True):  # pylint: disable=protected-access
        for generator in getattr(layer, "_seed_generators", ()):
            if isinstance(generator, keras.random.SeedGenerator):
                states.add(id(generator.state))
    return states


def _writes(graph, operations=None, seen=None):
    """(op, the graph it is in) for every op of `operations` (default: all of
    `graph`'s) and of the functions they call that may change a resource
    from outside the traced function (`_READS` aside), or runs Python."""
    seen = set() if seen is None else seen
    functions = getattr(graph, "_functions", {})
    for op in graph.get_operations() if operations is None else operations:
        if op.type in _PYTHON_OPS or op.type in _OUTPUT_OPS or op.type.startswith(
                _OUTPUT_PREFIXES) or (op.type not in _READS and any(
                _from_outside(t) for t in op.inputs if t.dtype == tf.resource)):
            yield op, graph
        for name in _called_functions(op):
            function = functions.get(name)
            nested = getattr(function, "graph", None)
            if nested is not None and name not in seen:
                seen.add(name)
                yield from _writes(nested, seen=seen)


def _from_outside(handle):
    """Whether a resource tensor may come from outside its function: anything
    but a fresh resource an op inside it created (`_LOCAL_RESOURCES`). A
    handle passed on by control flow or a call (`If`, `While`, `Case`, a
    function's output) counts as from outside: an allowlist of what is local,
    so that a variable's handle routed through a `tf.cond` is not missed."""
    op = handle.op
    while op.type in ("Identity", "IdentityN") and op.inputs:
        op = op.inputs[0].op
    return op.type not in _LOCAL_RESOURCES


def _called_functions(op):
    names = []
    for key in _CALL_ATTRS:
        if key not in op.node_def.attr:
            continue
        value = op.node_def.attr[key]
        if value.HasField("func"):
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func)
    return names


def _resolve(handle, graph, variables):
    """The model variable a resource tensor is, through captures; else None."""
    while True:
        external = _external_capture(graph, handle)
        if external is None:
            return None
        outer = getattr(external, "graph", None)  # an eager tensor has none
        if outer is None:  # an eager handle: the variable itself
            return variables.get(id(external))
        handle, graph = external, outer


def _external_capture(graph, internal):
    for external, captured in getattr(graph, "captures", ()):
        if captured is internal:
            return external
    return None


# Ops a seed state's new value may pass through: pure arithmetic on values.
_PURE = {
    "Const", "Identity", "Cast", "Add", "AddV2", "Sub", "Mul", "FloorMod", "Mod",
    "BitwiseXor", "BitwiseAnd", "BitwiseOr", "LeftShift", "RightShift", "Pack",
    "Unpack", "StridedSlice", "Reshape", "ConcatV2", "GatherV2", "Shape", "Fill",
    "ZerosLike", "OnesLike", "Maximum", "Minimum", "Neg", "FloorDiv", "Squeeze",
    "ExpandDims", "Select", "SelectV2", "StatelessRandomGetKeyCounter",
}


def _advanced_from_itself(op, graph, variable, variables):
    """Whether the value `op` writes to a seed state comes only from reads of
    that same state, constants and pure arithmetic (no input, no other
    resource, no stateful op: nothing that could carry a record in)."""
    pending, visited = [op.inputs[1].op], set()
    while pending:
        current = pending.pop()
        if current.name in visited:
            continue
        visited.add(current.name)
        if current.type == "ReadVariableOp":
            if _resolve(current.inputs[0], graph, variables) is not variable:
                return False
            continue
        if current.type not in _PURE:
            return False
        pending.extend(t.op for t in current.inputs)
    return True


def _owner(model, variable):
    """The innermost layer that holds `variable`."""
    owner = None
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        if any(v is variable for v in layer.variables):
            if owner is None or len(layer.variables) <= len(owner.variables):
                owner = layer
    return owner


def _python_message(model, op):
    return (
        f"Model '{model.name}' runs Python inside its DP step (tf.py_function or "
        "tf.numpy_function): what it writes (a variable, a file, a global) cannot be "
        "seen or bounded there, and it could keep training records outside the "
        "clipping and the noise. Compute that part with TensorFlow operations, or "
        f"keep it out of the DP model. Received: op '{op.name}' ({op.type})"
    )


def _output_message(model, op):
    return (
        f"Model '{model.name}' writes a tensor out of its DP step (tf.print, "
        "tf.io.write_file, a summary or a checkpoint save inside call()): what it writes "
        "is released as it is, outside the clipping and the noise. Log values outside "
        "the model (a callback reading the logs), or keep that layer out of the DP "
        f"model. Received: op '{op.name}' ({op.type})"
    )


def _message(model, op, variable):
    why = (
        "during the DP step: after one step it holds a function of training "
        "records, outside the clipping and the noise, and it is saved and "
        "released with the model. Compute it without writing state in training "
        "(or freeze the layer so that its call() writes nothing), or keep that "
        "layer out of the DP model."
    )
    if variable is None:
        return (
            f"Model '{model.name}' writes a resource that is not one of its "
            f"variables {why} Received: op '{op.name}' ({op.type})"
        )
    layer = _owner(model, variable)
    holder = f"Layer '{layer.name}' ({type(layer).__name__})" if layer else f"Model '{model.name}'"
    return (
        f"{holder} writes its variable '{variable.name}' {why} Received: a write "
        f"({op.type}) to variable '{variable.path}'"
    )
