"""Shapes that depend on values: an assertion on one tells a record.

A check of shapes alone (TensorFlow's own check of sparse labels against
logits) holds or fails alike for every batch of the same shape, so the DP
step's scan lets it pass. But the shape of some tensors is computed from
values: `tf.boolean_mask` and `tf.where` keep as many rows as the mask
holds, `tf.unique` as many as there are distinct values, and
`tf.dynamic_partition`, `tf.image.non_max_suppression`, `tf.sparse` ops and
any op computed from them do the same. `tf.debugging.assert_less(tf.shape(
tf.boolean_mask(x, x > c))[0], k)` stops the step exactly when a record
above `c` is drawn: one bit a step about that record, outside the noise.

Which shapes those are is not a hand list: TensorFlow's own shape
functions decide. The graph the checked tensors come from is rebuilt with
every input's shape fully known (the step's input shapes are fixed; a
function's input is followed to what its caller passes), and TensorFlow
infers every shape again, evaluating shape arithmetic (`tf.shape`,
`tf.reshape(x, [tf.shape(x)[0], -1])`, `tf.zeros(n)` of a computed `n`) as
constants. A shape still unknown then is one that the values decide: the
op named is one whose output shape stays unknown even when its inputs'
values are known (`Where`, `Unique`, `DynamicPartition`,
`NonMaxSuppression`): it selects rows by values. An op whose shape the
values compute (`tf.range(n)`, a slice, a reshape) is not refused: the
chunks of a physical batch are sized by the loop counter and the number of
rows drawn, which the scan cannot tell from a value of the data, so a size
computed from a record's value (`tf.range(tf.reduce_max(x))`) passes too
(docs/guides/your-model.md). An op that checks a shape when it runs
(`tf.ensure_shape`, `tf.reshape`, `tf.broadcast_to`) stops the step like an
assertion: `rejected_count` asks the shape functions again with the
selected rows given a few counts (0 to 3), and names the selecting op if
one count is rejected. A step's graph holds hundreds of reshapes of the
batch: a scan infers each graph's shapes once, a check whose input's
shape that inference fixes (and no caller's values decide) is not asked
further, and the others of a graph are asked together for each count,
each alone only if one fails.

Example:

>>> import tensorflow as tf
>>> from tfdp.models.state_writes import _sources
>>> @tf.function
... def step(x):
...     return tf.shape(tf.boolean_mask(x, x > 1.0))[0], tf.shape(tf.reshape(x, [-1]))[0]
>>> graph = step.get_concrete_function(tf.TensorSpec([None, 4])).graph
>>> on_mask, on_reshape = (shapes_read(t.op) for t in graph.outputs)
>>> value_shaped(on_mask, graph, (), _sources).type
'Where'
>>> value_shaped(on_reshape, graph, (), _sources) is None
True
"""

import tensorflow as tf
from tensorflow.python.framework import graph_util_impl

# An unknown dimension of an input is given this size to infer shapes
# again: many divisors, so that shape arithmetic (a reshape to [-1, 3]) holds.
_KNOWN_SIZE = 720
# Tensors whose shape says nothing of what they hold.
_HANDLES = (tf.resource, tf.variant)
# Ops that compare a shape with another when they run and fail on a
# mismatch: like an assert, they stop the step if that shape is the values'.
SHAPE_CHECKS = {"EnsureShape", "Reshape", "BroadcastTo"}
# Sizes a dimension the values decide is given to ask the shape functions
# whether a check holds for every size (a reshape to [-1, 3] fails for 1).
_COUNTS = (0, 1, 2, 3)


def shapes_read(op):
    """The tensors whose shapes `op`'s inputs are computed from through
    `tf.shape`, `tf.size` or `tf.rank` (ops `Shape`, `ShapeN`, `Size`,
    `Rank`), where those shapes are not static."""
    pending, seen, read = list(op.inputs), set(), []
    while pending:
        tensor = pending.pop()
        producer = tensor.op
        if producer.name in seen:
            continue
        seen.add(producer.name)
        if producer.type in ("Shape", "ShapeN", "Size", "Rank"):
            read.extend(t for t in producer.inputs if not t.shape.is_fully_defined())
            continue
        pending.extend(producer.inputs)
    return read


