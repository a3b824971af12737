"""A crafted record's field and the layer that fails on it, for the tests
that check no error text quotes a record (tests/models/test_step_errors.py,
tests/models/test_input_checks_withhold_values.py)."""

import keras
import tensorflow as tf

import tfdp

CANARY = "SECRET-ID-4711"


class ToNumber(keras.layers.Layer):
    """Parses text as numbers: `tf.strings.to_number` fails on CANARY and
    its message quotes it."""

    def call(self, words):
        return tf.strings.to_number(words, tf.float32)

    def compute_output_shape(self, shape):
        return shape


def dp_parsing_model():
    """A compiled DP model whose step parses its text input with ToNumber."""
    keras.utils.set_random_seed(0)
    words = keras.Input((1,), dtype="string")
    lookup = keras.layers.StringLookup(vocabulary=["1.5"], output_mode="one_hot", name="lookup")
    tfdp.preprocessing.declare_public(lookup, source="a constant vocabulary")
    features = keras.layers.concatenate([lookup(words), ToNumber(name="to_number")(words)])
    model = tfdp.DPModel(words, keras.layers.Dense(3)(features))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
