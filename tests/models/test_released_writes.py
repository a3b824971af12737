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


# Review 23: routes around the first version of the check. Each wrote the
# crafted record into a saved variable there; each is refused now.


class ViaTensorArray(keras.constraints.Constraint):
    """Reads the kept row back through a TensorArray's first flow (C1)."""

    def __call__(self, w):
        handle, flow = tf.raw_ops.TensorArrayV3(size=1, dtype=tf.float32,
                                                element_shape=tf.TensorShape(None))
        written = tf.raw_ops.TensorArrayWriteV3(handle=handle, index=0, value=KEPT["x"][0],
                                                flow_in=flow)
        with tf.control_dependencies([written]):
            read = tf.raw_ops.TensorArrayReadV3(handle=handle, index=0, flow_in=flow,
                                                dtype=tf.float32)
        return w * 0.0 + tf.reshape(read, [4, 1])


def _function(signature, fn):
    return tf.function(fn, input_signature=signature, autograph=False).get_concrete_function()


class ViaFor(keras.constraints.Constraint):
    """tf.raw_ops.For lays its inputs out as (start, limit, delta, *vars) (C2)."""

    def __call__(self, w):
        spec = tf.TensorSpec([4], tf.float32)
        body = _function([tf.TensorSpec([], tf.int32), spec, spec], lambda i, a, b: (b, b))
        out = tf.raw_ops.For(start=0, limit=1, delta=1, input=[tf.zeros([4]), KEPT["x"][0]],
                             body=body)
        return w * 0.0 + tf.reshape(out[0], [4, 1])


class ViaSymbolicGradient(keras.constraints.Constraint):
    """SymbolicGradient's outputs are weighted by its trailing inputs (C2)."""

    def __call__(self, w):
        f = _function([tf.TensorSpec([4], tf.float32)], lambda a: a * 1.0)
        out = tf.raw_ops.SymbolicGradient(input=[tf.zeros([4]), KEPT["x"][0]],
                                          Tout=[tf.float32], f=f)
        return w * 0.0 + tf.reshape(out[0], [4, 1])


class ViaUnseenFunction(keras.constraints.Constraint):
    """Writes through a function registered eagerly, called by name: its body
    is not in the step's graph (C5)."""

    def __init__(self, target):
        self.target = target

    def __call__(self, w):
        with tf.init_scope():  # in the eager context only
            write = _function([tf.TensorSpec([3], tf.float32), tf.TensorSpec([], tf.resource)],
                              lambda v, h: tf.raw_ops.AssignVariableOp(resource=h, value=v) and [])
            write.add_to_graph()
        variable = self.target[0]
        tf.raw_ops.StatefulPartitionedCall(
            args=[KEPT["x"][0][:3], getattr(variable, "value", variable).handle], Tout=[],
            f=write.name.decode() if isinstance(write.name, bytes) else write.name)
        return w


class ViaSwappedHandles(keras.constraints.Constraint):
    """Swaps a metric's and the learning rate's handles in a loop: its second
    trip writes the learning rate, taken for the metric by the loop's first
    value (C4)."""

    def __init__(self, models):
        self.models = models

    def __call__(self, w):
        model = self.models[0]
        total, rate = model._loss_tracker.total, model.optimizer._learning_rate  # pylint: disable=protected-access
        handles = [getattr(v, "value", v).handle for v in (total, rate)]
        kept = KEPT["x"][0][0]

        def body(i, a, b):
            tf.cond(tf.equal(i, 1), lambda: tf.raw_ops.AssignVariableOp(
                resource=a, value=kept) and tf.constant(0), lambda: tf.constant(0))
            return i + 1, b, a

        tf.while_loop(lambda i, a, b: i < 2, body, [tf.constant(0), *handles])
        return w


class KernelNorm(keras.metrics.Metric):
    """A metric of the kernel's norm: it tracks the kernel (C3)."""

    def __init__(self, kernel):
        super().__init__(name="kernel_norm")
        self.kernel = kernel

    def update_state(self, y_true, y_pred, sample_weight=None):
        pass

    def reset_state(self):
        pass  # Keras's would zero the variables it tracks: the kernel

    def result(self):
        return tf.norm(self.kernel)


