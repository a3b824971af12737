"""A layer that writes a variable in the DP step is refused before the first
step (issue 43, item 7): a running mean would hold training records' raw
features after one step and be saved with the model."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.models.state_writes import check_no_state_writes

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class RunningMean(keras.layers.Layer):
    """Keeps a running mean of its inputs in training (as BatchNormalization does)."""

    def build(self, shape):
        self.mean = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False,
                                    name="running_mean")

    def call(self, x, training=None):
        if training:
            self.mean.assign(0.5 * self.mean + 0.5 * tf.reduce_mean(x, 0))
        return x


class MemoryInCond(keras.layers.Layer):
    """Stores the first example of a batch, inside a tf.cond branch."""

    def build(self, shape):
        self.memory = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False,
                                      name="memory")

    def call(self, x, training=None):
        def store():
            self.memory.assign(x[0])
            return tf.constant(1.0)

        tf.cond(tf.reduce_sum(x) != 0.0, store, lambda: tf.constant(0.0))
        return x


class SeedFromData(keras.layers.Layer):
    """Writes data into a SeedGenerator's state: not an RNG advancing itself."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.random.SeedGenerator(1)

    def call(self, x, training=None):
        state = self.generator.state
        self.generator.state.assign(tf.cast(x[0, : state.shape[0]], state.dtype))
        return x


def crafted_records(n=32, dim=4):
    x = np.zeros((n, dim), "float32")
    x[0] = [1e3, -2e3, 3e3, 7.0]  # a record with recognisable features
    return x, np.zeros(n, "int64")


def dp_model(middle):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), middle, keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0),
                  loss=LOSS)
    return model