def value_shaped(tensors, graph, chain, sources, definitions=None, _seen=None):
    """The op that makes the shape of one of `tensors` depend on values, or
    None if their shapes follow from the shapes of the step's inputs.

    Args:
        tensors: tensors of `graph`.
        graph: the graph (a function's) holding them.
        chain: the call sites that reached `graph`, outermost first, as
            `tfdp.models.state_writes` walks the step.
        sources: callable(tensor, graph, chain) -> [(tensor, graph, chain)]:
            where a function's input comes from in its callers ([] for the
            step's own inputs; graph None for an eager tensor).
        definitions: a dict one scan shares: each graph is serialized, and
            its shapes inferred again, once (a step's graph is large).

    Returns:
        A `tf.Operation` (of `graph`, or of a graph that called it), or None.
    """
    seen = set() if _seen is None else _seen
    definitions = {} if definitions is None else definitions
    tensors = _open(tensors)
    if not tensors:
        return None
    key = (id(graph), _calls(chain), tuple(sorted(t.name for t in tensors)))
    if key in seen:
        return None  # a loop's variable met again: its other sources are checked
    seen.add(key)
    inferred = _inferred(graph, definitions)
    if inferred is None:  # the whole graph's shapes cannot be inferred: its part
        return _value_shaped_part(tensors, graph, chain, sources, definitions, seen)
    ancestors = _ancestors(tensors, graph, definitions)
    for op in ancestors:
        if op.type == "Placeholder":
            found = _decided_input(op, graph, chain, sources, definitions, seen)
            if found is not None:
                return found
    if not _unknown(inferred.get_tensor_by_name(t.name) for t in tensors):
        return None
    for op in ancestors:
        copy = inferred.get_operation_by_name(op.name)
        if _unknown(copy.outputs) and _selects(copy, definitions):
            return op
    return None


def _value_shaped_part(tensors, graph, chain, sources, definitions, seen):
    """`value_shaped` inferring again only the part of `graph` that
    computes `tensors`: for a graph whose other parts fail with the sizes
    given (an `EnsureShape` of a fixed batch size)."""
    definition = graph_util_impl.extract_sub_graph(
        _definition(graph, definitions), sorted({t.op.name for t in tensors}))
    for node in definition.node:
        _read_as_input(node, graph)
        if node.op != "Placeholder":
            continue
        found = _decided_input(graph.get_operation_by_name(node.name), graph, chain, sources,
                               definitions, seen)
        if found is not None:
            return found
        _size_unknown(node, _KNOWN_SIZE)
    with tf.Graph().as_default() as inferred:
        try:
            tf.graph_util.import_graph_def(definition, name="")
        except (ValueError, tf.errors.OpError):
            return tensors[0].op  # shapes that cannot be inferred: not shown to be fixed
    if not _unknown(inferred.get_tensor_by_name(t.name) for t in tensors):
        return None
    for op in inferred.get_operations():
        if _unknown(op.outputs) and _selects(op, definitions):
            return graph.get_operation_by_name(op.name)
    return None


def _decided_input(placeholder, graph, chain, sources, definitions, seen):
    """The op that decides by values the shape of what a caller passes to
    the function input `placeholder`, or None."""
    for outer, where, calls in sources(placeholder.outputs[0], graph, chain):
        if where is not None:
            found = value_shaped([outer], where, calls, sources, definitions, seen)
            if found is not None:
                return found
    return None


def _open(tensors):
    """The tensors whose traced shapes leave a dimension open."""
    return [t for t in tensors if not t.shape.is_fully_defined() and t.dtype not in _HANDLES]


def _calls(chain):
    return tuple((id(g), op.name) for op, g in chain)


def _definition(graph, definitions):
    if id(graph) not in definitions:  # a step's graph is large: serialized once
        definitions[id(graph)] = graph.as_graph_def()
    return definitions[id(graph)]


def _inferred(graph, definitions):
    """A copy of `graph` whose shapes TensorFlow inferred again with every
    unknown dimension of an input `_KNOWN_SIZE` (a variable's read its
    variable's shape), once a scan; None if some op rejects those sizes."""
    key = ("inferred", id(graph))
    if key not in definitions:
        with tf.Graph().as_default() as inferred:
            try:
                tf.graph_util.import_graph_def(
                    _sized(_readable(graph, definitions), (), _KNOWN_SIZE), name="")
            except (ValueError, tf.errors.OpError):
                inferred = None
        definitions[key] = inferred
    return definitions[key]


def _readable(graph, definitions):
    """`graph`'s GraphDef with each read of a variable an input of its
    shape (`_read_as_input`), once a scan."""
    key = ("readable", id(graph))
    if key not in definitions:
        definition = type(_definition(graph, definitions))()
        definition.CopyFrom(_definition(graph, definitions))
        for node in definition.node:
            _read_as_input(node, graph)
        definitions[key] = definition
    return definitions[key]


def _ancestors(tensors, graph, definitions):
    """The ops of `graph` that `tensors` are computed from (data and control
    inputs), themselves included, in the graph's order."""
    pending, found = [t.op for t in tensors], {}
    while pending:
        op = pending.pop()
        if op.name in found:
            continue
        found[op.name] = op
        pending.extend(t.op for t in op.inputs)
        pending.extend(op.control_inputs)
    order = _order(graph, definitions)
    return sorted(found.values(), key=lambda op: order[op.name])


