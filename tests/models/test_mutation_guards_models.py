"""Guards found missing by a mutation test of the privacy code (issue 43, item 12).

A `ModelCheckpoint(save_best_only=True)` file carries the ledger of every step
up to its latest comparison, and of the whole run once training ends
(`tfdp.models.chosen_checkpoint`). Untested were a run whose last comparison
comes before the end of training (a file of an 8-step run saying 6 passed)
and the batch counting of batch-level comparisons (off by one passed). Here
the monitored loss is scripted, and a callback after the checkpoint reads
the file's step count after every batch.

Issue 55, item 8: `LedgerGuard`, which refuses a rollback during `fit`, is
driven here as Keras drives it (the counter set back between its calls).
Each of these mutants passed every relevant test: one step counted per batch
callback with `steps_per_execution` > 1, a one-step rollback tolerated, and
no check in `on_train_batch_begin` (a rollback there ran one step under
replayed noise).
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.models.restore import LedgerGuard

N, BATCH = 64, 16  # 4 steps an epoch
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class ScriptedLoss(keras.callbacks.Callback):
    """Writes step k's scripted loss into the logs the checkpoint reads next."""

    def __init__(self, values):
        super().__init__()
        self.values, self.calls = values, 0

    def on_train_batch_end(self, batch, logs=None):
        logs["loss"] = self.values[self.calls]
        self.calls += 1


class FileSteps(keras.callbacks.Callback):
    """The step count of the checkpoint file after every batch (None: no file)."""

    def __init__(self, path):
        super().__init__()
        self.path, self.steps = path, []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(
            tfdp.load_model(self.path).privacy.steps if os.path.exists(self.path) else None)


def run(tmp_path, save_freq, losses, epochs=2, n=N):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
                                                  seed=1), loss=LOSS)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(n, 4)).astype("float32"), rng.integers(0, 3, n)
    path = str(tmp_path / "best.keras")
    checkpoint = keras.callbacks.ModelCheckpoint(path, monitor="loss", save_best_only=True,
                                                 save_freq=save_freq)
    observed = FileSteps(path)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0,
              callbacks=[ScriptedLoss(losses), checkpoint, observed])
    return model, observed.steps, tfdp.load_model(path)


def test_a_last_comparison_before_the_end_still_charges_the_whole_run(tmp_path):
    """Comparisons every 3 batches over 8 steps: at steps 3 (best) and 6
    (kept); steps 7 and 8 come after the last comparison, and the file must
    still say 8 once training ends."""
    model, during, loaded = run(tmp_path, 3, [9.0, 9.0, 1.0, 9.0, 9.0, 2.0, 9.0, 9.0])
    assert model.privacy.steps == 8
    assert during == [None, None, 3, 3, 3, 6, 6, 6]
    assert loaded.privacy.steps == 8 == int(loaded._dp_steps.numpy())
    assert loaded.privacy.epsilon(1e-5) == model.privacy.epsilon(1e-5)


def test_batch_level_comparisons_are_counted_as_keras_counts_them(tmp_path):
    """Comparisons every 2 batches across 2 epochs of 4 (the batch index
    restarts at each epoch): steps 2, 4, 6, 8. The best is step 2; each
    later comparison keeps the file and rewrites it with its own step."""
    _, during, loaded = run(tmp_path, 2, [9.0, 1.0, 9.0, 5.0, 9.0, 3.0, 9.0, 2.0])
    assert during == [None, 2, 2, 4, 4, 6, 6, 8]
    assert loaded.privacy.steps == 8


def test_one_step_epochs_count_a_batch_each(tmp_path):
    """Each epoch one batch (index 0 every time): comparisons every 2
    batches at steps 2 and 4."""
    _, during, loaded = run(tmp_path, 2, [9.0, 1.0, 9.0, 5.0, 9.0], epochs=5, n=BATCH)
    assert during == [None, 2, 2, 4, 4]
    assert loaded.privacy.steps == 5


# -- issue 55, item 8: LedgerGuard's count of the steps Keras ran -----------------


class _Ledger:
    """A ledger that reads the model's step counter, as tfdp's does."""

    def __init__(self, counter):
        self.counter = counter

    @property
    def steps(self):
        return int(self.counter.numpy())


class _Model:
    """What LedgerGuard reads of a model: its ledger and step counter."""

    def __init__(self, steps=0):
        self._dp_steps = tf.Variable(steps, dtype=tf.int64)
        self.privacy = _Ledger(self._dp_steps)


def guarded(start=0):
    model = _Model(start)
    guard = LedgerGuard(model.privacy, [])
    guard.set_model(model)
    guard.on_train_begin()
    guard.on_epoch_begin(0)
    return model, guard


def run_executions(model, guard, executions, steps_per_execution, first_batch=0):
    """Keras's calls for `executions` calls of `steps_per_execution` steps:
    batch begin with the call's first index, batch end with its last."""
    batch = first_batch
    for _ in range(executions):
        guard.on_train_batch_begin(batch)
        model._dp_steps.assign_add(steps_per_execution)
        batch += steps_per_execution
        guard.on_train_batch_end(batch - 1)
    return batch


@pytest.mark.parametrize("rollback", [1, 2, 3])
def test_a_rollback_within_a_call_of_several_steps_is_refused(rollback):
    """With steps_per_execution=4 each batch callback follows 4 steps: the
    guard must count 4 (counting 1 a callback let a rollback of up to 3 of
    every 4 steps through)."""
    model, guard = guarded(start=10)
    run_executions(model, guard, 2, 4)
    assert model.privacy.steps == 18
    model._dp_steps.assign_sub(rollback)
    with pytest.raises(ValueError, match=f"went from 18 to {18 - rollback}"):
        guard.on_train_batch_begin(8)
    assert model.privacy.steps == 18  # set back: the ledger counts every step that ran


def test_a_one_step_rollback_between_steps_is_refused():
    model, guard = guarded()
    run_executions(model, guard, 3, 1)
    model._dp_steps.assign_sub(1)  # a callback loaded the weights of one step before
    with pytest.raises(ValueError, match="went from 3 to 2"):
        guard.on_train_batch_end(2)


def test_a_rollback_in_on_train_batch_begin_stops_the_step_it_precedes():
    """A callback's on_train_batch_begin runs before the guard's: the guard's
    own batch-begin check must stop the step, which would otherwise run once
    under replayed noise before the batch-end check."""
    model, guard = guarded()
    run_executions(model, guard, 2, 1)
    model._dp_steps.assign_sub(2)
    with pytest.raises(ValueError, match="went from 2 to 0"):
        guard.on_train_batch_begin(2)


def test_steps_that_ran_pass_the_guard():
    """Negative control: calls of 1, 4 and a short last call of 3 steps, and
    epochs restarting the batch index, raise nothing."""
    model, guard = guarded(start=5)
    run_executions(model, guard, 2, 4)
    run_executions(model, guard, 1, 3, first_batch=8)
    guard.on_epoch_begin(1)
    run_executions(model, guard, 3, 1)
    assert model.privacy.steps == 5 + 8 + 3 + 3
