"""Child process of test_kill_resume_bandmf.py: the crash-and-resume guide's
recipe for DP-BandMF (`noise_state` + `PrivacyJournal` + `BackupAndRestore`),
blocking after a given step so that the parent can SIGKILL it there.

Usage: python _bandmf_until_killed.py WORKDIR MODE FREQUENCY BLOCK_AT_STEP

MODE is "fixed" (a tf.data pipeline in a fixed order) or "amplified"
(arrays, cyclic Poisson sampling). With BLOCK_AT_STEP 0 it trains to the end.
After step BLOCK_AT_STEP it writes WORKDIR/ready (the step count) and sleeps.
"""

import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfdp

P, EPOCHS, BANDS = 8, 3, 4
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(workdir):
    keras.utils.set_random_seed(1)
    model = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPBandMF(
        keras.optimizers.SGD(0.5), 1.0, 1.0, bands=BANDS,
        noise_state=os.path.join(workdir, "noise_state.npz")), loss=LOSS)
    return model


def fit(model, workdir, mode, frequency, extra=()):
    """The same `fit` the killed run and its rerun make."""
    rng = np.random.default_rng(0)
    n = 64 if mode == "fixed" else 256
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    if mode == "fixed":
        args, kwargs = (tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True),), {}
    else:
        args, kwargs = (x, y), dict(batch_size=16, steps_per_epoch=P)
    journal = tfdp.callbacks.PrivacyJournal(os.path.join(workdir, "journal.jsonl"), frequency)
    backup = keras.callbacks.BackupAndRestore(os.path.join(workdir, "backup"))
    model.fit(*args, epochs=EPOCHS, verbose=0, callbacks=[journal, backup, *extra], **kwargs)
    return journal


class BlockAt(keras.callbacks.Callback):
    def __init__(self, workdir, step):
        super().__init__()
        self.workdir, self.step = workdir, step

    def on_train_batch_end(self, batch, logs=None):
        steps = self.model.privacy.steps
        if steps == self.step:
            with open(os.path.join(self.workdir, "ready.tmp"), "w") as file:
                file.write(str(steps))
            os.replace(os.path.join(self.workdir, "ready.tmp"), os.path.join(self.workdir, "ready"))
            time.sleep(600)


def main(workdir, mode, frequency, block_at):
    fit(build(workdir), workdir, mode, frequency, extra=[BlockAt(workdir, int(block_at))])


if __name__ == "__main__":
    main(*sys.argv[1:])
