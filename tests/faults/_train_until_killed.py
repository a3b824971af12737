"""Child process of test_kill_resume.py: trains, checkpoints, blocks at a step.

Usage: python _train_until_killed.py WORKDIR FREQUENCIES BLOCK_AT_STEP

Trains DP-SGD on a fixed toy dataset with a checkpoint (.keras) at every
epoch end and one PrivacyJournal per frequency of FREQUENCIES (comma
separated: "batch,epoch" writes WORKDIR/journal-batch.jsonl and
WORKDIR/journal-epoch.jsonl, each as if it were the only one: one killed
run serves the parent's test of each frequency). After step BLOCK_AT_STEP
it writes WORKDIR/ready (with the step count) and sleeps, so that the
parent can SIGKILL it mid-epoch at a known step.
"""

import os
import sys
import time

import keras
import numpy as np

import tfdp

STEPS_PER_EPOCH, BATCH, N, SIGMA = 10, 16, 64, 1.0


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 4)).astype(np.float32), rng.integers(0, 3, N)


def build():
    model = tfdp.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)]
    )
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=SIGMA),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


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


def journal_path(workdir, frequency):
    return os.path.join(workdir, f"journal-{frequency}.jsonl")


def main(workdir, frequencies, block_at):
    x, y = data()
    model = build()
    journals = [tfdp.callbacks.PrivacyJournal(journal_path(workdir, frequency), frequency=frequency)
                for frequency in frequencies.split(",")]
    model.fit(
        x, y, batch_size=BATCH, epochs=100, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
        callbacks=journals + [
            keras.callbacks.ModelCheckpoint(os.path.join(workdir, "last.keras")),
            BlockAt(workdir, int(block_at)),
        ],
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
