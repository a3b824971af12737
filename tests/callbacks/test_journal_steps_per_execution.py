"""PrivacyJournal with compile(steps_per_execution=k) (review of issue 44
item 6): Keras runs k steps between two batch callbacks, and an epoch's
last call runs k steps even past `steps_per_epoch`. Before, "batch" journaled
one step per call (8 steps ran, 5 journaled, a recover charged 5) and
"epoch" journaled `steps` (12 steps ran, 10 journaled).
"""

import os

import keras
import numpy as np
import pytest

import tfdp

N, D, K = 64, 4, 4
rng = np.random.default_rng(0)
X = rng.normal(size=(N, D)).astype("float32")
Y = rng.normal(size=(N, 1)).astype("float32")


def model():
    keras.utils.set_random_seed(1)
    m = tfdp.DPSequential([keras.Input((D,)), keras.layers.Dense(1)])
    m.compile(optimizer=tfdp.optimizers.DPSGD(0.1, 1.0, 1.0), loss="mse", steps_per_execution=K)
    return m


class Watch(keras.callbacks.Callback):
    """After every call: the journal records at least the steps that ran;
    with `kill_at`, stops the process (as a kill would) once that many ran."""

    def __init__(self, journal, kill_at=None):
        super().__init__()
        self.journal, self.kill_at, self.seen = journal, kill_at, []

    def on_train_batch_end(self, batch, logs=None):
        ran = self.model.privacy.steps
        self.seen.append((ran, self.journal.journaled_steps()))
        if self.kill_at is not None and ran >= self.kill_at:
            raise KeyboardInterrupt("killed")


@pytest.mark.parametrize("frequency", ["batch", "epoch"])
def test_the_journal_covers_every_call_and_a_recover_charges_what_ran(tmp_path, frequency):
    journal = tfdp.callbacks.PrivacyJournal(os.fspath(tmp_path / "j.jsonl"), frequency=frequency)
    trained = model()
    trained.save_weights(os.fspath(tmp_path / "start.weights.h5"))
    watch = Watch(journal, kill_at=2 * K + 1)
    with pytest.raises(KeyboardInterrupt):
        # 5 steps an epoch: Keras runs calls of 4 steps from batches 0 and 4.
        trained.fit(X, Y, batch_size=8, epochs=3, steps_per_epoch=5, verbose=0,
                    callbacks=[journal, watch])
    ran = trained.privacy.steps
    assert ran == 3 * K and len(watch.seen) == 3
    assert all(journaled >= steps for steps, journaled in watch.seen), watch.seen
    if frequency == "batch":
        assert journal.journaled_steps() == ran  # exact: no step journaled that did not run
    resumed = model()
    resumed.load_weights(os.fspath(tmp_path / "start.weights.h5"))
    assert journal.recover(resumed) >= ran
    assert resumed.privacy.steps >= ran
    assert resumed.privacy.epsilon(1e-5) >= trained.privacy.epsilon(1e-5)
