"""Nothing but tfdp's and the optimizer's state changes in a DP step, and
nothing leaves it.

A layer that writes a variable while it trains (a running mean, a queue, a
memory bank: what BatchNormalization does with its moving statistics) puts
training records' data into that variable, and the variable is released with
the model, outside the noise and the accounting; an op that writes a file, a
summary, a debug dump or a print releases its input as it is. The whole
compiled train step is scanned as it is traced, before it has ever run, and
what it may run is allowed, not denied:

- `checked_train_step`: every op of `DPModel.train_step` (the per-example
  forward and backward pass, the loss, compiled metrics' `update_state`,
  tfdp's noise and counters, the optimizer's update, and whatever a callback
  changed in the model), in every function it calls (`tf.cond` branches,
  loop bodies; a function called from two places is checked at each, with
  the inputs that place passes), must be allowed by `tfdp.models.step_ops` (a stateless op of
  TensorFlow's computing libraries, or a stateful op known to keep its
  effects in the step) and may write only a variable of the model, its
  optimizer or its metrics (or tfdp's own counters); anything else is
  refused, naming the layer or metric (by the op's name scope) and the op.
  tfdp's own writes and the optimizer's update are told from a layer's by
  where they are made: outside the two blocks below, by tfdp's code, on
  variables it knows.
- `checked_per_example_pass`, the line that holds for layers: the DP step
  (whole, or chunk by chunk in physical batches) runs its per-example
  forward and backward pass inside it, and every later run of the methods
  of the gradient parts the pass made (their norm bounds, clipped sums,
  `grouped`, `materialize`: a registered rule's own code) is scanned by
  the same rules as it is traced (`tfdp.per_example.grads.PART_CALLS`).
  What runs is what is checked, whatever changed since fit began (a
  callback's `on_train_begin`, a Python attribute a layer's `call()` reads,
  a recompile). A DP step never runs eagerly (`run_eagerly=True` is
  refused): eager Python in a layer's `call()` (`.numpy()`, a list, a
  file) has no graph to check.
- A lookup table read in the step (`LookupTableFindV2`) must be held by a
  Keras `StringLookup`, `IntegerLookup` or `TextVectorization` layer of the
  model (or one `fit(augment=fn)` names), whose vocabulary fit checks
  (`tfdp.preprocessing`): a custom layer's `tf.lookup` table keyed by
  training records' ids would be saved with the model unchecked.
- `checked_metric_updates`: the step updates its compiled metrics in it; a
  metric may write only its own variables (`add_variable`, and those of
  the metrics it holds), not a model weight (a bias set to a label), an
  optimizer's state, a seed or another metric's variables. Keras saves no
  metric variable in a model file, a weights file, a checkpoint or a
  backup, and tfdp's statement names training metrics, logged from the
  private batches without noise, as outside the epsilon
  (docs/mechanisms/guarantee.md); the rule keeps each metric's value its
  own computation, so no metric passes a record into another's log or into
  what a callback decides by it.
- What the step writes into a saved variable (outside the pass) is followed
  back through the graph to the batch, which it may reach only through the
  noisy gradients (`tfdp.models.released_writes`): a layer can keep a
  tensor in Python, where no op shows it, but not hide the graph's edges
  from a constraint or schedule that reads it.
- `check_dp_model`, fit's early check: it traces the same pass
  (`tfdp.per_example.compute_per_example_gradients`, on the model's path)
  before any step, for a clear error before training starts; where a rule
  registered with `tfdp.per_example.register_rule` made a part of its own
  class, also what the step asks of that part after the pass (norm bounds,
  clipped sum, `grouped(1)`, `dots`), to refuse its writes that early too.

In the per-example pass, every op that writes a resource (`AssignVariableOp`,
`AssignAddVariableOp`, `ResourceScatter*`, `ResourceApply*`, a lookup
table's insert ...) is a write by a layer. The check sees what `call()`
does in training, not what the layer class is: a frozen layer whose
`call()` writes nothing passes. Which ops write is decided by an allowlist:
any op given a resource that was not created inside the traced function by
a known creator of fresh local resources (`_LOCAL_RESOURCES`: a handle
passed through a `tf.cond` or a loop counts as from outside) is a write
unless it only reads (`_READS`), so queues, random generators' states and
ops tfdp does not know are refused too, and so is Python run inside the
step (`tf.py_function`), whose writes the graph cannot show.

One write is allowed in the pass: a `keras.random.SeedGenerator`'s state
(`Dropout`'s random seed) assigned a value computed only from reads of that
same state, constants and pure arithmetic, where every input that decides
whether the write runs counts as an input to it: the predicate of each
`tf.cond` around it, the branch index of each `tf.switch_case`, the
condition of each loop (and, through it, the loop's variables). A seed
advanced in a branch the batch decides would count the steps that drew a
record, and the next dropout masks would move with it: refused. Anything
else reaching the state (an input, another resource, a stateful op such as
a queue) is refused. tfdp's own loop obeys the same rule: in physical
batches the pass runs once a chunk, as many chunks as rows were drawn, so
after its chunks the step sets each seed state one step past where the step
began (`tfdp.models.chunked_step`): the saved state counts steps, not drawn
records.

Ops that stop the step on a value are refused too: an assertion on values
(`tf.debugging.assert_*`, `tf.Assert`, `tf.debugging.check_numerics`) fails
on one record only, and whether training stopped, and the error, which may
print the value, tell that record; an assertion on shapes alone (TensorFlow's
own check of sparse labels against logits) passes, unless one of those
shapes is decided by values (the rows `tf.boolean_mask`, `tf.where` or
`tf.unique` keep: `tfdp.models.value_shapes` asks TensorFlow's shape
functions which). What the scan cannot see
is an op that fails on some values by itself (a `tf.gather` whose index is
computed from the input, out of range on CPU): such an abort on one record is
a side channel the epsilon does not cover (docs/guides/your-model.md).
TensorFlow's debug dumping, which instruments every op, is refused when fit
starts (`tfdp.models.debug_dumping`).

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
import re
import weakref

import keras
import tensorflow as tf

from tfdp.models import step_ops, value_shapes
from tfdp.per_example import compute_per_example_gradients
from tfdp.per_example.grads import PART_CALLS, Part
from tfdp.per_example.inference_mode import BatchNormalizationInTraining
from tfdp.preprocessing import provenance

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
# tensor outside the model (a file, a log, a summary, a debug dump, a
# record file) release it as it is.
_PYTHON_OPS = {"EagerPyFunc", "PyFunc", "PyFuncStateless"}
_OUTPUT_OPS = {"WriteFile", "PrintV2", "Print", "Save", "SaveV2", "SaveSlices",
               "MergeV2Checkpoints", "DatasetToTFRecord", "DebugIdentity",
               "DebugIdentityV2", "DebugIdentityV3", "DebugNanCount",
               "DebugNumericSummary", "DebugNumericSummaryV2",
               "DebugGradientIdentity", "DebugGradientRefIdentity"}
_OUTPUT_PREFIXES = ("Write", "Debug", "Save")  # WriteSummary, DebugIdentityV2, ...
# Ops that stop the step on a value: whether training stopped tells a record.
_ABORT_OPS = {"Assert", "CheckNumerics", "CheckNumericsV2"}
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
    if len(arrays) > 2 and tf.nest.is_nested(arrays[2]):  # a weight per output (multi_output)
        return arrays[0], (arrays[1], arrays[2]), model._per_example_loss.weighted_by_output
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
    # The gradients made inside run their parts' methods later (norms,
    # sums, grouped, materialize): each such run is scanned as the pass is.
    token = PART_CALLS.set(lambda: _scanned(model, _PASS))
    try:
        with _scanned(model, _PASS):
            yield
    finally:
        PART_CALLS.reset(token)


@contextlib.contextmanager
def checked_train_step(model, then=None):
    """Refuses the train step traced inside it if any of its ops is not
    allowed (`tfdp.models.step_ops`) or writes a resource that is not a
    variable of the model, its optimizer or its metrics: the whole compiled
    step (the per-example pass, the loss, the metrics, tfdp's noise and
    counters, the optimizer's update), checked as it is traced, before it
    has ever run. Preprocessing state is checked against its provenance as
    the trace starts (`tfdp.preprocessing.provenance.check_released`): the
    step keeps the lookup tables and tensors it captures then for every
    step it runs. `DPModel.train_step` runs in it; the per-example pass and
    the metrics' updates inside it are checked by their own, stricter rules
    (`checked_per_example_pass`, `checked_metric_updates`). `then(model,
    graph, walked)`, if given, checks the same ops further, on the walk
    this scan made (`walked`: `_walk`'s tuples): the DP step passes
    `tfdp.models.released_writes.refuse_record_writes`.

    Example:

    >>> import keras, tensorflow as tf
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense")])
    >>> @tf.function(autograph=False)
    ... def step(x):
    ...     with checked_train_step(model):
    ...         tf.raw_ops.DebugIdentityV2(input=model(x))
    ...         return model(x)
    >>> step(tf.ones([2, 3]))
    Traceback (most recent call last):
    ...
    ValueError: Model 'sequential...' writes a tensor out of its DP step ...
    """
    with _scanned(model, _STEP, then):
        yield


@contextlib.contextmanager
def checked_metric_updates(model):
    """Refuses the compiled metrics' updates traced inside it if they write
    anything but the metrics' own variables (a model weight set from a
    label, an optimizer's state), before the step has ever run. The DP step
    updates its metrics in it.

    Example:

    >>> import keras, tensorflow as tf
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="dense")])
    >>> @tf.function(autograph=False)
    ... def update(y):
    ...     with checked_metric_updates(model):
    ...         model.layers[0].bias.assign(y[:1])
    >>> update(tf.ones([2]))
    Traceback (most recent call last):
    ...
    ValueError: A compiled metric of model '...' writes variable '...bias', which is not ...
    """
    with _scanned(model, _METRICS), _each_metric_marked(model):
        yield


# A metric's update_state runs in a name scope that says which metric it is
# (Keras names none): the writes made there may reach only variables that
# metric holds and no other compiled metric does (`_metric_holding`): a
# metric it keeps inside is its own, a metric compiled beside it is not.
_METRIC_MARK = "tfdp_metric_"
_MARKED = re.compile(rf"{_METRIC_MARK}(\d+)(?:_\d+)?/")


@contextlib.contextmanager
def _each_metric_marked(model):
    """Runs each metric's `update_state` (traced in the block) in a name
    scope naming it by its index in `_all_metrics(model)`."""
    if tf.executing_eagerly():
        yield
        return
    metrics, replaced = _all_metrics(model), []
    for index, metric in enumerate(metrics):
        replaced.append(metric.__dict__.get("update_state"))
        metric.__dict__["update_state"] = _marked(metric.update_state, index)
    try:
        yield
    finally:
        for metric, earlier in zip(metrics, replaced):
            del metric.__dict__["update_state"]
            if earlier is not None:
                metric.__dict__["update_state"] = earlier


def _marked(update_state, index):
    def marked_update_state(*args, **kwargs):
        with tf.name_scope(f"{_METRIC_MARK}{index}"):
            return update_state(*args, **kwargs)
    return marked_update_state


def _writing_metric(model, path):
    """The metric whose `update_state` made the op at `path` (the innermost
    marked), or None outside any."""
    found = _MARKED.findall(path)
    metrics = _all_metrics(model)
    return metrics[int(found[-1])] if found and int(found[-1]) < len(metrics) else None


@contextlib.contextmanager
def _scanned(model, scope, then=None):
    if tf.executing_eagerly():
        yield
        return
    if scope == _STEP and hasattr(model, "privacy"):  # the step keeps what it captures now
        with tf.init_scope():  # eager: the layers' state as it is
            provenance.check_released(model, provenance.step_layers(model)[0])
    graph = tf.compat.v1.get_default_graph()
    start = len(graph.get_operations())
    yield
    operations = graph.get_operations()[start:]
    walked = _refuse_writes(model, graph, operations, scope)
    if scope == _PASS:
        pass_ops(graph).update(op.name for op in operations)
    if then is not None:
        then(model, graph, walked)


def pass_ops(graph):
    """The names of `graph`'s ops made inside `checked_per_example_pass`
    (the pass, and the runs of its parts' methods), once they were
    checked: a write there (a seed state advanced from itself) is governed
    by the pass's rules (`tfdp.models.released_writes`)."""
    return _PASS_OPS.setdefault(graph, set())


_PASS_OPS = weakref.WeakKeyDictionary()  # {graph: names of its pass's ops}


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
        grads, _, losses = compute_per_example_gradients(
            model, x, targets, tf.ones([size]), loss_fn, method, training)
        _trace_part_uses(grads, size)
        return losses

    try:
        # Traced as Keras traces the step (its train function is not
        # converted by AutoGraph), converting none of tfdp's functions
        # (seconds on a process's first fit). Under XLA the vectorized
        # path's loop converts what a layer hands to tf.map_fn: a write
        # there is refused at the step's trace (checked_per_example_pass),
        # before the step runs.
        graph = tf.function(forward_backward, autograph=False).get_concrete_function(
            x, targets).graph
    except BatchNormalizationInTraining:
        raise  # refused by name before the first step, not at the step's trace
    except Exception:  # pylint: disable=broad-except
        # A step that cannot be traced cannot run either: nothing is released,
        # and the step's own trace raises its error (named there) first.
        return
    _refuse_writes(model, graph, graph.get_operations())


def _trace_part_uses(grads, size):
    """Where a part of the pass is a registered rule's own
    (`_only_tfdp_parts`), traces what the step asks of it after the pass
    (its norm bounds, clipped sum, `grouped(1)`, `dots`), for
    `check_no_state_writes` to refuse a write there before training starts.

    The step runs the parts' methods after its pass; `checked_per_example_pass`
    scans each such run under the pass's rules as the step is traced (at the
    step's `grouped(k)`, AdaDP's `materialize`, whatever runs), so this
    early trace only brings a rule part's refusal forward, before the
    callbacks start. tfdp's own parts are tfdp's arithmetic on the pass's
    tensors: nothing more to trace. Each use is traced on its own: one that
    raises leaves the others and the pass checked (the ops it made stay,
    scanned).
    """
    if _only_tfdp_parts(grads.parts):
        return  # tfdp's arithmetic on the pass's tensors
    ones = tf.ones([size])
    zeros = [tf.zeros_like(v) for v in grads.variables]
    uses = [grads.sq_norms, lambda: grads.weighted_sum(ones),
            lambda: grads.grouped(1).weighted_sum(ones),
            lambda: grads.with_offsets(zeros).weighted_sum(ones)]
    for use in uses:
        try:
            use()
        except Exception:  # pylint: disable=broad-except
            pass


def _only_tfdp_parts(parts):
    """True if every part, and every part one holds (in attributes, lists,
    tuples or dicts), is of a class tfdp defines with no function of its
    own on the instance (a method replaced there); False on anything else,
    or if the walk fails."""
    try:
        pending, seen = list(parts), set()
        while pending:
            value = pending.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, (list, tuple)):
                pending.extend(value)
            elif isinstance(value, dict):
                pending.extend(value.values())
            elif isinstance(value, Part):
                if type(value).__module__.split(".")[0] != "tfdp":
                    return False
                pending.extend(vars(value).values())
            elif callable(value) and not isinstance(value, (tf.Variable, tf.Tensor)):
                return False
        return True
    except Exception:  # pylint: disable=broad-except
        return False


