"""Reads the private step counter between steps, cheaply.

The ledger reads the step counter several times a step (`LedgerGuard`'s
rollback check before and after each step, `PrivacyBudget`'s limit and
epsilon). Keras's `Variable.numpy()` goes through several layers of Keras's
and TensorFlow's Python on each read; one ReadVariableOp on the variable's
handle returns the same value with less of it.

Example:

>>> import keras
>>> read_counter(keras.Variable(3, dtype="int64", trainable=False))
3
"""

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops


def read_counter(variable):
    """The integer value of `variable` (a Keras or TensorFlow variable).

    A plain resource variable read eagerly takes one ReadVariableOp; any
    other (a distributed or mirrored one, a read inside a graph) takes the
    variable's own `numpy()`.
    """
    # A Keras variable holds its TensorFlow variable as `value` (a property);
    # a TensorFlow variable's `value` is a method.
    value = variable if isinstance(variable, tf.Variable) else getattr(variable, "value", None)
    if type(value) is resource_variable_ops.ResourceVariable and tf.executing_eagerly():
        return int(tf.raw_ops.ReadVariableOp(resource=value.handle, dtype=value.dtype))
    return int(variable.numpy())
