"""The whole compiled DP step is scanned and allowed op by op (issue 52,
findings 3 to 6): writes decided by the batch, metrics that write the model,
debug dumps and other outputs, asserts on values, all refused before the
first step, naming the layer or metric and the op; a crafted record's raw
value reaches no weight and no file."""

import os
import pathlib
import re
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.models import step_ops

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
SECRET = 98765.4375  # a crafted record's raw value, exact in float32


def crafted_records(n=16, dim=4):
    x = np.zeros((n, dim), "float32")
    x[0, 0] = SECRET
    return x, np.zeros(n, "int64")


def dp_model(middle, lr=0.1, loss=LOSS, units=3, **compile_kwargs):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), middle, keras.layers.Dense(units, name="head")])
    model.compile(optimizer=tfdp.optimizers.DPSGD(lr, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=1), loss=loss, **compile_kwargs)
    return model


@tfdp.per_example.declare_per_example
class SeedCountsRecords(keras.layers.Layer):
    """Advances its dropout's seed state once more in each step whose batch
    holds a large value (the fifth review's finding 3): the state, saved with
    the model, counts the steps that drew the crafted record, and the next
    dropout masks depend on it."""

    def __init__(self, control="cond", **kwargs):
        super().__init__(**kwargs)
        self.control = control
        self.seed_generator = keras.random.SeedGenerator(1)

    def advance(self):
        return tf.cast(self.seed_generator.next()[0], tf.float32) * 0.0

    def call(self, x, training=None):
        if not training:
            return x
        big = tf.reduce_max(x) > 1000.0
        if self.control == "cond":
            extra = tf.cond(big, self.advance, lambda: tf.constant(0.0))
        elif self.control == "case":
            extra = tf.switch_case(tf.cast(big, tf.int32), [lambda: tf.constant(0.0), self.advance])
        elif self.control == "while":
            extra = tf.while_loop(lambda i, e: i < tf.cast(big, tf.int32),
                                  lambda i, e: (i + 1, e + self.advance()), (0, 0.0))[1]
        else:  # "own": decided by the seed state itself (negative control)
            extra = tf.cond(self.seed_generator.state[0] >= 0, self.advance,
                            lambda: tf.constant(0.0))
        return keras.random.dropout(x, 0.5, seed=self.seed_generator) + extra


