"""A crafted record's field and the layer that fails on it, for the tests
that check no error text quotes a record (tests/models/test_step_errors.py,
tests/models/test_input_checks_withhold_values.py)."""

import keras
import tensorflow as tf

CANARY = "SECRET-ID-4711"


class ToNumber(keras.layers.Layer):
    """Parses text as numbers: `tf.strings.to_number` fails on CANARY and
    its message quotes it."""

    def call(self, words):
        return tf.strings.to_number(words, tf.float32)

    def compute_output_shape(self, shape):
        return shape
