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
(docs/guides/your-model.md).

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
        definitions: {id of a graph: its GraphDef}, filled as graphs are
            serialized: one dict for one scan serializes each graph once.

    Returns:
        A `tf.Operation` (of `graph`, or of a graph that called it), or None.
    """
    seen = set() if _seen is None else _seen
    definitions = {} if definitions is None else definitions
    tensors = [t for t in tensors if not t.shape.is_fully_defined() and t.dtype not in _HANDLES]
    if not tensors:
        return None
    key = (id(graph), tuple(id(g) for _, g in chain), tuple(sorted(t.name for t in tensors)))
    if key in seen:
        return None  # a loop's variable met again: its other sources are checked
    seen.add(key)
    if id(graph) not in definitions:  # a step's graph is large: serialized once
        definitions[id(graph)] = graph.as_graph_def()
    definition = graph_util_impl.extract_sub_graph(
        definitions[id(graph)], sorted({t.op.name for t in tensors}))
    for node in definition.node:
        _read_as_input(node, graph)
        if node.op != "Placeholder":
            continue
        placeholder = graph.get_operation_by_name(node.name).outputs[0]
        for outer, where, calls in sources(placeholder, graph, chain):
            if where is not None:
                found = value_shaped([outer], where, calls, sources, definitions, seen)
                if found is not None:
                    return found
        for dim in node.attr["shape"].shape.dim:
            if dim.size < 0:
                dim.size = _KNOWN_SIZE
    with tf.Graph().as_default() as inferred:
        try:
            tf.graph_util.import_graph_def(definition, name="")
        except (ValueError, tf.errors.OpError):
            return tensors[0].op  # shapes that cannot be inferred: not shown to be fixed
    if not _unknown(inferred.get_tensor_by_name(t.name) for t in tensors):
        return None
    for op in inferred.get_operations():
        if _unknown(op.outputs) and _selects_rows(op):
            return graph.get_operation_by_name(op.name)
    return None


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