# What a scan allows to be written: in the per-example pass, nothing but a
# seed state advanced from itself; in a compiled metric's update_state, the
# metrics' own variables; in the rest of the step (tfdp's noise and counters,
# the optimizer's update), the variables of the model, its optimizer and its
# metrics.
_PASS, _METRICS, _STEP = "pass", "metrics", "step"


def _refuse_writes(model, graph, operations, scope=_PASS):
    """Raises a ValueError for the first op of `operations` (ops of `graph`),
    or of a function they call, that `scope` does not allow: an op
    `tfdp.models.step_ops` does not allow, Python, an output, an abort on
    values, or a write to a resource the scope may not write. Returns the
    walk it checked (`_walk`'s tuples)."""
    variables = _model_variables(model)
    seeds = _seed_states(model)
    optimizer_variables = _handles(_optimizer_variables(model))
    # A metric's own: not a model's or an optimizer's variable it holds.
    metric_variables = {key: v for key, v in _handles(_metric_variables(model)).items()
                        if key not in variables and key not in optimizer_variables}
    known = {**variables, **optimizer_variables, **metric_variables,
             **_handles(_own_variables(model))}
    tables = _lookup_tables(model)
    # Metrics name no scope of their own: their ops are marked as theirs.
    walked = list(_walk(graph, operations, path=_METRICS_PATH if scope == _METRICS else ""))
    definitions = {}  # graphs serialized to infer shapes again (value_shapes)
    for op, owner, path, _, chain in walked:  # the ops that release or stop first, by name
        if op.type in _PYTHON_OPS:
            raise ValueError(_python_message(model, op, path))
        if op.type in _OUTPUT_OPS or op.type.startswith(_OUTPUT_PREFIXES):
            raise ValueError(_output_message(model, op, path))
        if op.type in _ABORT_OPS and (op.type != "Assert" or reads_values(op, False)):
            raise ValueError(_abort_message(model, op, path))
        if op.type == "Assert":
            source = value_shapes.value_shaped(value_shapes.shapes_read(op), owner, chain,
                                               _sources, definitions)
            if source is not None:
                raise ValueError(_value_shape_message(model, op, source, path))
    for op, owner, path, controls, chain in walked:
        bodies = function_graphs(op, owner)
        if bodies and (op.type not in step_ops.CALLS or any(b is None for _, b in bodies)):
            raise ValueError(_unknown_message(model, op, path))  # a body the scan cannot follow
        if op.type in step_ops.COLLECTIVES:
            if scope != _PASS:
                continue  # the replicas' all-reduce of the step's own sums
            raise ValueError(_unknown_message(model, op, path))
        if op.type == "Assert":
            continue  # a check of shapes only: one on values was refused above
        if op.type in _TABLE_READS and _resolve(op.inputs[0], owner, tables, chain) is None:
            raise ValueError(_table_message(model, op, path))
        if _writes_outside(op):
            variable = _resolve(op.inputs[0], owner, known, chain) if op.inputs else None
            if scope == _METRICS:
                writer = _writing_metric(model, path)
                if not _may_write(scope, op, owner, chain, variable, controls, seeds,
                                  metric_variables, variables) or (
                                      writer is not None
                                      and _metric_holding(model, variable) is not writer):
                    raise ValueError(_metric_message(model, op, variable, path, writer))
            elif not _may_write(scope, op, owner, chain, variable, controls, seeds,
                                metric_variables, variables):
                raise ValueError(_message(model, op, variable, path, scope))
        elif not step_ops.allowed(op.type):
            raise ValueError(_unknown_message(model, op, path))
    return walked


