"""A step whose data read fails is neither applied nor charged (issue 44,
item 6). Before, the step counter the ledger reads (`_dp_steps`), the inner
optimizer's `iterations` and DP-BandMF's noise stream advanced with no data
dependency: a step whose batch never arrived (a RecordSource IOError, a
short `__getitems__`, a pipeline shorter than its `assert_cardinality`) was
charged, and BandMF's noise for it consumed, though no update was applied.
The test compares, after the error, the ledger's steps with the updates the
weights received: the weights must equal those of a run of exactly the
charged steps."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.data import RecordSource

N, D = 40, 4


def rows():
    rng = np.random.default_rng(0)
    return [(rng.normal(size=D).astype(np.float32), np.float32(i % 2)) for i in range(N)]


class FailingReads(list):
    """A tfds-like source whose `fail_at`-th batch read (0: none) raises an
    IOError, or with `short=True` returns one item too few."""

    def __init__(self, fail_at, short=False):
        super().__init__(rows())
        self.fail_at, self.short, self.reads = fail_at, short, 0

    def __getitems__(self, indices):
        self.reads += 1
        items = [self[i] for i in indices]
        if self.reads != self.fail_at:
            return items
        if self.short:
            return items[:-1]
        raise OSError("disk gone")


def dpsgd_model(steps_per_execution=1):
    keras.utils.set_random_seed(1)
    model = tfdp.DPSequential([keras.Input((D,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, 1.0, 1.0, seed=0), loss="mse",
                  steps_per_execution=steps_per_execution)
    return model


def fit_source(model, records, steps):
    model.fit(RecordSource(records), batch_size=8, epochs=1, steps_per_epoch=steps, verbose=0)


@pytest.mark.parametrize("fail_at, steps_per_execution, short", [
    (1, 1, False), (3, 1, False), (3, 2, False), (2, 1, True)])
def test_a_step_whose_read_fails_is_not_charged(fail_at, steps_per_execution, short):
    model = dpsgd_model(steps_per_execution)
    # The OSError's own text is withheld (it can quote a record: tfdp.data.sources._failed).
    with pytest.raises(tf.errors.OpError, match="__getitems__ returned" if short else
                       r"FailingReads.__getitems__ failed \(OSError\)"):
        fit_source(model, FailingReads(fail_at, short), 6)
    # Reads run ahead of the steps in parallel: the failing read is for step
    # fail_at or a later one, so the steps that ran are counted by their effect.
    charged = model.privacy.steps
    assert charged <= 6
    assert int(model.optimizer.iterations.numpy()) == charged
    if charged == 0:
        assert not np.any(model.layers[0].kernel.numpy())  # nothing applied
        return
    reference = dpsgd_model()  # the same steps, one per call
    fit_source(reference, FailingReads(0), charged)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, expected)


def bandmf_model():
    keras.utils.set_random_seed(1)
    model = tfdp.DPSequential([keras.Input((D,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(optimizer=tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.1), 1.0, 1.0, bands=2,
                                                     seed=0), loss="mse")
    return model


def test_a_pipeline_shorter_than_its_cardinality_charges_only_what_ran():
    """DP-BandMF on a fixed-order pipeline that claims 7 batches and holds 5:
    the 6th read fails. The ledger, the noise stream and the iterations all
    count the 5 steps that were applied (before: 6, and the stream had
    consumed the noise of a step that never ran). (No reference run: the
    coefficients depend on the 7 planned steps.)"""
    x = np.stack([r[0] for r in rows()])
    y = np.stack([r[1] for r in rows()])
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    model = bandmf_model()
    with pytest.raises(tf.errors.OpError, match="expected to contain 7"):
        model.fit(batches.apply(tf.data.experimental.assert_cardinality(7)), epochs=1, verbose=0)
    stream = model.optimizer.__dict__["_stream"]
    assert model.privacy.steps == int(stream.step.numpy()) == 5
    assert int(model.optimizer.iterations.numpy()) == 5


def failing_loss(y_true, y_pred):
    """Fails inside the step, after its batch arrived (as an out-of-memory would):
    a gather indexed by the label, out of range (an assertion on the label
    would be refused before the step, tfdp.models.state_writes)."""
    table = tf.zeros([5])
    looked_up = tf.gather(table, tf.cast(tf.reshape(y_true, [-1]), tf.int32))
    return keras.losses.mean_squared_error(y_true, y_pred) + tf.reshape(looked_up, [-1])


def test_a_step_that_fails_after_its_read_stays_charged():
    """Charged, not applied: the over-count is kept (never under), and the
    ledger's statement covers it."""
    keras.utils.set_random_seed(1)
    model = tfdp.DPSequential([keras.Input((D,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, 1.0, 1.0, seed=0), loss=failing_loss)
    x = np.ones((N, D), np.float32)
    # TensorFlow's message quotes the label (9): withheld (tfdp.models.step_errors).
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"failed in node .*GatherV2") \
            as failed:
        model.fit(x, np.full((N, 1), 9.0, np.float32), batch_size=8, epochs=1, verbose=0)
    assert "= 9" not in str(failed.value)
    assert not np.any(model.layers[0].kernel.numpy())  # not applied
    assert model.privacy.steps == 1  # charged
    assert model.privacy.epsilon(1e-5) > 0
