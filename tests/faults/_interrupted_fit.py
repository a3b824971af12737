"""Child process: a fit on a slow RecordSource, interrupted by SIGINT.

Usage: python _interrupted_fit.py WORKDIR SECONDS_PER_RECORD

Every record read but record 0's appends "<monotonic time> <index>" to
WORKDIR/reads before it sleeps SECONDS_PER_RECORD (a slow disk). The parent
sends SIGINT once reads have begun. The child catches KeyboardInterrupt
around `fit`, then writes WORKDIR/result.json: whether fit was interrupted,
the ledger's steps, the optimizer's applied steps, the journal's steps and
the steps of a second fit (on fast reads, after `journal.recover`).
"""

import json
import os
import sys
import time

import keras
import numpy as np

import tfdp

N, BATCH, THREADS = 64, 16, 4


class SlowRecords:
    def __init__(self, log_path, seconds):
        self.log_path, self.seconds, self.slow = log_path, seconds, True

    def __len__(self):
        return N

    def __getitem__(self, index):
        if index and self.slow:
            with open(self.log_path, "a") as log:
                log.write(f"{time.monotonic()} {index}\n")
            time.sleep(self.seconds)
        return np.full(4, index, np.float32), index % 2


def main(workdir, seconds):
    records = SlowRecords(os.path.join(workdir, "reads"), seconds)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    journal = tfdp.callbacks.PrivacyJournal(os.path.join(workdir, "journal.jsonl"))
    interrupted = False
    try:
        model.fit(tfdp.data.RecordSource(records, num_threads=THREADS), batch_size=BATCH,
                  epochs=100, callbacks=[journal], verbose=0)
    except KeyboardInterrupt:
        interrupted = True
    stopped = time.monotonic()
    records.slow = False
    ledger_steps, applied = model.privacy.steps, int(model.optimizer.iterations.numpy())
    journaled = journal.journaled_steps()
    journal.recover(model)  # charges the journaled steps that did not run (over-counts)
    recovered = model.privacy.steps
    model.fit(tfdp.data.RecordSource(records), batch_size=BATCH, epochs=1,
              callbacks=[journal], verbose=0)
    with open(os.path.join(workdir, "result.json"), "w") as file:
        json.dump({"interrupted": interrupted, "stopped": stopped, "ledger_steps": ledger_steps,
                   "applied_steps": applied, "journaled_steps": journaled,
                   "second_fit_steps": model.privacy.steps - recovered}, file)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