@pytest.mark.parametrize("make", [RunningMean, MemoryInCond, SeedFromData])
def test_a_layer_that_writes_a_variable_is_refused_before_the_first_step(make):
    layer = make(name="keeper")
    model = dp_model(layer)
    x, y = crafted_records()
    with pytest.raises(ValueError, match=r"Layer 'keeper' \(\w+\) writes its variable '\w+'"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert model.privacy.steps == 0
    for variable in layer.non_trainable_variables:  # nothing of a record was kept
        assert not np.any(np.isin(variable.numpy().astype("float32"), x[0]))


def test_dropout_advances_its_seed_and_trains():
    """Negative control: Dropout's SeedGenerator state advances from itself."""
    model = dp_model(keras.layers.Dropout(0.5))
    x, y = crafted_records()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.privacy.steps == 2


@pytest.mark.parametrize("method", ["auto", "vectorized"])
def test_batch_normalization_in_training_is_refused_and_writes_nothing_in_inference_mode(method):
    """BatchNormalization in training mode is refused by name as the check
    traces it (it would write its moving statistics); frozen, or trainable
    and called with training=False (inference mode), it writes nothing."""
    loss = lambda y, p: tf.reduce_sum(tf.square(y - p), -1)  # noqa: E731
    sample = (tf.zeros([1, 4]), tf.zeros([1, 2]))
    norm = keras.layers.BatchNormalization(name="norm")
    model = keras.Sequential([keras.Input((4,)), norm, keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="Layer 'norm' .BatchNormalization. is trainable and runs in training mode"):
        check_no_state_writes(model, sample, loss, method)
    inputs = keras.Input((4,))
    inference = keras.Model(inputs, keras.layers.Dense(2)(norm(inputs, training=False)))
    check_no_state_writes(inference, sample, loss, method)
    norm.trainable = False
    check_no_state_writes(model, sample, loss, method)


def test_batch_normalization_in_training_mode_in_a_dp_model_is_still_refused():
    model = dp_model(keras.layers.BatchNormalization())
    x, y = np.zeros((8, 4), "float32"), np.zeros(8, "int32")
    with pytest.raises(ValueError, match="BatchNormalization"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)


class PythonWrite(keras.layers.Layer):
    """Writes its input into a variable from Python (tf.py_function): the
    traced graph shows only the Python op (found by review: the saved weights
    held a record's features)."""

    def build(self, shape):
        self.memory = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False,
                                      name="memory")

    def call(self, x, training=None):
        def stash(value):
            self.memory.assign(value[0])
            return np.float32(0)

        if training:
            z = tf.py_function(stash, [x], tf.float32)
            z.set_shape([])
            x = x + 0.0 * z
        return x


class SeedThroughQueue(keras.layers.Layer):
    """Writes data into its seed state through a queue, which broke the
    "no input reaches it" trace of the first check (found by review)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1)
        self.queue = tf.queue.FIFOQueue(1000, tf.float32, shapes=[])

    def call(self, x, training=None):
        if training:
            with tf.control_dependencies([self.queue.enqueue(x[0, 0])]):
                value = self.queue.dequeue()
            state = self.seed_generator.state
            state.assign(tf.cast(tf.stack([value, value]), state.dtype))
        return x


class GeneratorSkip(keras.layers.Layer):
    """Advances a tf.random.Generator by a record's value (RngReadAndSkip, an
    op the first check's list of writes did not know)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = tf.random.Generator.from_seed(1)

    def call(self, x, training=None):
        if training:
            self.generator.skip(tf.cast(tf.abs(x[0, 0]), tf.int64))
        return x


class QueueRecords(keras.layers.Layer):
    """Puts a record in a queue that outlives the step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.queue = tf.queue.FIFOQueue(100, tf.float32, shapes=[4])

    def call(self, x, training=None):
        if training:
            self.queue.enqueue(x[0])
        return x


@pytest.mark.parametrize("make, match", [
    (PythonWrite, "runs Python inside its DP step"),
    (SeedThroughQueue, "writes"),
    (GeneratorSkip, "writes a resource that is not one of its variables"),
    (QueueRecords, "writes a resource that is not one of its variables"),
])
def test_writes_the_graph_hides_or_a_list_of_writes_misses_are_refused(make, match):
    model = dp_model(make(name="keeper"))
    x, y = crafted_records()
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert model.privacy.steps == 0


class PrintRecords(keras.layers.Layer):
    """Prints a record (to a log or a file) in training (found by review)."""

    def call(self, x, training=None):
        if training:
            tf.print(x[0])
        return x


class WriteRecords(keras.layers.Layer):
    def __init__(self, path, **kwargs):
        super().__init__(**kwargs)
        self.file = path

    def call(self, x, training=None):
        if training:
            tf.io.write_file(self.file, tf.strings.as_string(x[0, 0]))
        return x


@pytest.mark.parametrize("make", [PrintRecords, WriteRecords])
def test_a_layer_that_writes_a_tensor_out_of_the_step_is_refused(make, tmp_path):
    layer = make(name="keeper") if make is PrintRecords else make(str(tmp_path / "leak"),
                                                                    name="keeper")
    model = dp_model(layer)
    x, y = crafted_records()
    with pytest.raises(ValueError, match="writes a tensor out of its DP step"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert model.privacy.steps == 0
    assert not (tmp_path / "leak").exists()


class TrainableRunningMean(RunningMean):
    """Keeps a running mean only while trainable (a custom 'freezable' layer)."""

    def call(self, x, training=None):
        if training and self.trainable:
            self.mean.assign(0.5 * self.mean + 0.5 * tf.reduce_mean(x, 0))
        return x


def test_a_layer_unfrozen_by_a_callback_at_train_begin_is_checked_again_before_the_first_step():
    """fit's check runs before callbacks' on_train_begin; a layer unfrozen
    there would write its running mean from the records in every step (it
    trained on cfab9b6; the check now runs again as the step traces)."""
    layer = TrainableRunningMean(name="keeper")
    model = dp_model(layer)
    layer.trainable = False

    class Unfreeze(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            layer.trainable = True

    x, y = crafted_records()
    with pytest.raises(ValueError,
                       match=r"Layer 'keeper' \(TrainableRunningMean\) writes its variable"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[Unfreeze()])
    assert model.privacy.steps == 0
    np.testing.assert_array_equal(layer.mean.numpy(), 0.0)


def test_a_layer_frozen_by_a_callback_at_train_begin_is_checked_again_and_trains():
    """Negative control: a callback freezes a Dense layer after fit's check;
    the model is checked again with the new flags, writes nothing, trains."""
    layer, first = TrainableRunningMean(name="keeper"), keras.layers.Dense(4, name="first")
    model = dp_model(keras.Sequential([first, layer]))
    layer.trainable = False

    class Freeze(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            first.trainable = False

    x, y = crafted_records()
    kernel = first.kernel.numpy().copy()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[Freeze()])
    assert model.privacy.steps == 2
    np.testing.assert_array_equal(first.kernel.numpy(), kernel)
    np.testing.assert_array_equal(layer.mean.numpy(), 0.0)


class SwitchedRunningMean(keras.layers.Layer):
    """Keeps a running mean once a Python attribute switches it on: same
    `trainable` flags and shapes, different code (second review of issue 45)."""

    enabled = False

    def build(self, shape):
        self.mean = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False,
                                    name="running_mean")

    def call(self, x, training=None):
        if self.enabled and training:
            self.mean.assign(0.5 * self.mean + 0.5 * tf.reduce_mean(x, 0))
        return x


class WarmBN(keras.layers.BatchNormalization):
    """Called with training=False, but calls BatchNormalization in training
    mode (writing its moving statistics) once switched on."""

    adapt = False

    def call(self, inputs, training=None, mask=None):
        return super().call(inputs, training=self.adapt, mask=mask)


def switched_model(case):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    if case == "running_mean":
        layer, variable = SwitchedRunningMean(name="keeper"), "running_mean"
        hidden = layer(inputs)
    else:
        layer, variable = WarmBN(name="keeper", center=False, scale=False), "moving_mean"
        hidden = layer(inputs, training=False)
    model = tfdp.DPModel(inputs, keras.layers.Dense(3)(hidden))
    return model, layer, variable


def compile_switched(model, **kwargs):
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=1), loss=LOSS, **kwargs)


def switch_on(layer):
    layer.enabled = layer.adapt = True


def check_untouched(model, layer, x):
    assert model.privacy.steps == 0
    for variable in layer.non_trainable_variables:
        assert not np.any(np.isin(variable.numpy().astype("float32"), x[0]))
    if isinstance(layer, SwitchedRunningMean):
        np.testing.assert_array_equal(layer.mean.numpy(), 0.0)


@pytest.mark.parametrize("case", ["running_mean", "warm_bn"])
def test_a_layer_switched_on_by_a_callback_at_train_begin_is_refused_before_the_first_step(case):
    """A callback sets a Python attribute after fit's check: the trainable
    flags and shapes are those fit checked, the step's code is not. The
    step's own graph is checked: refused, naming the layer and the
    variable, before any step is charged."""
    model, layer, variable = switched_model(case)
    compile_switched(model)

    class SwitchOn(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            switch_on(layer)

    x, y = crafted_records()
    with pytest.raises(ValueError, match=rf"Layer 'keeper' \(\w+\) writes its variable '{variable}'"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[SwitchOn()])
    check_untouched(model, layer, x)


@pytest.mark.parametrize("change", ["recompile", "physical_batch_size"])
def test_a_layer_switched_on_between_two_fits_is_refused_before_the_next_step(change):
    """fit, switch the layer on, recompile (or fit in physical batches: the
    chunked step) and fit again: the new step's graph writes, refused."""
    model, layer, variable = switched_model("running_mean")
    compile_switched(model)
    x, y = crafted_records()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    steps = model.privacy.steps
    switch_on(layer)
    kwargs = {"physical_batch_size": 4} if change == "physical_batch_size" else {}
    if change == "recompile":
        compile_switched(model)
    with pytest.raises(ValueError, match=rf"Layer 'keeper' \(\w+\) writes its variable '{variable}'"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, **kwargs)
    assert model.privacy.steps == steps
    np.testing.assert_array_equal(layer.mean.numpy(), 0.0)


def test_a_layer_switched_off_trains_in_the_chunked_step():
    """Negative control: the same layer, never switched on, trains whole and
    in physical batches; its running mean stays."""
    model, layer, _ = switched_model("running_mean")
    compile_switched(model)
    x, y = crafted_records()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, physical_batch_size=4)
    assert model.privacy.steps == 4
    np.testing.assert_array_equal(layer.mean.numpy(), 0.0)


