"""DPIS's pass over all records (each epoch's per-example norms, with the
layers' training call) runs before the step is traced: it is checked as the
step's own per-example pass is, so a layer that writes a variable there is
refused before the pass runs, and no record's value reaches the model.
Found by review 19 (a layer that writes only in that pass)."""

import traceback

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp


class WritesInTheNormPass(keras.layers.Layer):
    """Writes the batch's largest third feature into a variable, but only
    when DPIS's norm pass traces it: the check before fit, and the step,
    see no write."""

    def build(self, shape):
        self.leak = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                    name="leak")

    def call(self, x, training=None):
        in_norm_pass = any(frame.name == "_all_norms" for frame in traceback.extract_stack())
        if in_norm_pass and training:
            self.leak.assign(tf.reduce_max(x[..., 2]))
        return x


def test_a_layer_writing_in_the_norm_pass_is_refused_before_any_record_reaches_it():
    x = np.random.default_rng(0).normal(size=(64, 5)).astype("float32")
    x[:, 2] = -(np.arange(64) + 1.0)  # record i carries -(i + 1)
    layer = WritesInTheNormPass()
    model = tfdp.DPSequential([keras.Input((5,)), layer, keras.layers.Dense(2)])
    model.compile(optimizer=tfdp.optimizers.DPIS(0.1, l2_norm_clip=1.0, target_epsilon=8.0,
                                                 epochs=1, sigma_n=5.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="writes its variable 'leak'"):
        model.fit(x, np.zeros(64, "int32"), batch_size=16, epochs=1, verbose=0)
    assert float(layer.leak.numpy()) == 0.0  # no record's value was written