def _may_write(scope, op, graph, chain, variable, controls, seeds, metric_variables,
               variables):
    """Whether `scope` allows `op`'s write to `variable` (None: not a known
    variable, always refused), `op` being in `graph`, reached through the
    call sites `chain`."""
    if variable is None:
        return False
    if scope == _STEP:
        return True  # the pass and the metrics were checked in their own blocks
    if scope == _METRICS:
        return any(v is variable for v in metric_variables.values())
    # A seed state advanced from itself, in a branch or loop that its own
    # state decides: the value written and every input deciding whether the
    # write runs (a cond's predicate, a case's index, a loop's condition).
    return (id(variable) in seeds and op.type == "AssignVariableOp" and all(
        _decided_by(tensor, where, calls, variable, variables)
        for tensor, where, calls in ((op.inputs[1], graph, chain), *controls)))


# Reads of a lookup table: its keys are saved with the model.
_TABLE_READS = {"LookupTableFindV2", "LookupTableSizeV2"}
# The lookup layers whose vocabulary `tfdp.preprocessing` checks the
# provenance of before fit (adapted privately or declared public).
_LOOKUP_LAYERS = (keras.layers.StringLookup, keras.layers.IntegerLookup,
                  keras.layers.TextVectorization)


def _lookup_tables(model):
    """{id of a table's resource handle: the Keras lookup layer holding it},
    for the lookup layers whose vocabulary fit checks: the model's and
    those `fit(augment=fn)`'s function names."""
    augmentation = getattr(model, "_augmentation", None)
    named = provenance.augment_layers(getattr(augmentation, "augment", None))
    # pylint: disable=protected-access
    layers = [inner for layer in [model, *named] for inner in layer._flatten_layers()]
    tables = {}
    for layer in layers:
        if not isinstance(layer, _LOOKUP_LAYERS):
            continue
        table = getattr(getattr(layer, "_lookup_layer", layer), "lookup_table", None)
        handle = getattr(table, "resource_handle", None)
        if handle is not None:
            tables[id(handle)] = layer
    return tables


