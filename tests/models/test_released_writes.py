"""What the step writes into a saved variable depends on the batch only
through tfdp's noise (review 22, C2): a tensor a layer keeps from the batch
in Python (an attribute, a dict) and a weight constraint or learning-rate
schedule reads inside the optimizer's update is refused before the first
step, naming the variable; so is a metric's or tfdp's counter's value
written into a weight. Constraints and schedules that read the weights and
the step count train as before."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp

SECRET = 98765.4375  # a crafted record's raw value, exact in float32
KEPT = {}  # where a layer keeps the batch: Python, no op to scan


def crafted_records(n=16, dim=4):
    x = np.zeros((n, dim), "float32")
    x[0, 0] = SECRET
    return x, np.zeros(n, "int64")


@tfdp.per_example.declare_per_example
class KeepsTheBatch(keras.layers.Layer):
    """Writes no variable: keeps its input in a Python dict."""

    def call(self, x, training=None):
        KEPT["x"] = x
        return x


class KeepsAConstant(keras.layers.Layer):
    """Keeps a tensor made from no record (negative control)."""

    def call(self, x, training=None):
        KEPT["x"] = tf.ones([16, 4]) * 0.5
        return x


class RecordIntoKernel(keras.constraints.Constraint):
    """The kernel's columns become the first kept row (4 inputs)."""

    def __call__(self, w):
        return w * 0.0 + KEPT["x"][0][:, None]


class RateFromRecords(keras.optimizers.schedules.LearningRateSchedule):
    """A learning rate scaled by the batch's largest value."""

    def __call__(self, step):
        return tf.reduce_max(tf.abs(KEPT["x"])) * 1e-3

    def get_config(self):
        return {}


class MetricIntoBias(keras.constraints.Constraint):
    """The bias becomes the loss tracker's running total (no noise)."""

    def __init__(self, models):
        self.models = models

    def __call__(self, w):
        total = self.models[0]._loss_tracker.total  # pylint: disable=protected-access
        return w * 0.0 + tf.cast(total, w.dtype)


def dp_model(first, lr=0.1, **head_kwargs):
    keras.utils.set_random_seed(0)
    head = keras.layers.Dense(3, name="head", **head_kwargs)
    model = tfdp.DPSequential([keras.Input((4,)), first, head])
    model.compile(optimizer=tfdp.optimizers.DPSGD(lr, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, head


def refused(model, match, **fit_kwargs):
    x, y = crafted_records()
    before = [w.numpy().copy() for w in model.weights]
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, **fit_kwargs)
    assert model.privacy.steps == 0
    for weight, earlier in zip(model.weights, before):
        np.testing.assert_array_equal(weight.numpy(), earlier)
        assert not np.any(weight.numpy() == SECRET)


def test_a_constraint_reading_a_kept_batch_tensor_is_refused():
    """On main the released kernel held the crafted record (review 22, C2).
    In physical batches the pass runs in a loop's body, and TensorFlow
    itself refuses a tensor kept there and read after the loop."""
    model, _ = dp_model(KeepsTheBatch(name="keeper"), kernel_constraint=RecordIntoKernel())
    refused(model, r"writes variable '[\w/]*head/kernel' from the batch's records outside "
                   r"tfdp's noise.*reads the step's input")


def test_a_schedule_reading_a_kept_batch_tensor_is_refused():
    """On main the update moved with the crafted record's size (5,882x)."""
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), KeepsTheBatch(name="keeper"),
                               keras.layers.Dense(3, name="head")])
    model.compile(optimizer=tfdp.optimizers.DPSGD(RateFromRecords(), noise_multiplier=1.0,
                                                  l2_norm_clip=1.0, seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    refused(model, r"writes variable '[\w/]*head/(kernel|bias)' .*from the batch's records")


def test_a_constraint_writing_the_loss_trackers_total_into_a_weight_is_refused():
    """A training metric is logged without noise, outside the epsilon: its
    value in a saved weight would not be."""
    models = []
    model, _ = dp_model(keras.layers.Identity(), bias_constraint=MetricIntoBias(models))
    models.append(model)
    refused(model, r"writes variable '[\w/]*head/bias' .*from the batch's records")


@pytest.mark.parametrize("first", [KeepsAConstant, keras.layers.Identity])
def test_constraints_and_schedules_of_weights_and_steps_train(first):
    """Negative control: a kept tensor made from no record, Keras's own
    constraints and schedules."""
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    keras.utils.set_random_seed(0)
    head = keras.layers.Dense(3, name="head", kernel_constraint=(
        RecordIntoKernel() if first is KeepsAConstant else keras.constraints.MaxNorm(0.5)),
        bias_constraint=keras.constraints.NonNeg())
    model = tfdp.DPSequential([keras.Input((4,)), first(), head])
    model.compile(optimizer=tfdp.optimizers.DPSGD(schedule, noise_multiplier=1.0,
                                                  l2_norm_clip=1.0, seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = crafted_records()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 2
    if first is KeepsAConstant:
        np.testing.assert_array_equal(head.kernel.numpy(), np.full((4, 3), 0.5, "float32"))
    else:
        assert np.all(np.linalg.norm(head.kernel.numpy(), axis=0) <= 0.5 + 1e-6)