def test_train_on_batch_is_refused_clearly():
    model = dp_model(keras.layers.Dense(4))
    x, y = crafted_records()
    with pytest.raises(NotImplementedError, match="train_on_batch.*fit"):
        model.train_on_batch(x, y)
    assert model.privacy.steps == 0


@tfdp.per_example.declare_per_example
class NumpyRunningMean(keras.layers.Layer):
    """Writes a running mean computed by eager Python (`.numpy()`): no graph
    can show it (the third review's route around the graph scan)."""

    def build(self, shape):
        self.mean = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False,
                                    name="running_mean")

    def call(self, x, training=None):
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * np.mean(x.numpy(), 0))
        return x


def test_a_step_run_eagerly_is_refused_before_it_is_charged():
    """Eager Python in call() writes training data where no graph shows it
    (this layer trained under run_eagerly=True and released 1.25e28 for one
    record of 1e30): run_eagerly is refused at compile, and a step forced
    eager by tf.config.run_functions_eagerly is refused before its charge."""
    inputs = keras.Input((4,))
    layer = NumpyRunningMean(name="numpy_stats")
    model = tfdp.DPModel(inputs, keras.layers.Dense(3)(layer(inputs)))
    with pytest.raises(ValueError, match="does not run its private step eagerly.*run_eagerly=True"):
        compile_switched(model, run_eagerly=True)
    compile_switched(model)
    x, y = crafted_records()
    tf.config.run_functions_eagerly(True)
    try:
        with pytest.raises(ValueError, match="does not run its private step eagerly"):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    finally:
        tf.config.run_functions_eagerly(False)
    assert model.privacy.steps == 0
    np.testing.assert_array_equal(layer.mean.numpy(), 0.0)


class CondRoutedWrite(keras.layers.Layer):
    """Writes its variable through a handle passed on by a tf.cond: the
    handle's source is an If op, not the function's input."""

    def build(self, shape):
        self.mean = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False,
                                    name="running_mean")

    def call(self, x):
        handle = tf.cond(tf.constant(True), lambda: self.mean.value.handle,
                         lambda: self.mean.value.handle)
        tf.raw_ops.AssignVariableOp(resource=handle, value=tf.reduce_mean(x, 0))
        return x


def test_a_write_through_a_handle_routed_by_control_flow_is_refused():
    """Only a resource created inside the step counts as local: a
    variable's handle routed through a tf.cond is the variable (it trained
    and released 1.25e29 for one record of 1e30 when only a Placeholder
    counted as from outside)."""
    inputs = keras.Input((4,))
    layer = CondRoutedWrite(name="routed")
    model = tfdp.DPModel(inputs, keras.layers.Dense(3)(layer(inputs)))
    compile_switched(model)
    x, y = crafted_records()
    with pytest.raises(ValueError, match="writes"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.privacy.steps == 0
    np.testing.assert_array_equal(layer.mean.numpy(), 0.0)