def _writes_outside(op):
    """Whether `op` may change a resource from outside the traced function:
    given one, and not only reading or passing it on (`_READS`)."""
    return op.type not in _READS and any(
        _from_outside(t) for t in op.inputs if t.dtype == tf.resource)


def _model_variables(model):
    """{id of a variable's resource handle: the Keras variable}."""
    return _handles(model.variables)


def _optimizer_variables(model):
    """The optimizer's variables, and the tf.Variables it holds besides (a
    tfdp optimizer's step state, such as DPIS's table of gradient bounds)."""
    optimizer = getattr(model, "optimizer", None)
    return list(getattr(optimizer, "variables", None) or ()) + _held_variables(optimizer)


def _held_variables(holder, depth=3):
    """tf.Variables in `holder`'s attributes, their lists, dicts and
    attributes, `depth` levels down."""
    found, pending, seen = [], [(holder, 0)], set()
    while pending:
        value, level = pending.pop()
        if id(value) in seen or value is None or level > depth:
            continue
        seen.add(id(value))
        if isinstance(value, tf.Variable):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            pending.extend((v, level + 1) for v in value)
        elif isinstance(value, dict):
            pending.extend((v, level + 1) for v in value.values())
        elif hasattr(value, "__dict__") and not isinstance(value, (keras.Model, type)):
            pending.extend((v, level + 1) for v in vars(value).values())
    return found