@pytest.mark.parametrize("control", ["cond", "case", "while"])
def test_a_seed_state_advanced_under_control_flow_the_batch_decides_is_refused(control):
    """Trained on main: the predicate (case index, loop condition) of the
    write was not followed."""
    layer = SeedCountsRecords(control, name="counter")
    model = dp_model(layer)
    state = layer.seed_generator.state.numpy().copy()
    x, y = crafted_records()
    with pytest.raises(ValueError, match=r"Layer 'counter' \(SeedCountsRecords\) writes its "
                                         r"variable 'seed_generator_state' \(a seed state"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 0
    np.testing.assert_array_equal(layer.seed_generator.state.numpy(), state)


def test_a_seed_state_advanced_in_a_branch_it_decides_itself_trains():
    """Negative control: the branch is decided by the seed state alone."""
    layer = SeedCountsRecords("own", name="counter")
    model = dp_model(layer)
    x, y = crafted_records()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 2


class LabelIntoBias(keras.metrics.Metric):
    """Writes the batch's largest label into the model's bias (finding 5)."""

    def __init__(self, target, **kwargs):
        super().__init__(**kwargs)
        self.target = target
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        value = tf.reduce_max(tf.cast(y_true, self.target.dtype))
        self.target.assign(tf.fill(self.target.shape, value))
        self.total.assign_add(1.0)

    def result(self):
        return self.total


class OwnTotal(LabelIntoBias):
    """Negative control: writes only its own variable."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(tf.reduce_sum(tf.cast(y_true, tf.float32)))


def regression_model(metric_type):
    keras.utils.set_random_seed(0)
    head = keras.layers.Dense(1, name="head")
    model = tfdp.DPSequential([keras.Input((4,)), head])
    model.build((None, 4))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.0, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=1),
                  loss=keras.losses.MeanSquaredError(), metrics=[metric_type(head.bias,
                                                                             name="leaky")])
    return model, head


def test_a_metric_that_writes_a_model_weight_is_refused_and_the_label_reaches_no_weight():
    """On main the bias held the crafted label (learning rate 0)."""
    model, head = regression_model(LabelIntoBias)
    x = np.zeros((16, 4), "float32")
    y = np.zeros((16, 1), "float32")
    y[0] = SECRET
    with pytest.raises(ValueError, match=r"Metric 'leaky' \(LabelIntoBias\) writes variable "
                                         r"'[\w/]*head/bias', which is not its own"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.privacy.steps == 0
    for weight in model.weights:
        assert not np.any(weight.numpy() == SECRET)


class PrintsLabels(OwnTotal):
    """Prints the batch's labels from update_state (outside the scanned pass on main)."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        tf.print(y_true)


def test_a_metric_that_prints_the_labels_is_refused():
    model, _ = regression_model(PrintsLabels)
    x, y = crafted_records()
    with pytest.raises(ValueError, match=r"A compiled metric of model '\w+' writes a tensor out "
                                         r"of its DP step.*\(PrintV2\)"):
        model.fit(x, y.astype("float32")[:, None], batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 0


def test_a_metric_that_writes_its_own_variables_trains():
    model, _ = regression_model(OwnTotal)
    x, y = np.zeros((16, 4), "float32"), np.ones((16, 1), "float32")
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 2
    assert history.history["leaky"][0] > 0


@tfdp.per_example.declare_per_example
class DebugDump(keras.layers.Layer):
    """Hands its input to TensorFlow's debug dump op (finding 4)."""

    def call(self, x, training=None):
        tf.raw_ops.DebugIdentityV2(input=x, tfdbg_context_id="c", op_name="o",
                                   debug_urls=["file:///tmp/never"])
        return x


@tfdp.per_example.declare_per_example
class RecordFile(keras.layers.Layer):
    """Writes its first example to a TFRecord file (finding 4)."""

    def __init__(self, path, **kwargs):
        super().__init__(**kwargs)
        self.file = path

    def call(self, x, training=None):
        records = tf.data.Dataset.from_tensors(tf.io.serialize_tensor(x[0]))
        tf.data.experimental.TFRecordWriter(self.file).write(records)
        return x


@tfdp.per_example.declare_per_example
class AssertsOnValues(keras.layers.Layer):
    """Stops the step when a record is large (finding 6)."""

    def call(self, x, training=None):
        with tf.control_dependencies([tf.debugging.assert_less(x, 1000.0)]):
            return tf.identity(x)


@tfdp.per_example.declare_per_example
class AbortsOnValues(keras.layers.Layer):
    """Ends the process when a record is large (review 7, F6): `Abort` is
    declared stateless, so only the never list keeps it out."""

    def call(self, x, training=None):
        def end():
            with tf.control_dependencies([tf.raw_ops.Abort(error_msg="drawn")]):
                return tf.zeros_like(x)

        return x + tf.cond(tf.reduce_max(x) > 1000.0, end, lambda: tf.zeros_like(x))


@pytest.mark.parametrize("make, match", [
    (AbortsOnValues, r"Layer 'keeper' \(AbortsOnValues\).*\(Abort\)"),
    (DebugDump, r"Layer 'keeper' \(DebugDump\) writes a tensor out of its DP step"
                r".*DebugIdentityV2"),
    (RecordFile, r"Layer 'keeper' \(RecordFile\) writes a tensor out of its DP step"
                 r".*DatasetToTFRecord"),
    (AssertsOnValues, r"Layer 'keeper' \(AssertsOnValues\) asserts on values.*\(Assert\)"),
])
def test_an_op_that_writes_out_of_the_step_or_aborts_on_values_is_refused(make, match, tmp_path):
    path = str(tmp_path / "records")
    model = dp_model(make(path, name="keeper") if make is RecordFile else make(name="keeper"))
    x, y = crafted_records()
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 0
    assert not os.path.exists(path)


@tfdp.per_example.declare_per_example
class StatefulDraw(keras.layers.Layer):
    """Draws from TensorFlow's stateful generator: an op not on the list."""

    def call(self, x, training=None):
        return x + 0.0 * tf.random.uniform(tf.shape(x))


def test_a_stateful_op_not_on_the_allow_list_is_refused_naming_the_layer():
    model = dp_model(StatefulDraw(name="keeper"))
    x, y = crafted_records()
    with pytest.raises(ValueError, match=r"Layer 'keeper' \(StatefulDraw\) runs an op in its DP "
                                         r"step that tfdp does not know.*RandomUniform"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 0


def test_tensorflow_debug_dumping_is_refused_and_dumps_no_record(tmp_path):
    """enable_dump_debug_info instruments a plain Dense model's step with
    DebugIdentityV2 (on main it trained and dumped the crafted record)."""
    model = dp_model(keras.layers.Dense(4))
    x, y = crafted_records()
    dump = tmp_path / "dump"
    tf.debugging.experimental.enable_dump_debug_info(str(dump), tensor_debug_mode="FULL_TENSOR")
    try:
        with pytest.raises(ValueError, match="while TensorFlow watches its ops: debug dumping"):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    finally:
        tf.debugging.experimental.disable_dump_debug_info()
    assert model.privacy.steps == 0
    secrets = (np.float32(SECRET).tobytes(), b"98765.4")
    for root, _, files in os.walk(dump):
        for name in files:
            with open(os.path.join(root, name), "rb") as file:
                content = file.read()
            assert not any(secret in content for secret in secrets), name
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # trains once dumping is off
    assert model.privacy.steps == 2


TABLE = tf.range(10, dtype=tf.float32)


def lookup(x, seed):
    """Indexes a table by the example's own value: out of range, and the
    step fails, on the crafted record only (on main the error printed it)."""
    return x + tf.gather(TABLE, tf.cast(x[0], tf.int32))


def clipped_lookup(x, seed):
    return x + tf.gather(TABLE, tf.clip_by_value(tf.cast(x[0], tf.int32), 0, 9))


def test_augment_that_indexes_by_the_example_values_is_refused_and_a_clipped_index_trains():
    x, y = crafted_records()
    model = dp_model(keras.layers.Dense(4))
    with pytest.raises(ValueError, match=r"augment must not index by the example's values.*"
                                         r"\(GatherV2\)") as error:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, augment=lookup, augmentations=2)
    assert "98765" not in str(error.value)
    assert model.privacy.steps == 0
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, augment=clipped_lookup, augmentations=2)
    assert model.privacy.steps == 2


def seed_advance_in_physical_batches(sampling_seed):
    keras.utils.set_random_seed(0)
    dropout = keras.layers.Dropout(0.2)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(4), dropout,
                               keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=sampling_seed), loss=LOSS)
    before = dropout.seed_generator.state.numpy().copy()
    model.fit(np.ones((16, 4), "float32"), np.zeros(16, "int64"), batch_size=4, epochs=1,
              steps_per_epoch=2, verbose=0, physical_batch_size=2)
    return tuple(dropout.seed_generator.state.numpy() - before)


