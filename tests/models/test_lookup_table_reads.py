"""A lookup table read in the DP step must be a Keras lookup layer's of the
model, whose vocabulary fit checks (adapted privately or declared public):
a custom layer's `tf.lookup` table keyed by training records' ids was read
in the step and saved with the model, unchecked (the fifth review's M1)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp

SECRET_ID = 987654321987  # a record's unique id


def id_records():
    ids = np.arange(16, dtype="int64").reshape(16, 1)
    ids[0, 0] = SECRET_ID
    return ids, np.zeros(16, "int64")


def dp_model(lookup):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((1,), dtype="int64")
    index = keras.layers.Lambda(lambda t: tf.cast(t, "float32"), output_shape=(1,))(lookup(inputs))
    model = tfdp.DPModel(inputs, keras.layers.Dense(2, name="head")(index))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@tfdp.per_example.declare_per_example
class IdTable(keras.layers.Layer):
    """Maps ids through a StaticHashTable built from the private ids."""

    def __init__(self, keys, **kwargs):
        super().__init__(**kwargs)
        keys = np.unique(keys).astype("int64")
        self.table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
            keys, np.arange(len(keys), dtype="int64")), -1)

    def call(self, ids):
        return self.table.lookup(ids)


def test_a_custom_layers_lookup_table_is_refused_naming_the_layer():
    """Trained on main, the table (holding the crafted id) saved with the model."""
    ids, y = id_records()
    model = dp_model(IdTable(ids, name="idtable"))
    with pytest.raises(ValueError, match=r"Layer 'idtable' \(IdTable\) reads a lookup table .*"
                                         r"adapt_privately.*declare_public") as error:
        model.fit(ids, y, batch_size=16, epochs=1, verbose=0)
    assert str(SECRET_ID) not in str(error.value)
    assert model.privacy.steps == 0


def test_a_keras_lookup_layer_declared_public_trains():
    """Negative control: a lookup layer whose vocabulary fit checks."""
    ids, y = id_records()
    lookup = keras.layers.IntegerLookup(name="ids")
    lookup.adapt(ids)
    tfdp.preprocessing.declare_public(lookup, source="a public list of ids")
    model = dp_model(lookup)
    model.fit(ids, y, batch_size=16, epochs=1, verbose=0)
    assert model.privacy.steps == 1
