"""Which shapes the values decide: TensorFlow's shape functions tell, not a list."""

import pytest
import tensorflow as tf

from tfdp.models.state_writes import _sources, _walk
from tfdp.models.value_shapes import rejected_count, shapes_read, value_shaped

VARIABLE = tf.Variable(tf.ones([3, 4]))

DECIDED_BY_VALUES = {
    "Where": lambda x: tf.where(x > 1.0),
    "Unique": lambda x: tf.unique(tf.reshape(x, [-1]))[0],
    "DynamicPartition": lambda x: tf.dynamic_partition(x, tf.cast(x[:, 0] > 1.0, tf.int32), 2)[0],
    "NonMaxSuppressionV3": lambda x: tf.image.non_max_suppression(x, x[:, 0], 3),
}
FIXED_BY_SHAPES = {
    "reshape": lambda x: tf.reshape(x, [tf.shape(x)[0], -1, 2]),
    "zeros of a computed size": lambda x: tf.zeros(tf.shape(x)[0] * 2 + tf.size(x)),
    "tile": lambda x: tf.tile(x, [2, 1]),
    "a variable's value": lambda x: tf.matmul(x[:, :3], VARIABLE) + tf.gather(VARIABLE, [0, 1]),
    "a dropout mask": lambda x: tf.random.stateless_uniform(tf.shape(x), seed=[1, 2]) * x,
    # Computed, not selected, by values (a chunk's rows): passes, as documented.
    "a computed size": lambda x: tf.range(tf.cast(tf.reduce_max(x), tf.int32)),
}


def checked(make):
    """The op that decides the shape `make(x)` has, for x of shape [None, 4]."""
    @tf.function
    def step(x):
        return tf.shape(make(x))[0]

    graph = step.get_concrete_function(tf.TensorSpec([None, 4])).graph
    return value_shaped(shapes_read(graph.outputs[0].op), graph, (), _sources)


@pytest.mark.parametrize("op", list(DECIDED_BY_VALUES))
def test_a_shape_the_values_decide_names_its_op(op):
    assert checked(DECIDED_BY_VALUES[op]).type == op


@pytest.mark.parametrize("name", list(FIXED_BY_SHAPES))
def test_a_shape_the_input_shapes_fix_passes(name):
    assert checked(FIXED_BY_SHAPES[name]) is None


# A check of a shape when the op runs (EnsureShape, Reshape, BroadcastTo).
MASKED = lambda x: tf.boolean_mask(x, x[:, 0] > 1.0)  # noqa: E731  [rows, 4], rows by values
REJECTS_A_COUNT = {
    "ensure_shape": lambda x: tf.ensure_shape(MASKED(x), [0, 4]),
    "reshape to a fixed size": lambda x: tf.reshape(MASKED(x), [4]),
    "reshape to rows of 3": lambda x: tf.reshape(MASKED(x), [-1, 3]),  # 4 * rows: fails for 1
    "broadcast_to": lambda x: tf.broadcast_to(tf.reshape(MASKED(x), [-1, 1, 4]), [2, 2, 4]),
    # One open dimension each side, 4 values a row both: fails unless every row is kept.
    "reshape to the input's shape": lambda x: tf.reshape(MASKED(x), tf.shape(x)),
    # Another check rejects the size given to the batch: that part is not inferred.
    "ensure_shape beside a fixed batch size": lambda x: (
        tf.ensure_shape(x, [8, 4]), tf.ensure_shape(MASKED(x), [0, 4]))[1],
}
HOLDS_FOR_EVERY_COUNT = {
    "ensure_shape of the columns": lambda x: tf.ensure_shape(MASKED(x), [None, 4]),
    "reshape to rows of 2": lambda x: tf.reshape(MASKED(x), [-1, 2]),
    "reshape by its own shape": lambda x: tf.reshape(MASKED(x), [tf.shape(MASKED(x))[0], 2, 2]),
    "ensure_shape of the batch": lambda x: tf.ensure_shape(tf.reshape(x, [-1, 2, 2]), [None, 2, 2]),
    "ensure_shape of a fixed batch size": lambda x: tf.ensure_shape(x, [8, 4]),
}


def checked_at_run_time(make):
    """The op that decides a shape that the last shape check of `make(x)` rejects."""
    @tf.function
    def step(x):
        return make(x)

    graph = step.get_concrete_function(tf.TensorSpec([None, 4])).graph
    check = [op for op in graph.get_operations()
             if op.type in ("EnsureShape", "Reshape", "BroadcastTo")][-1]
    return rejected_count(check, graph, (), _sources)


@pytest.mark.parametrize("name", list(REJECTS_A_COUNT))
def test_a_run_time_shape_check_that_rejects_a_count_names_its_op(name):
    assert checked_at_run_time(REJECTS_A_COUNT[name]).type == "Where"


@pytest.mark.parametrize("name", list(HOLDS_FOR_EVERY_COUNT))
def test_a_run_time_shape_check_that_holds_for_every_count_passes(name):
    assert checked_at_run_time(HOLDS_FOR_EVERY_COUNT[name]) is None


@tf.function
def _no_rows(rows):
    return tf.ensure_shape(rows, [0, 4])


@pytest.mark.parametrize("selected, expected", [(True, "Where"), (False, None)])
def test_a_check_in_a_function_follows_what_its_caller_passes(selected, expected):
    """The check is in a called function's graph: its input is the caller's
    selected rows (refused) or the caller's batch (passes)."""
    @tf.function
    def step(x):
        return _no_rows(MASKED(x) if selected else x)

    graph = step.get_concrete_function(tf.TensorSpec([None, 4])).graph
    found = [rejected_count(op, owner, chain, _sources)
             for op, owner, _, _, chain in _walk(graph) if op.type == "EnsureShape"]
    assert len(found) == 1
    assert getattr(found[0], "type", None) == expected
