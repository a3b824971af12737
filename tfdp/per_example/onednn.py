"""A guard against a oneDNN crash on the whole-model vectorized path.

TensorFlow 2.21's CPU build runs matmuls through oneDNN (unless
`TF_ENABLE_ONEDNN_OPTS=0` is set before TensorFlow is imported). Its batched
matmul corrupts memory when the left operand has a unit batch axis after the
first and the right operand broadcasts against it: `tf.matmul` of a
[4, 1, 8, 16] tensor with a [16, 16] matrix kills the process (segmentation
fault or malloc abort) in a plain `tf.function`, without tfdp. The
whole-model vectorized path makes exactly that shape: each example runs as a
batch of one ([1, S, H]), and `tf.vectorized_map` stacks the examples in
front ([B, 1, S, H]) of every Dense / EinsumDense / attention matmul on a
sequence. So transformer models (KerasHub's BERT and GPT-2 among them) on
that path crashed inside `fit`.

`vectorized_map` (used by both vectorized paths: the whole model's and
the per-layer fallback's) reads the traced operations of the vectorized step and
raises a `ValueError` naming the first such matmul, before any step runs.

Example:

>>> import tensorflow as tf
>>> f = tf.function(lambda x: tf.matmul(x, tf.ones([3, 2])))
>>> graph = f.get_concrete_function(tf.TensorSpec([None, 1, 5, 3])).graph
>>> [op.type for op in hazardous_matmuls(graph.get_operations())]
['BatchMatMulV2']
"""

import tensorflow as tf
from tensorflow.python.util import _pywrap_util_port

_BATCH_MATMULS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def onednn_enabled():
    """True when TensorFlow runs its CPU kernels through oneDNN."""
    return bool(_pywrap_util_port.IsMklEnabled())


def _batch_dims(tensor):
    shape = tensor.shape
    if shape.rank is None or shape.rank < 2:
        return None
    return shape.as_list()[:-2]


def _is_hazard(op):
    left, right = (_batch_dims(t) for t in op.inputs[:2])
    if left is None or right is None or left == right:
        return False
    return any(d == 1 for d in left[1:]) or any(d == 1 for d in right[1:])


def hazardous_matmuls(operations):
    """The batched matmuls among `operations` with the crashing shapes."""
    return [op for op in operations if op.type in _BATCH_MATMULS and _is_hazard(op)]


def vectorized_map(fn, elems, name):
    """`tf.vectorized_map(fn, elems)`, refused (ValueError naming the model
    or layer `name`) before it runs if oneDNN would crash on its graph."""
    if tf.executing_eagerly():
        concrete = tf.function(lambda: tf.vectorized_map(fn, elems)).get_concrete_function()
        check_vectorized_ops(concrete.graph.get_operations(), name)
        return concrete()
    graph = tf.compat.v1.get_default_graph()
    known = len(graph.get_operations())
    result = tf.vectorized_map(fn, elems)
    check_vectorized_ops(graph.get_operations()[known:], name)
    return result


def check_vectorized_ops(operations, name):
    """Raises ValueError if oneDNN would crash on these traced operations."""
    if not onednn_enabled():
        return
    hazards = hazardous_matmuls(operations)
    if not hazards:
        return
    op = hazards[0]
    shapes = " x ".join(str(t.shape) for t in op.inputs[:2])
    raise ValueError(
        f"{name} takes a vectorized per-example path "
        f"(tf.vectorized_map), which here runs a batched matmul of shapes {shapes} "
        f"('{op.name}'); TensorFlow's oneDNN CPU kernel crashes the process on "
        "these shapes. Make the model take the batched path (every layer known to "
        "keep examples independent, and a rule for each layer with weights: see "
        "model.per_example_path and "
        "tfdp.per_example.declare_per_example), or set the environment variable "
        "TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow is imported. Received: "
        f"onednn_enabled=True, per_example_path='vectorized'"
    )
