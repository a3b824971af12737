"""A memory-mapped training file truncated during `fit` (issue 35, item 4).

Reading a page of a mapped file past its new end raises SIGBUS: the old code
died with rc -7 and no message. `ArraySource` checks the file's size before
every read and stops with an error naming the file. Run in a subprocess,
since the failure is a signal.
"""

import os
import signal
import subprocess
import sys

TRUNCATED_DURING_FIT = """
import faulthandler, os, sys
# A hang (seen once in CI, not reproduced since) ends with every thread's stack in stderr.
faulthandler.dump_traceback_later(300, exit=True)
import keras, numpy as np
import tfdp

path = sys.argv[1]
rows, width = 4096, 1024  # 16 MB of float32: the second half is 2,048 pages
np.save(path, np.random.default_rng(0).normal(size=(rows, width)).astype(np.float32))
x = np.load(path, mmap_mode="r")
y = np.arange(rows) % 3

class TruncateAfter(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.model.privacy.steps == 2:
            os.truncate(path, os.path.getsize(path) // 2)  # a copy or a rewrite going on

model = tfdp.DPSequential([keras.Input((width,)), keras.layers.Dense(3)])
model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=256, epochs=3, steps_per_epoch=4, verbose=0, callbacks=[TruncateAfter()])
"""


def test_a_file_truncated_during_fit_stops_it_with_an_error_naming_the_file(tmp_path):
    path = str(tmp_path / "x.npy")
    result = subprocess.run([sys.executable, "-c", TRUNCATED_DURING_FIT, path],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode != -signal.SIGBUS, "killed by SIGBUS, without a message"
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"The file {path!r} behind a memory-mapped training array is now" in result.stderr, \
        result.stderr[-6000:]
    assert os.path.getsize(path) < 4096 * 1024 * 4  # the control: it was truncated