_UNKNOWN = r"runs an op in its DP step that tfdp does not know"


@pytest.mark.parametrize("route", ["tensor_array", "for", "symbolic_gradient", "unseen_function",
                                   "swapped_handles", "metric_tracks_the_kernel"])
def test_a_kept_tensor_laundered_around_the_search_is_refused(route):
    """On 97fc9e5 (the check's first version) each route trained, and a saved
    variable (the kernel, the bias, the learning rate) held the crafted record."""
    models, target = [], []
    constraint, match = {
        "tensor_array": (ViaTensorArray(), r"reads a resource that is not a known variable.*"
                                           r"TensorArrayReadV3"),
        "for": (ViaFor(), _UNKNOWN + r".*\(For\)"),
        "symbolic_gradient": (ViaSymbolicGradient(), _UNKNOWN + r".*\(SymbolicGradient\)"),
        "unseen_function": (ViaUnseenFunction(target), _UNKNOWN + r".*StatefulPartitionedCall"),
        "swapped_handles": (ViaSwappedHandles(models), r"writes a resource that is not one of "
                                                       r"its variables"),
        "metric_tracks_the_kernel": (RecordIntoKernel(), r"writes variable '[\w/]*head/kernel' "
                                                         r"from the batch's records"),
    }[route]
    keras.utils.set_random_seed(0)
    head = keras.layers.Dense(3, name="head", kernel_constraint=constraint)
    model = tfdp.DPSequential([keras.Input((4,)), KeepsTheBatch(), head])
    model.build((None, 4))
    models.append(model)
    target.append(head.bias)
    metrics = [KernelNorm(head.kernel)] if route == "metric_tracks_the_kernel" else None
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=metrics)
    refused(model, match)
    for variable in model.optimizer.variables:
        assert not np.any(variable.numpy() == SECRET)


# Review 24: TensorFlow 1's Switch gates the ops after it by a control edge
# (its dead output skips them), a branch no scan sees. Both trained on
# ff9e80d, the saved state moved by the crafted record; refused now.


@tfdp.per_example.declare_per_example
class KeepsWithCounter(KeepsTheBatch):
    """Keeps its input, and holds an int weight for a constraint to write."""

    def build(self, shape):
        self.count = self.add_weight(shape=(), dtype="int32", trainable=False,
                                     initializer="zeros", name="count")


class CountsLargeRecords(keras.constraints.Constraint):
    """Adds 1 to the layer's count where the kept batch holds a large value,
    gated by a Switch's dead output, not by a cond."""

    def __init__(self, layers):
        self.layers = layers

    def __call__(self, w):
        skipped, taken = tf.raw_ops.Switch(data=tf.constant(0),
                                           pred=tf.reduce_any(KEPT["x"] > 1e3))
        with tf.control_dependencies([tf.identity(taken)]):
            one = tf.identity(tf.constant(1))
        self.layers[0].count.assign_add(one)
        tf.raw_ops.Merge(inputs=[skipped, taken])  # the step's outputs stay alive
        return w


class SeedCountsLargeRecords(keras.layers.Layer):
    """Advances its seed state from itself, gated by a Switch on the batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(0)

    def call(self, x, training=None):
        state = self.seed_generator.state
        skipped, taken = tf.raw_ops.Switch(data=tf.constant(0.0), pred=tf.reduce_any(x > 1e3))
        with tf.control_dependencies([tf.identity(taken)]):
            advanced = tf.identity(state.value + tf.constant([0, 1], state.dtype))
        state.assign(advanced)
        tf.raw_ops.Merge(inputs=[skipped, taken])
        return x


@pytest.mark.parametrize("where", ["update", "pass"])
def test_a_write_a_switch_on_the_batch_gates_is_refused(where):
    layers = []
    if where == "update":
        keeper = KeepsWithCounter(name="keeper")
        layers.append(keeper)
        model, _ = dp_model(keeper, kernel_constraint=CountsLargeRecords(layers))
    else:
        model, _ = dp_model(SeedCountsLargeRecords(name="counter"))
    refused(model, r"runs an op in its DP step that tfdp does not know.*\(Switch\)")