def _own_variables(model):
    """tfdp's own step counters the model holds outside its metrics."""
    counter = getattr(model, "_nonfinite_counter", None)
    return list(counter.variables) if counter is not None else []


def _metric_variables(model):
    return [v for metric in getattr(model, "metrics", ()) for v in metric.variables]


def _handles(variables):
    """{id of a variable's resource handle: the Keras variable}."""
    found = {}
    for variable in variables:
        value = variable if isinstance(variable, tf.Variable) else getattr(
            variable, "value", variable)
        # A distributed variable has one component per replica.
        for component in (value, *getattr(value, "values", ())):
            handle = getattr(component, "handle", None)
            if handle is not None:
                found[id(handle)] = variable
    return found


def seed_generators(model):
    """The `keras.random.SeedGenerator`s the model's layers hold
    (`Dropout`'s), each once."""
    generators = []
    for layer in model._flatten_layers(include_self=True):  # pylint: disable=protected-access
        for generator in getattr(layer, "_seed_generators", ()):
            if isinstance(generator, keras.random.SeedGenerator) and not any(
                    generator.state is g.state for g in generators):
                generators.append(generator)
    return generators


def seed_generator_states(model):
    """The state variables of the model's `seed_generators`."""
    return [generator.state for generator in seed_generators(model)]


def _seed_states(model):
    """ids of the Keras variables that hold SeedGenerator states."""
    return {id(state) for state in seed_generator_states(model)}


def _walk(graph, operations=None, path="", controls=(), chain=()):
    """(op, the graph it is in, its path, the inputs deciding whether it
    runs, its call chain) for every op of `operations` (default: all of
    `graph`'s) and of the functions they call, each function once per call
    site: one function called from two places (a `tf.function` a layer calls
    twice) is walked twice, each time with its own callers, so that its
    inputs are followed to the values each call passes. The call chain is
    ((calling op, its graph), ...), outermost first: the last one called
    `graph`. The deciding inputs are (tensor, graph, its call chain)
    triples: the predicate of each `tf.cond` and the branch index of each
    `tf.switch_case` around the op, the condition's output of each loop."""
    functions = getattr(graph, "_functions", {})
    for op in graph.get_operations() if operations is None else operations:
        yield op, graph, path + op.name, controls, chain
        for key, nested in function_graphs(op, graph):
            if nested is None:
                continue
            inner = chain + ((op, graph),)
            yield from _walk(nested, path=f"{path}{op.name}/",
                             controls=controls + _deciding(op, key, functions, chain, inner),
                             chain=inner)


