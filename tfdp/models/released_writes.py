"""What the DP step writes into a saved variable depends on the batch only
through tfdp's noise.

The step's op scan (`tfdp.models.state_writes`) decides which ops may run
and which variables each part of the step may write. It cannot see Python:
a layer can keep a tensor of its batch in an attribute or a dict, and code
that runs later in the same step can read it. Keras runs a weight
constraint (`kernel_constraint=...`) and a learning-rate schedule inside
the optimizer's update, where writing the model's weights is the point; a
constraint that returns the kept tensor writes a record into the kernel,
and a schedule that reads it scales the update by the batch, both outside
the clipping and the noise (review 22, C2).

So the graph is followed, not the code that built it: for every write the
step makes to a variable that is saved or that steers later steps (the
model's weights and seeds, the optimizer's variables and those tfdp's
optimizers hold), the value written, and every input that decides whether
the write runs (a `tf.cond`'s predicate, a loop's condition), is traced
back through the step's ops, into and out of the functions it calls. It
may reach the step's inputs (the batch) only through a tensor tfdp
released: the noisy gradients handed to the optimizer (`release`), and
adaptive clipping's noisy count. It may not read a variable that holds
the batch's values without noise either: a compiled metric's, tfdp's
counters (logged outside the epsilon, `docs/mechanisms/guarantee.md`) or
a mechanism's unsaved per-record state (`record_state`, DPIS's table of
gradient bounds). Anything else is refused as the step is traced, before
it has ever run, naming the variable and the op that reads the batch.

Writes made in the per-example pass are left to the pass's own rules
(`state_writes.checked_per_example_pass`: only a seed state advanced from
itself), the writes to those variables (metrics, counters, record state)
to theirs.

Example: a constraint that copies a kept row into the kernel.

>>> import keras, numpy as np, tensorflow as tf, tfdp
>>> kept = {}
>>> @tfdp.per_example.declare_per_example
... class Keeps(keras.layers.Layer):
...     def call(self, x):
...         kept["x"] = x
...         return x
>>> class FromTheBatch(keras.constraints.Constraint):
...     def __call__(self, w):
...         return w * 0.0 + kept["x"][0][:, None]
>>> model = tfdp.DPSequential([keras.Input((4,)), Keeps(),
...                            keras.layers.Dense(3, kernel_constraint=FromTheBatch())])
>>> model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0,
...                                               l2_norm_clip=1.0),
...               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
>>> model.fit(np.ones((8, 4), "float32"), np.zeros(8), batch_size=4, verbose=0)
Traceback (most recent call last):
...
ValueError: Model 'dp_sequential...' writes variable '.../kernel' from the batch's records ...
"""

import weakref

import tensorflow as tf

from tfdp.models import state_writes as sw
from tfdp.models import step_ops


@tf.autograph.experimental.do_not_convert
def release(tensors):
    """Marks `tensors` (any nest; sparse ones by their components) as
    released by tfdp's noise in the graph being built: a write to a saved
    variable may depend on the batch through them. tfdp calls it on the
    noisy gradients it hands to the optimizer and on adaptive clipping's
    noisy count; eagerly it does nothing. It is tfdp's own declaration, for
    a mechanism's noisy output: model code that calls it on anything else
    turns the check off for that tensor.

    Example:

    >>> import tensorflow as tf
    >>> @tf.function(autograph=False)
    ... def step(noisy):
    ...     release(noisy)
    ...     return noisy
    >>> float(step(tf.constant(1.0)))
    1.0
    """
    if tf.executing_eagerly():
        return
    for tensor in tf.nest.flatten(tensors, expand_composites=True):
        if isinstance(tensor, tf.Tensor) and not isinstance(tensor, tf.__internal__.EagerTensor):
            _released(tensor.graph).add(tensor.name)


def _released(graph):
    return _RELEASED.setdefault(graph, set())


_RELEASED = weakref.WeakKeyDictionary()  # {graph: names of its released tensors}


def record_holding_variables(model):
    """The variables whose values hold the batch without noise: the
    compiled metrics', tfdp's counters and the optimizer's unsaved
    per-record state (`record_state()`, where it has one)."""
    # pylint: disable=protected-access
    optimizer = getattr(model, "optimizer", None)
    record_state = getattr(optimizer, "record_state", None)
    # A metric may track a weight (a metric of the kernel's norm): the
    # weight stays saved, its writes checked.
    saved = {**sw._model_variables(model),
             **sw._handles(getattr(optimizer, "variables", None) or ())}
    logged = sw._handles(sw._metric_variables(model) + sw._own_variables(model))
    return ([v for key, v in logged.items() if key not in saved]
            + list(record_state() if record_state is not None else ()))


