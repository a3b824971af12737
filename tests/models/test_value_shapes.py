"""Which shapes the values decide: TensorFlow's shape functions tell, not a list."""

import pytest
import tensorflow as tf

from tfdp.models.state_writes import _sources
from tfdp.models.value_shapes import shapes_read, value_shaped

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