def _deciding(op, key, functions, chain, inner):
    """The inputs of control flow `op` (reached through `chain`) that decide
    whether its function `key` runs, and how many times, as (tensor, graph,
    call chain); `inner` is the chain of the functions `op` calls."""
    if key in ("then_branch", "else_branch", "branches"):
        return ((op.inputs[0], op.graph, chain),)  # the predicate, the branch index
    if key in ("body", "cond") and op.type in ("While", "StatelessWhile"):
        condition = getattr(functions.get(op.node_def.attr["cond"].func.name), "graph", None)
        if condition is None or not condition.outputs:
            return ((op.inputs[0], op.graph, chain),)  # unknown: refused unless constant
        return ((condition.outputs[0], condition, inner),)
    return ()


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


def function_graphs(op, graph):
    """[(attribute, function graph)] for each function `op` (in `graph`)
    calls: `f`, `then_branch`, `body`, ...; the graph is None for a
    function `graph` does not hold (registered elsewhere, eagerly)."""
    functions = getattr(graph, "_functions", {})
    return [(key, getattr(functions.get(name), "graph", None))
            for key, name in _called_functions(op, with_keys=True)]


def visit_key(tensor, graph, chain):
    """A tensor's identity on a walk through functions: the same tensor
    reached through other call sites is another value."""
    return tuple((id(g), o.name) for o, g in chain), id(graph), tensor.name


def _called_functions(op, with_keys=False):
    names = []
    for key in _CALL_ATTRS:
        if key not in op.node_def.attr:
            continue
        value = op.node_def.attr[key]
        if value.HasField("func"):
            names.append((key, value.func.name))
        names.extend((key, f.name) for f in value.list.func)
    return names if with_keys else [name for _, name in names]


def _resolve(handle, graph, variables, chain=()):
    """The known variable a resource tensor (in `graph`, reached through the
    call sites `chain`) is, through identities, captures and the inputs of
    the functions that pass it on; None if it may be anything else: every
    value it can take (a loop variable's first and later values) must be
    that one variable."""
    found, pending, seen = {}, [(handle, graph, chain)], set()
    while pending:
        current, where, calls = pending.pop()
        if where is None:  # an eager handle: the variable itself
            variable = variables.get(id(current))
            if variable is None:
                return None
            found[id(variable)] = variable
            continue
        key = visit_key(current, where, calls)
        if key in seen:
            continue  # a loop passing it on unchanged
        seen.add(key)
        if current.op.type in ("Identity", "IdentityN"):
            pending.append((current.op.inputs[current.value_index], where, calls))
            continue
        sources = _sources(current, where, calls)
        if not sources:
            return None
        pending.extend(sources)
    return next(iter(found.values())) if len(found) == 1 else None


def _sources(tensor, graph, chain):
    """Where a function's input comes from: [(tensor, graph, call chain)]
    in the graphs around it, through the call site that called this graph
    (`chain[-1]`): graph None for an eager tensor captured, fixed when
    traced; for a loop's variable, its first value and the body's next
    value. [] for the step's own inputs and anything else."""
    if tensor.op.type != "Placeholder":
        return []
    external = _external_capture(graph, tensor)
    if external is not None and getattr(external, "graph", None) is None:
        return [(external, None, ())]  # eager: the same for every caller
    inputs = list(getattr(graph, "inputs", ()))
    index = next((i for i, t in enumerate(inputs) if t is tensor), None)
    if not chain:  # the scanned graph itself: its captures, no call site to follow
        if external is None:
            return []
        return [(external, getattr(external, "graph", None), ())]
    if index is None:
        return []
    (op, outer), outer_chain = chain[-1], chain[:-1]
    if op.type in ("If", "StatelessIf", "Case", "StatelessCase"):
        return [(op.inputs[index + 1], outer, outer_chain)]  # after the predicate or index
    if op.type in ("While", "StatelessWhile"):
        body = getattr(getattr(outer, "_functions", {}).get(
            op.node_def.attr["body"].func.name), "graph", None)
        later = [(body.outputs[index], body, chain)] if body is not None else []
        return [(op.inputs[index], outer, outer_chain)] + later
    return [(op.inputs[index], outer, outer_chain)] if index < len(op.inputs) else []


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
    "ExpandDims", "Select", "SelectV2", "StatelessRandomGetKeyCounter", "Less",
    "LessEqual", "Greater", "GreaterEqual", "Equal", "NotEqual", "LogicalAnd",
    "LogicalOr", "LogicalNot",
}