def _order(graph, definitions):
    key = ("order", id(graph))
    if key not in definitions:
        definitions[key] = {op.name: i for i, op in enumerate(graph.get_operations())}
    return definitions[key]


def _size_unknown(node, size):
    for dim in node.attr["shape"].shape.dim:
        if dim.size < 0:
            dim.size = size


def _selects(op, definitions):
    """`_selects_rows(op)`, asked once a scan for each kind of op (its type,
    attributes and input shapes): a loop's body repeats the same ops."""
    key = ("selects", op.type, tuple(sorted(
        (name, value.SerializeToString()) for name, value in op.node_def.attr.items())),
        tuple((str(t.shape), t.dtype.name) for t in op.inputs))
    if key not in definitions:
        definitions[key] = _selects_rows(op)
    return definitions[key]


def _selects_rows(op):
    """Whether `op`'s output shape stays unknown even when all its inputs'
    values are known (constants of their shapes): `Where`, `Unique`,
    `DynamicPartition`, `NonMaxSuppression` select rows by the values; an op
    whose shape the values compute (`Range`, `Reshape`, `Fill`, a slice: a
    chunk of a physical batch) is not one of them."""
    if any(t.dtype in _HANDLES for t in op.inputs):
        return False  # a list's or a handle's shape says nothing of its elements
    with tf.Graph().as_default() as probe:
        constants = [tf.zeros([d if d is not None else 2 for d in t.shape.as_list()], t.dtype)
                     if t.shape.rank is not None else tf.zeros([], t.dtype) for t in op.inputs]
    definition = probe.as_graph_def()
    node = definition.node.add()
    node.CopyFrom(op.node_def)
    node.name = "probed"
    del node.input[:]
    node.input.extend(c.op.name for c in constants)
    node.ClearField("device")
    with tf.Graph().as_default() as probed:
        try:
            tf.graph_util.import_graph_def(definition, name="")
        except (ValueError, tf.errors.OpError):
            return False  # the shape function read the values: they fix the shape
        return _unknown(probed.get_operation_by_name("probed").outputs)


def _read_as_input(node, graph):
    """Makes a read of a resource (a variable's value) an input of the shape
    it has in `graph`: a GraphDef drops what a handle knows of its
    variable's shape, and a variable's shape is fixed."""
    op = graph.get_operation_by_name(node.name)
    if (len(op.outputs) != 1 or not op.outputs[0].shape.is_fully_defined()
            or not any(t.dtype == tf.resource for t in op.inputs)):
        return
    output = op.outputs[0]
    node.op = "Placeholder"
    del node.input[:]
    node.attr.clear()
    node.attr["dtype"].type = output.dtype.as_datatype_enum
    node.attr["shape"].shape.CopyFrom(output.shape.as_proto())


def _unknown(tensors):
    return any(not t.shape.is_fully_defined() for t in tensors if t.dtype not in _HANDLES)


def rejected_count(op, graph, chain, sources, definitions=None):
    """The op that decides by values a shape `op` checks when it runs
    (`EnsureShape`, `Reshape`, `BroadcastTo`) and rejects for some number of
    selected rows, or None: the shape is fixed by the step's input shapes, or
    the check holds for every count (`tf.reshape(tf.boolean_mask(x, m), [-1])`).

    Args: as `value_shaped`, with `op` an op of `graph`.

    Example:

    >>> from tfdp.models.state_writes import _sources
    >>> @tf.function
    ... def step(x):
    ...     rows = tf.boolean_mask(x, x[:, 0] > 1.0)
    ...     return tf.ensure_shape(rows, [0, 4]), tf.reshape(rows, [-1, 2])
    >>> graph = step.get_concrete_function(tf.TensorSpec([None, 4])).graph
    >>> fixed, flat = (t.op for t in graph.outputs[:2])
    >>> while fixed.type != "EnsureShape": fixed = fixed.inputs[0].op
    >>> while flat.type != "Reshape": flat = flat.inputs[0].op
    >>> rejected_count(fixed, graph, (), _sources).type
    'Where'
    >>> rejected_count(flat, graph, (), _sources) is None
    True
    """
    definitions = {} if definitions is None else definitions
    if not _may_be_value_shaped(op.inputs, graph, chain, sources, definitions):
        return None
    source = value_shaped(list(op.inputs), graph, chain, sources, definitions)
    if source is None or _every_count_holds(graph, chain, sources, definitions):
        return None
    base = graph_util_impl.extract_sub_graph(_definition(graph, definitions), [op.name])
    decided = set()
    for node in base.node:
        _read_as_input(node, graph)
        if node.op == "Placeholder" and _decided_input(
                graph.get_operation_by_name(node.name), graph, chain, sources, definitions,
                set()) is not None:
            decided.add(node.name)
    with tf.Graph().as_default() as inferred:
        try:
            tf.graph_util.import_graph_def(_sized(base, decided, _KNOWN_SIZE), name="")
        except (ValueError, tf.errors.OpError):
            return source  # rejected for the size given to every unknown dimension
    selecting = [o for o in inferred.get_operations()
                 if _unknown(o.outputs) and _selects(o, definitions)]
    for count in _COUNTS:
        probe = _sized(base, decided, count, selecting)
        with tf.Graph().as_default():
            try:
                tf.graph_util.import_graph_def(probe, name="")
            except (ValueError, tf.errors.OpError):
                return source
    return None


