"""GroupNormalization's rule computes the layer's output as Keras does."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.per_example import compute_per_example_gradients, plan_for
from tfdp.per_example.recorder import Recorder
from tfdp.per_example.rules.group_normalization import GroupNormalizationRule

L = keras.layers


def _mse(y_true, y_pred):
    return tf.reduce_sum(tf.square(y_true - y_pred), -1)


LAYERS = {
    "channels_last": ((9, 9, 8), lambda: L.GroupNormalization(4)),
    "channels_first": ((8, 9, 9), lambda: L.GroupNormalization(2, axis=1)),
    "sequence": ((7, 6), lambda: L.GroupNormalization(3)),
    "offset_only": ((9, 9, 8), lambda: L.GroupNormalization(4, scale=False)),
    "scale_only": ((9, 9, 8), lambda: L.GroupNormalization(4, center=False)),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_the_batched_pass_normalizes_bit_for_bit_as_keras(name):
    """The model's output in the DP step equals its own call exactly: the
    rule runs Keras's formula, not a rounding of it."""
    shape, make = LAYERS[name]
    rng = np.random.default_rng(0)
    norm = make()
    model = keras.Sequential([keras.Input(shape), norm, L.Flatten(), L.Dense(2)])
    for weight in norm.trainable_weights:
        weight.assign(rng.uniform(-2.0, 2.0, weight.shape).astype("float32"))
    # A large mean against the spread: rounding differs between formulas.
    x = tf.constant(3.0 + rng.normal(size=(6,) + shape) * 0.1, tf.float32)
    y = tf.zeros([6, 2])
    _, y_pred, _ = compute_per_example_gradients(model, x, y, tf.ones([6]), _mse, "batched")
    np.testing.assert_array_equal(y_pred.numpy(), model(x).numpy())


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _BatchGroupBlock(keras.layers.Layer):
    """Declared to run its sublayers on the batch, wrongly: its
    GroupNormalization groups over axis 0, the examples."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = L.GroupNormalization(1, axis=0)

    def call(self, x):
        return self.norm(x)


def test_a_sublayer_grouping_over_the_batch_is_refused():
    """A declared block's sublayers are not walked by the graph check: the
    plan reads their configuration too (the rule summed the whole batch into
    one row, which the weighted sum then stretched over every example), and
    the rule refuses the axis itself."""
    inputs = keras.Input((6, 4), batch_size=4)
    block = _BatchGroupBlock()
    model = keras.Model(inputs, L.Dense(2, trainable=False)(L.Flatten()(block(inputs))))
    plan = plan_for(model)
    assert plan.path == "vectorized" and "batch axis" in plan.reason
    with pytest.raises(ValueError, match="reduces over the batch axis"):
        compute_per_example_gradients(model, tf.ones([4, 6, 4]), tf.zeros([4, 2]),
                                      tf.ones([4]), _mse, "batched")
    with tf.GradientTape() as tape, pytest.raises(ValueError, match="groups over the batch"):
        with Recorder(tape).hooked([(block.norm, GroupNormalizationRule())]):
            block.norm(tf.ones([4, 6, 4]))


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _BatchNormalizingBlock(keras.layers.Layer):
    """Declared, wrongly: a weightless LayerNormalization over axis 0."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = L.Dense(8)
        self.norm = L.LayerNormalization(axis=0, center=False, scale=False)

    def call(self, x):
        return self.norm(self.dense(x))


def test_a_weightless_sublayer_over_the_batch_in_a_declared_block_is_refused():
    """The plan reads every Keras layer a declared block holds, weightless
    ones included (a review moved a neighbouring step 3.3x its bound
    through this block on the batched path)."""
    model = keras.Sequential([keras.Input((6, 8)), _BatchNormalizingBlock(), L.Flatten(),
                              L.Dense(1)])
    plan = plan_for(model)
    assert plan.path == "vectorized" and "batch axis" in plan.reason