def _decided_by(tensor, graph, chain, variable, variables):
    """Whether `tensor` (in `graph`, reached through the call sites `chain`)
    is computed only from reads of the seed state `variable`, constants and
    pure arithmetic, following function inputs to the values the call site
    passes: no input of the step, no other resource, no stateful op,
    nothing that could carry a record in."""
    pending, visited = [(tensor, graph, chain)], set()
    while pending:
        current, where, calls = pending.pop()
        if where is None:  # an eager tensor captured when traced: a constant
            if current.dtype == tf.resource:
                return False
            continue
        key = visit_key(current, where, calls)
        if key in visited:
            continue
        visited.add(key)
        op = current.op
        if op.type == "ReadVariableOp":
            if _resolve(op.inputs[0], where, variables, calls) is not variable:
                return False
            continue
        if op.type == "Placeholder":
            sources = _sources(current, where, calls)
            if not sources:
                return False  # an input of the step, or unknown
            pending.extend(sources)
            continue
        if op.type not in _PURE:
            return False
        pending.extend((t, where, calls) for t in op.inputs)
    return True


# Ops whose value is fixed by their input's static shape, when it is fully known.
_SHAPE_OPS = {"Shape", "ShapeN", "Rank", "Size"}


def reads_values(op, static_shapes_only=True):
    """Whether `op` may depend on an input's values (not only on constants
    and static shapes): a shape check such as `stateless_random_crop`'s holds
    or fails alike for every example; anything else is a data-dependent
    abort. Conservative: a function input (the example, the seed, a branch's
    argument) reached other than through a fully known shape counts. With
    `static_shapes_only=False`, reading any shape (a batch's length) is not
    reading values: TensorFlow's own shape checks (sparse cross-entropy's
    labels against its logits) pass.

    Example:

    >>> with tf.Graph().as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, [None, 2])
    ...     on_values = tf.raw_ops.Assert(condition=tf.reduce_all(x < 1.0), data=[x])
    ...     on_shape = tf.raw_ops.Assert(condition=tf.equal(tf.shape(x)[1], 2), data=[tf.shape(x)])
    >>> reads_values(on_values), reads_values(on_shape), reads_values(on_shape, False)
    (True, True, False)
    """
    pending, seen = list(op.inputs), set()
    while pending:
        tensor = pending.pop()
        producer = tensor.op
        if producer.name in seen or producer.type == "Const":
            continue
        seen.add(producer.name)
        if producer.type in _SHAPE_OPS and (not static_shapes_only or all(
                t.shape.is_fully_defined() for t in producer.inputs)):
            continue
        if producer.type == "Placeholder" or not producer.inputs and producer.type != "Const":
            return True
        pending.extend(producer.inputs)
    return False


def _owner(model, variable):
    """The innermost layer that holds `variable`."""
    owner = None
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        if any(v is variable for v in layer.variables):
            if owner is None or len(layer.variables) <= len(owner.variables):
                owner = layer
    return owner


_METRICS_PATH = "compiled_metrics.update_state/"


def _holder(model, path):
    """'Layer ...' or 'Metric ...' whose name scope holds the op at `path`
    (the innermost), else 'Model ...'."""
    named = {}
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        named.setdefault(layer.name, f"Layer '{layer.name}' ({type(layer).__name__})")
    for metric in _all_metrics(model):
        named.setdefault(metric.name, f"Metric '{metric.name}' ({type(metric).__name__})")
    for part in reversed(path.split("/")[:-1]):
        # A name scope entered again in one graph gets a suffix: 'dense_1'.
        for name in (part, re.sub(r"_\d+$", "", part)):
            if name in named:
                return named[name]
    if path.startswith(_METRICS_PATH):
        return f"A compiled metric of model '{model.name}'"
    return f"Model '{model.name}'"


def _metric_holding(model, variable):
    """The innermost metric that tracks `variable` (not a container of
    metrics, such as Keras's CompileMetrics), or None."""
    def holds(metric):
        return any(v is variable for v in metric.variables)

    for metric in _all_metrics(model):
        if holds(metric) and not any(holds(inner) for inner in _inner_metrics(metric)):
            return metric
    return None


def _all_metrics(model):
    pending, found = list(getattr(model, "metrics", ())), []
    while pending:
        metric = pending.pop(0)
        if any(metric is m for m in found):
            continue
        found.append(metric)
        pending.extend(_inner_metrics(metric))
    return found


def _inner_metrics(metric):
    """The metrics a metric holds (Keras's CompileMetrics holds the compiled ones)."""
    inner = []
    for attribute in ("metrics", "_metrics", "_flat_metrics", "_flat_weighted_metrics"):
        value = getattr(metric, attribute, None)
        if isinstance(value, (list, tuple)):
            inner.extend(m for m in value
                         if isinstance(m, keras.metrics.Metric) and m is not metric)
    return inner


def _received(op, path):
    return f"Received: op '{path or op.name}' ({op.type})"


def _python_message(model, op, path=""):
    return (
        f"{_holder(model, path)} runs Python inside its DP step (tf.py_function or "
        "tf.numpy_function): what it writes (a variable, a file, a global) cannot be "
        "seen or bounded there, and it could keep training records outside the "
        "clipping and the noise. Compute that part with TensorFlow operations, or "
        f"keep it out of the DP model. {_received(op, path)}"
    )