def _may_be_value_shaped(tensors, graph, chain, sources, definitions):
    """Whether the shape of one of `tensors` may be decided by values, as
    the graph's shapes inferred once tell: one still unknown there, or one
    computed from a function input whose caller passes such a shape. A
    step's graph holds many shape checks (reshapes of the batch); this
    spares them `value_shaped`'s search. Never False where `value_shaped`
    finds an op."""
    tensors = _open(tensors)
    if not tensors:
        return False
    inferred = _inferred(graph, definitions)
    if inferred is None or _unknown(inferred.get_tensor_by_name(t.name) for t in tensors):
        return True
    tainted = _from_decided_inputs(graph, chain, sources, definitions)
    return any(t.op.name in tainted for t in tensors)


def _from_decided_inputs(graph, chain, sources, definitions):
    """The names of the ops of `graph` (called through `chain`) computed
    from a function input whose shape a caller's values decide, once a
    scan for each call site."""
    key = ("tainted", id(graph), _calls(chain))
    if key not in definitions:
        pending = [graph.get_operation_by_name(name)
                   for name in _decided_inputs(graph, chain, sources, definitions)]
        tainted = set()
        while pending:
            op = pending.pop()
            if op.name in tainted:
                continue
            tainted.add(op.name)
            pending.extend(c for t in op.outputs for c in t.consumers())
            pending.extend(op._control_outputs)  # pylint: disable=protected-access
        definitions[key] = tainted
    return definitions[key]


def _decided_inputs(graph, chain, sources, definitions):
    """The names of `graph`'s function inputs whose shape a caller's values
    decide (called through `chain`), once a scan for each call site."""
    key = ("decided", id(graph), _calls(chain))
    if key not in definitions:
        definitions[key] = {op.name for op in graph.get_operations() if op.type == "Placeholder"
                            and _decided_input(op, graph, chain, sources, definitions,
                                               set()) is not None}
    return definitions[key]


def _every_count_holds(graph, chain, sources, definitions):
    """Whether every shape check of `graph` (called through `chain`) holds
    when each value-decided size is any of `_COUNTS`: the whole graph asked
    once a scan for each call site. False leaves each check to be asked
    alone, to name the one that fails."""
    key = ("holds", id(graph), _calls(chain))
    if key not in definitions:
        inferred = _inferred(graph, definitions)
        holds = inferred is not None
        if holds:
            decided = _decided_inputs(graph, chain, sources, definitions)
            selecting = [o for o in inferred.get_operations()
                         if _unknown(o.outputs) and _selects(o, definitions)]
            for count in _COUNTS:
                with tf.Graph().as_default():
                    try:
                        tf.graph_util.import_graph_def(
                            _sized(_readable(graph, definitions), decided, count, selecting),
                            name="")
                    except (ValueError, tf.errors.OpError):
                        holds = False
                        break
        definitions[key] = holds
    return definitions[key]


def _sized(definition, decided, count, selecting=()):
    """A copy of `definition` where unknown dimensions of placeholders are
    `_KNOWN_SIZE`, but `count` for those in `decided`, and each op of
    `selecting` is replaced by placeholders of its output shapes, their
    unknown dimensions `count` (an IdentityN of them, under its name)."""
    sized = type(definition)()
    sized.CopyFrom(definition)
    replaced = {o.name: o for o in selecting}
    for node in list(sized.node):
        if node.op == "Placeholder":
            for dim in node.attr["shape"].shape.dim:
                if dim.size < 0:
                    dim.size = count if node.name in decided else _KNOWN_SIZE
        if node.name not in replaced:
            continue
        names = []
        for index, output in enumerate(replaced[node.name].outputs):
            held = sized.node.add()
            held.name = f"{node.name}/count_{index}"
            held.op = "Placeholder"
            held.attr["dtype"].type = output.dtype.as_datatype_enum
            held.attr["shape"].shape.CopyFrom(tf.TensorShape(
                [count if d is None else d for d in output.shape.as_list()]).as_proto()
                if output.shape.rank is not None else output.shape.as_proto())
            names.append(held.name)
        node.op = "IdentityN"
        del node.input[:]
        node.input.extend(names)
        node.attr.clear()
        node.attr["T"].list.type.extend(o.dtype.as_datatype_enum for o in replaced[node.name].outputs)
    return sized
