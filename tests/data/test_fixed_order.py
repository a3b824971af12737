"""A fixed-order pipeline for DP-BandMF (issue 43, item 9): every shuffle
that reorders each pass is refused by name, and a pipeline that reorders
without showing it in its structure or its labels (a generator, constant
labels) is stopped before the first reordered batch is trained on."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.data.experimental.ops import global_shuffle_op

import tfdp
from tfdp.data.fixed_order import FixedOrderData, OrderCheck

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
N, DIM, BATCH = 64, 6, 8  # P = 8 batches a pass


def records(labels="constant"):
    x = np.random.default_rng(0).normal(size=(N, DIM)).astype("float32")
    y = np.zeros(N, "int64") if labels == "constant" else (x[:, 0] > 0).astype("int64")
    return x, y


def global_shuffle(reshuffle_each_iteration):
    x, y = records()
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    ds = global_shuffle_op._global_shuffle(
        ds, seed=3, reshuffle_each_iteration=reshuffle_each_iteration)
    return ds.batch(BATCH, drop_remainder=True)


def first_rows(ds):
    return [tuple(batch[0][:, 0].numpy()) for batch in ds]


def test_a_global_shuffle_that_reshuffles_each_pass_is_refused():
    ds = global_shuffle(True)
    assert first_rows(ds) != first_rows(ds)  # it does reorder each pass
    with pytest.raises(ValueError, match="reshuffles each epoch.*_GlobalShuffleDataset"):
        FixedOrderData(ds, planned_steps=16)


def test_a_global_shuffle_done_once_is_accepted():
    ds = global_shuffle(False)
    assert first_rows(ds) == first_rows(ds)
    assert FixedOrderData(ds, planned_steps=16).steps_per_epoch == N // BATCH


def reordering_generator(labels):
    """A generator pipeline whose every pass after the first is reversed:
    nothing in its structure says so (assert_cardinality makes it finite)."""
    x, y = records(labels)
    passes = []

    def generate():
        order = range(N) if not passes else reversed(range(N))
        passes.append(1)
        for i in order:
            yield x[i], y[i]

    ds = tf.data.Dataset.from_generator(generate, output_signature=(
        tf.TensorSpec((DIM,), tf.float32), tf.TensorSpec((), tf.int64)))
    return ds.apply(tf.data.experimental.assert_cardinality(N)).batch(BATCH, drop_remainder=True)


@pytest.mark.parametrize("labels", ["constant", "informative"])
def test_a_pass_in_another_order_stops_before_its_first_batch(labels):
    """With constant labels the label fingerprint alone saw no change: each
    record came back P - 1 - 2 j steps later, 1 step for the middle ones."""
    data = FixedOrderData(reordering_generator(labels), planned_steps=16)
    stream = iter(data.stream(0, OrderCheck(data.steps_per_epoch)))
    for _ in range(data.steps_per_epoch):
        next(stream)
    with pytest.raises(tf.errors.InvalidArgumentError, match="order changed"):
        next(stream)


def test_the_same_order_passes_every_check():
    x, y = records()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    data = FixedOrderData(ds, planned_steps=24)
    check = OrderCheck(data.steps_per_epoch)
    elements = list(data.stream(0, check).take(3 * data.steps_per_epoch))
    assert len(elements) == 24 and check.state()[1] == data.steps_per_epoch


def test_a_first_pass_fingerprints_features_as_well_as_labels():
    """Two pipelines with the same labels in the same order and the records'
    features in another order differ in their fingerprints; the same pipeline
    read twice does not (negative control)."""
    x, y = records()

    def fingerprints(features):
        ds = tf.data.Dataset.from_tensor_slices((features, y)).batch(BATCH, drop_remainder=True)
        return FixedOrderData(ds, planned_steps=8).first_pass()[0]

    assert np.array_equal(fingerprints(x), fingerprints(x))
    assert not np.any(fingerprints(x) == fingerprints(x[::-1]))


def test_fit_stops_a_reordering_generator_with_constant_labels_before_the_batch_is_trained():
    keras.utils.set_random_seed(1)
    model = tfdp.DPSequential([keras.Input((DIM,)), keras.layers.Dense(3)])
    optimizer = tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.5), 1.0, 1.0, bands=4, seed=0)
    model.compile(optimizer=optimizer, loss=LOSS)
    kernels = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: kernels.append(model.layers[0].kernel.numpy()))
    with pytest.raises(tf.errors.InvalidArgumentError, match="order changed"):
        model.fit(reordering_generator("constant"), epochs=2, verbose=0, callbacks=[record])
    assert len(kernels) == N // BATCH  # the first pass; the reversed batch never trained
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), kernels[-1])