def test_dropout_seed_state_after_physical_batches_does_not_count_the_drawn_records():
    """Dropout's seed advanced once a chunk, and a step's chunks are as many
    as its drawn rows: the state saved with the model held the number of
    records drawn over the fit, unnoised (on main: 12 and 24 for two
    sampling seeds). It now moves one step a step, whatever was drawn."""
    assert seed_advance_in_physical_batches(3) == (2, 0)


def test_the_compiled_ops_are_allowed_and_only_they():
    from tfdp.mechanisms.native import build

    registered = set()
    for source in build.SOURCES:  # the noise, an embedding's rows
        found = set(re.findall(r'REGISTER_OP\("(\w+)"\)', source.read_text()))
        assert found, source
        registered |= found
    assert registered == set(step_ops.NATIVE)
    assert all(step_ops.allowed(op) for op in registered)
    assert not step_ops.allowed("TfdpSomethingElse")  # the list, not a prefix


def test_a_layer_that_writes_the_optimizers_iterations_is_refused_with_a_message():
    """Review 7, F11: the refusal read `variable.path`, which the optimizer's
    `iterations` lacks, and stopped with an AttributeError instead."""
    optimizers = []

    @tfdp.per_example.declare_per_example
    class CountsLargeRecords(keras.layers.Layer):
        def call(self, x, training=None):
            if training and optimizers:
                iterations = optimizers[0].iterations
                iterations.assign_add(tf.cast(tf.reduce_max(x) > 1000.0, iterations.dtype))
            return x

    model = dp_model(CountsLargeRecords(name="keeper"))
    optimizers.append(model.optimizer)
    x, y = crafted_records()
    with pytest.raises(ValueError, match=r"writes .*iteration"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 0


@tfdp.per_example.declare_per_example
class AssertsOnValueShape(keras.layers.Layer):
    """Asserts on the shape of a tensor whose rows the values select: the
    step stops exactly when a large record is drawn (passed as a check of
    shapes on main, and the step failed on the crafted record)."""

    def __init__(self, select="boolean_mask", **kwargs):
        super().__init__(**kwargs)
        self.select = select

    def call(self, x, training=None):
        if self.select == "boolean_mask":
            rows = tf.shape(tf.boolean_mask(x, x > 1000.0))[0]
        elif self.select == "unique_of_reshape":  # through an op of fixed shape after it
            rows = tf.size(tf.reshape(tf.unique(tf.reshape(x, [-1]))[0], [-1, 1]))
        elif self.select == "in_a_branch":  # the assert in a tf.cond, given the masked tensor
            big = tf.boolean_mask(x, x > 1000.0)

            def check():
                with tf.control_dependencies([tf.debugging.assert_less(tf.shape(big)[0], 1)]):
                    return tf.identity(x)
            return tf.cond(tf.reduce_all(tf.shape(x) > 0), check, lambda: x)
        else:  # "batch": shapes the input's shape fixes (negative control)
            flat = tf.reshape(x, [tf.shape(x)[0], -1])
            rows = tf.shape(tf.zeros(tf.shape(flat)[0] * 2))[0] - tf.shape(x)[0] - 1
        with tf.control_dependencies([tf.debugging.assert_less(rows, tf.shape(x)[0] + 1)]):
            return tf.identity(x)


@pytest.mark.parametrize("select, op", [("boolean_mask", "Where"), ("unique_of_reshape", "Unique"),
                                        ("in_a_branch", "Where")])
def test_an_assert_on_a_shape_the_values_decide_is_refused_naming_the_op(select, op):
    model = dp_model(AssertsOnValueShape(select, name="counter"))
    x, y = crafted_records()
    with pytest.raises(ValueError, match=r"Layer 'counter' \(AssertsOnValueShape\) asserts on a "
                                         rf"shape that the values decide.*\({op}\)") as error:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert "98765" not in str(error.value)
    assert model.privacy.steps == 0


def test_an_assert_on_shapes_the_input_shapes_fix_trains():
    """Negative control: shape arithmetic on the batch passes."""
    model = dp_model(AssertsOnValueShape("batch", name="counter"))
    x, y = crafted_records()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 2


class IntoOtherMetric(keras.metrics.Metric):
    """Writes the batch's largest label into another metric's variable."""

    def __init__(self, other, **kwargs):
        super().__init__(**kwargs)
        self.other = other
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.other.total.assign(tf.reduce_max(tf.cast(y_true, tf.float32)))
        self.count.assign_add(1.0)

    def result(self):
        return self.count


class HoldsMetric(OwnTotal):
    """Negative control: a metric holding another, writing that one's variables."""

    def __init__(self, **kwargs):
        super().__init__(None, **kwargs)
        self.inner = keras.metrics.Mean(name="inner_mean")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.inner.update_state(y_true)
        self.total.assign_add(1.0)


def metrics_model(metrics):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(1, name="head")])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.0, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                  seed=1),
                  loss=keras.losses.MeanSquaredError(), metrics=metrics)
    return model