def refuse_record_writes(model, graph, walked):
    """Raises a ValueError for the first write on `walked` (the step scan's
    walk of `graph`'s new ops and the functions they call, as
    `state_writes.checked_train_step` hands it on) to a variable the step
    saves whose value, or whose running, depends on the step's inputs
    other than through a released tensor. `DPModel.train_step` runs it.

    Example:

    >>> import keras, tensorflow as tf
    >>> from tfdp.models.state_writes import checked_train_step
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="dense")])
    >>> @tf.function(autograph=False)
    ... def step(x):
    ...     with checked_train_step(model, then=refuse_record_writes):
    ...         model.layers[0].bias.assign(x[0, :1])
    >>> step(tf.ones([2, 3]))
    Traceback (most recent call last):
    ...
    ValueError: Model 'sequential...' writes variable 'sequential.../dense/bias' from the batch's records ...
    """
    # pylint: disable=protected-access
    holding = sw._handles(record_holding_variables(model))
    known = {**sw._model_variables(model), **sw._handles(sw._optimizer_variables(model)),
             **holding}
    search = _RecordSearch(known, holding)
    for op, owner, path, controls, chain in walked:
        if not sw._writes_outside(op) or _in_pass(op, owner, chain):
            continue
        variable = sw._resolve(op.inputs[0], owner, known, chain)
        if variable is None or any(variable is v for v in holding.values()):
            continue  # an unknown resource is refused by the step's scan
        inputs = [(t, owner, chain) for t in op.inputs if t.dtype != tf.resource]
        found = search.reads_records(op, owner, chain)  # another resource it reads
        for tensor, where, calls in inputs + list(controls):
            found = found or search.reaches_records(tensor, where, calls)
        if found is not None:
            raise ValueError(_message(model, op, variable, path, found))


def _in_pass(op, owner, chain):
    """Whether `op` was made in the per-example pass: it, or a call that
    leads to it, is marked in its graph (`state_writes.pass_ops`)."""
    return any(made.name in sw.pass_ops(where) for made, where in (*chain, (op, owner)))


class _RecordSearch:
    """Follows tensors back through the step's ops and functions to the
    step's inputs or a record-holding variable, stopping at what tfdp
    released. Tensors found clean stay clean for later searches."""

    def __init__(self, known, holding):
        self.known, self.holding = known, holding
        self.clean = set()

    def reaches_records(self, tensor, graph, chain):
        """None if `tensor` (in `graph`, reached through `chain`) reads no
        record but through a released tensor; else a description of the
        source it reaches."""
        pending, seen = [(tensor, graph, chain)], set()
        while pending:
            current, where, calls = pending.pop()
            if where is None:  # an eager tensor captured when traced: a constant
                continue
            key = sw.visit_key(current, where, calls)
            if key in seen or key in self.clean:
                continue
            seen.add(key)
            if current.name in _RELEASED.get(where, ()):
                continue
            found = self._step(current, where, calls, pending)
            if found is not None:
                return found
        self.clean |= seen
        return None

    def _step(self, tensor, graph, chain, pending):
        """Pushes what `tensor` is computed from; returns a description if
        it is a source of records itself."""
        # pylint: disable=protected-access
        op = tensor.op
        if op.type == "Placeholder":
            sources = sw._sources(tensor, graph, chain)
            if not sources:
                return f"the step's input '{op.name}'"
            pending.extend(sources)
            return None
        found = self.reads_records(op, graph, chain)
        if found is not None:
            return found
        if op.type in step_ops.COLLECTIVES:  # the value reduced; the rest are keys
            if op.type.startswith("CollectiveBcastRecv"):
                return f"a value another replica sent, by op '{op.name}' ({op.type})"
            pending.append((op.inputs[0], graph, chain))
            return None
        bodies = _bodies(op, graph)
        if bodies is None:  # an op, or a call whose functions are not at hand
            pending.extend((t, graph, chain) for t in op.inputs if t.dtype != tf.resource)
            return None
        inner, index = chain + ((op, graph),), tensor.value_index
        for key, body in bodies:
            if key in ("then_branch", "else_branch", "branches"):
                pending.append((op.inputs[0], graph, chain))  # which branch ran
            if key == "cond":  # how many times the loop ran
                pending.append((body.outputs[0], body, inner))
                continue
            if key == "body":  # no iteration: the first value
                pending.append((op.inputs[index], graph, chain))
            if index < len(body.outputs):
                pending.append((body.outputs[index], body, inner))
        return None

    def reads_records(self, op, graph, chain):
        """A description of the record-holding or unknown resource `op`
        reads, or None. A lookup table's values are the model's (checked
        by provenance), a collective's resource orders the replicas'
        reductions (each replica's step checks what it sends). A
        TensorArray or a stack is a resource too: what was written into it
        is not followed, so a write that reads one is refused."""
        # pylint: disable=protected-access
        if op.type in sw._TABLE_READS or op.type in step_ops.COLLECTIVES:
            return None
        for handle in (t for t in op.inputs if t.dtype == tf.resource):
            variable = sw._resolve(handle, graph, self.known, chain)
            if variable is None:
                return f"a resource that is not a known variable, by op '{op.name}' ({op.type})"
            if any(variable is v for v in self.holding.values()):
                return (f"variable '{sw._path(variable)}', which holds the batch without "
                        f"noise, by op '{op.name}' ({op.type})")
        return None


def _bodies(op, graph):
    """[(attribute, function graph)] of the functions call or control flow
    `op` runs, or None for an op that calls none, or one whose functions
    are not all in `graph`."""
    bodies = sw.function_graphs(op, graph)
    if not bodies or op.type not in step_ops.CALLS:  # other layouts: all inputs decide
        return None
    return None if any(body is None for _, body in bodies) else bodies


def _message(model, op, variable, path, found):
    return (
        f"Model '{model.name}' writes variable '{sw._path(variable)}' from the batch's "  # pylint: disable=protected-access
        f"records outside tfdp's noise: the value written, or whether the write runs, "
        f"reads {found}. The model and its optimizer's state are saved and released "
        "under the epsilon, which covers the batch only through the noisy gradients. A "
        "weight constraint, a learning-rate schedule or other code run in the "
        "optimizer's update may read the weights, the optimizer's state and the step "
        "count, not a tensor a layer kept from the batch (in a Python attribute or "
        "dict), a training metric or tfdp's counters. Received: a write "
        f"({op.type}) at '{path}'"
    )
