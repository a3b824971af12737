"""One `tf.function` called from two places in the DP step is checked at
each call site, with that site's own inputs (the fifth review's critical
finding): the scan followed a shared function's inputs through one caller
only, so a second call passing a value from the batch wrote a seed state or
another layer's weight past the scan. Refused before the first step; the
crafted record's raw value reaches no weight."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
SECRET = 98765  # a crafted record's raw value, exact in float32 and int64


def crafted_records(n=16, dim=4):
    x = np.zeros((n, dim), "float32")
    x[0, 0] = SECRET
    return x, np.zeros(n, "int64")


def dp_model(inputs, outputs):
    model = tfdp.DPModel(inputs, outputs)
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=1), loss=LOSS)
    return model


@tfdp.per_example.declare_per_example
class SharedSeedSetter(keras.layers.Layer):
    """Calls one tf.function that sets its seed state twice: once with the
    state's own value, once (`source`) with the batch's largest value: after
    it at the top of `call()` ("top"), or before it in a `tf.while_loop` body
    ("while"); "own" calls it twice with the state's own value (the negative
    control)."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self.source = source
        self.seed_generator = keras.random.SeedGenerator(1)
        state = self.seed_generator.state

        @tf.function(autograph=False)
        def setter(value):
            state.assign(value)
            return tf.constant(0.0)

        self.setter = setter

    def call(self, x, training=None):
        if not training:
            return x
        state = self.seed_generator.state
        from_batch = tf.cast(tf.stack([tf.reduce_max(x), 0.0]), state.dtype)
        if self.source == "while":  # the loop's call first, then the state's own
            other = tf.while_loop(lambda i, e: i < 1,
                                  lambda i, e: (i + 1, e + self.setter(from_batch)), (0, 0.0))[1]
        own = self.setter(state.value + 0)
        if self.source == "top":
            other = self.setter(from_batch)
        elif self.source == "own":
            other = self.setter(state.value + 0)
        return keras.random.dropout(x, 0.5, seed=self.seed_generator) + 0.0 * (own + other)


def seed_model(source):
    keras.utils.set_random_seed(0)
    layer = SharedSeedSetter(source, name="sneaky")
    inputs = keras.Input((4,))
    return dp_model(inputs, keras.layers.Dense(3, name="head")(layer(inputs))), layer


@pytest.mark.parametrize("source", ["top", "while"])
def test_a_shared_function_setting_the_seed_from_the_batch_at_a_second_call_is_refused(source):
    """Trained on main (the seed state ended [98765 1])."""
    model, layer = seed_model(source)
    state = layer.seed_generator.state.numpy().copy()
    x, y = crafted_records()
    with pytest.raises(ValueError, match=r"Layer 'sneaky' \(SharedSeedSetter\) writes its "
                                         r"variable 'seed_generator_state' \(a seed state"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.privacy.steps == 0
    np.testing.assert_array_equal(layer.seed_generator.state.numpy(), state)


def test_a_shared_function_advancing_the_seed_from_itself_at_both_calls_trains():
    """Negative control: both call sites pass the state's own value."""
    model, _ = seed_model("own")
    x, y = crafted_records()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.privacy.steps == 1


@tfdp.per_example.declare_per_example
class Memory(keras.layers.Layer):
    def build(self, shape):
        self.memory = self.add_weight(shape=(2,), dtype="int64", initializer="zeros",
                                      trainable=False, name="memory")

    def call(self, x):
        return x


@tfdp.per_example.declare_per_example
class WriterThroughSharedFunction(keras.layers.Layer):
    """One tf.function(variable, value) called with another layer's weight
    and the batch's largest value, then (in a branch its seed decides) with
    its seed state and the state's own value."""

    def __init__(self, target, **kwargs):
        super().__init__(**kwargs)
        self.target = target
        self.seed_generator = keras.random.SeedGenerator(1)

        @tf.function(autograph=False)
        def setter(variable, value):
            variable.assign(value)
            return tf.constant(0.0)

        self.setter = setter

    def call(self, x, training=None):
        if not training:
            return x
        # pylint: disable=protected-access
        state = self.seed_generator.state
        written = self.setter(self.target.memory._value,
                              tf.cast(tf.stack([tf.reduce_max(x), 0.0]), "int64"))
        advanced = tf.cond(state.value[0] >= 0,
                           lambda: self.setter(state._value, state.value + 0),
                           lambda: tf.constant(0.0))
        return keras.random.dropout(x, 0.5, seed=self.seed_generator) + 0.0 * (written + advanced)


def test_another_layers_weight_written_through_a_shared_function_is_refused(tmp_path):
    """Trained on main: memory_layer.memory held the crafted value, in the
    saved weights, with an epsilon reported."""
    keras.utils.set_random_seed(0)
    memory = Memory(name="memory_layer")
    inputs = keras.Input((4,))
    hidden = WriterThroughSharedFunction(memory, name="writer")(memory(inputs))
    model = dp_model(inputs, keras.layers.Dense(3, name="head")(hidden))
    x, y = crafted_records()
    with pytest.raises(ValueError, match=r"Layer 'memory_layer' \(Memory\) writes its "
                                         r"variable 'memory'"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.privacy.steps == 0
    path = tmp_path / "m.weights.h5"
    model.save_weights(path)
    assert np.array(SECRET, "int64").tobytes() not in path.read_bytes()
    np.testing.assert_array_equal(memory.memory.numpy(), [0, 0])