def test_a_metric_that_writes_another_metrics_variable_is_refused_naming_both():
    """On main any metric's variable could be written by any metric."""
    victim = OwnTotal(None, name="victim")
    model = metrics_model([victim, IntoOtherMetric(victim, name="writer")])
    x, y = np.zeros((16, 4), "float32"), np.zeros((16, 1), "float32")
    y[0] = SECRET
    with pytest.raises(ValueError, match=r"Metric 'writer' \(IntoOtherMetric\) writes variable "
                                         r"'victim/total', a variable of metric 'victim', which is not "
                                         r"its own") as error:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert "98765" not in str(error.value)
    assert model.privacy.steps == 0
    assert victim.total.numpy() != SECRET


def test_a_metric_that_writes_the_variables_of_a_metric_it_holds_trains():
    model = metrics_model([HoldsMetric(name="holder"), keras.metrics.MeanAbsoluteError()])
    model.fit(np.zeros((16, 4), "float32"), np.ones((16, 1), "float32"), batch_size=8,
              epochs=1, verbose=0)
    assert model.privacy.steps == 2


def test_a_metric_holding_a_crafted_label_is_in_no_saved_file(tmp_path):
    """Training metrics are logs, outside the epsilon (docs: what is not
    protected); Keras saves none of their variables with the model."""
    model = metrics_model([OwnTotal(None, name="labels")])
    x, y = np.zeros((16, 4), "float32"), np.zeros((16, 1), "float32")
    y[0] = SECRET
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(str(tmp_path / "ck.keras")),
        keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)])
    assert model.get_metrics_result()["labels"] == SECRET  # the metric holds it
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    secret = np.float32(SECRET).tobytes()
    for path in tmp_path.rglob("*"):
        if path.is_file():
            blobs = [path.read_bytes()]
            if zipfile.is_zipfile(path):
                with zipfile.ZipFile(path) as archive:
                    blobs += [archive.read(name) for name in archive.namelist()]
            assert not any(secret in blob for blob in blobs), path