def _output_message(model, op, path=""):
    return (
        f"{_holder(model, path)} writes a tensor out of its DP step (tf.print, "
        "tf.io.write_file, a summary, a checkpoint save, a TFRecord file or a debug dump "
        "inside call() or a metric): what it writes is released as it is, outside the "
        "clipping and the noise. Log values outside the model (a callback reading the "
        "logs), or keep that layer out of the DP model (turn TensorFlow's debug dumping "
        f"off for a DP fit). {_received(op, path)}"
    )


def _abort_message(model, op, path=""):
    return (
        f"{_holder(model, path)} asserts on values in its DP step (tf.debugging.assert_*, "
        "tf.Assert, tf.debugging.check_numerics): a check that fails on one record stops "
        "training, and whether training stopped (and the error, which may print the "
        "value) tells that record, a release no noise covers. Drop the assertion, or "
        "make the computation valid for every input (clip or replace the value). "
        f"{_received(op, path)}"
    )


def _value_shape_message(model, op, source, path=""):
    return (
        f"{_holder(model, path)} asserts on a shape that the values decide in its DP step: "
        f"the shape of the output of op '{source.name}' ({source.type}) depends on the "
        "values of its input, not only on its shape (tf.boolean_mask, tf.where, tf.unique, "
        "tf.dynamic_partition keep as many rows as the data selects), so a check of it "
        "fails on some records only, and whether training stopped tells that record, a "
        "release no noise covers. Drop the assertion, or assert on shapes that the "
        "inputs' shapes fix (compute a count as a value: tf.reduce_sum(tf.cast(mask, "
        f"tf.int32)), and do not stop on it). {_received(op, path)}"
    )


def _table_message(model, op, path=""):
    return (
        f"{_holder(model, path)} reads a lookup table in its DP step that no Keras "
        "lookup layer of the model holds (a tf.lookup table built in a custom layer, or "
        "a lookup layer the model does not track): its keys, ids of training records if "
        "they were taken from the data, are saved and released with the model, and "
        "tfdp cannot check where they came from. Use a keras.layers.StringLookup, "
        "IntegerLookup or TextVectorization layer of the model instead, adapted "
        "privately (tfdp.preprocessing.adapt_privately) or declared public "
        f"(tfdp.preprocessing.declare_public). {_received(op, path)}"
    )


def _unknown_message(model, op, path=""):
    return (
        f"{_holder(model, path)} runs an op in its DP step that tfdp does not know to "
        "keep its effects inside the step (tfdp.models.step_ops lists those it allows): a "
        "stateful op (a queue, a stateful random generator, a dataset, a custom op) "
        "may keep or write training records where no clipping or noise reaches them, "
        "or draw by the batch's contents. Compute that part with TensorFlow's stateless "
        "ops (tf.random.stateless_*, keras.random with a SeedGenerator), or keep it out "
        f"of the DP model. {_received(op, path)}"
    )


def _metric_message(model, op, variable, path, writer):
    target = f"variable '{_path(variable)}'" if variable is not None else "a resource"
    if writer is not None:
        holder = f"Metric '{writer.name}' ({type(writer).__name__})"
    else:  # the metric holding the variable
        metric = _metric_holding(model, variable)
        holder = (f"Metric '{metric.name}' ({type(metric).__name__})" if metric is not None
                  else _holder(model, path))
    other = _metric_holding(model, variable) if variable is not None else None
    whose = (f", a variable of metric '{other.name}'" if other is not None and other is not writer
             else "")
    return (
        f"{holder} writes {target}{whose}, which is not its own, in update_state: a metric "
        "updated on the batch would put training records into the model, the optimizer "
        "or another metric outside the clipping and the noise. A metric may write only "
        "its own variables (self.add_variable) and those of metrics it keeps inside, not "
        "those of a metric compiled beside it. "
        f"{_received(op, path)}"
    )


def _message(model, op, variable, path="", scope=_PASS):
    why = (
        "during the DP step: after one step it holds a function of training "
        "records, outside the clipping and the noise, and it is saved and "
        "released with the model. Compute it without writing state in training "
        "(or freeze the layer so that its call() writes nothing), or keep that "
        "layer out of the DP model."
    )
    if variable is None:
        return (
            f"{_holder(model, path)} writes a resource that is not one of its "
            f"variables {why} {_received(op, path)}"
        )
    layer = _owner(model, variable)
    holder = f"Layer '{layer.name}' ({type(layer).__name__})" if layer else f"Model '{model.name}'"
    seed = ""
    if scope == _PASS and _is_seed(model, variable):
        seed = (" (a seed state may be advanced only from itself, in branches and loops "
                "that the data does not decide)")
    return (
        f"{holder} writes its variable '{variable.name}'{seed} {why} Received: a write "
        f"({op.type}) to variable '{_path(variable)}'"
    )


def _path(variable):
    """A Keras variable's path; a tf.Variable's name (the optimizer's
    `iterations` under some Keras versions has no path)."""
    return getattr(variable, "path", None) or variable.name


def _is_seed(model, variable):
    return id(variable) in _seed_states(model)
