"""Load: thousands of DP steps with constant memory and no retracing."""

import os
import time

import keras
import numpy as np

import tfdp

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb():
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * PAGE / 2**20


class CountingDPSequential(tfdp.DPSequential):
    """Counts how often Keras traces the train step (Python runs only when tracing)."""

    traces = 0
    train_step_is_private = True  # it only counts, then runs the DP step unchanged

    def train_step(self, data):
        type(self).traces += 1
        return super().train_step(data)


class Probe(keras.callbacks.Callback):
    def __init__(self, every):
        super().__init__()
        self.every, self.rss, self.steps = every, [], 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps % self.every == 0:
            self.rss.append(rss_mb())


def test_thousands_of_steps_trace_once_and_keep_memory_flat():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32)
    y = rng.integers(0, 2, 512)
    model = CountingDPSequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(2)]
    )
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    budget = tfdp.callbacks.PrivacyBudget(epsilon=1e6, delta=1e-5)  # reads the ledger every step
    before = CountingDPSequential.traces  # other tests' models count too: compare differences
    model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=200, verbose=0, callbacks=[budget])  # warm-up
    traced = CountingDPSequential.traces
    assert traced - before == 1

    probe = Probe(every=200)
    started = time.time()
    history = model.fit(
        x, y, batch_size=32, epochs=3, steps_per_epoch=1000, verbose=0, callbacks=[budget, probe]
    )
    seconds = time.time() - started
    print(f"3000 steps in {seconds:.1f} s; RSS (MB) every 200 steps: {np.round(probe.rss, 1).tolist()}")

    assert CountingDPSequential.traces == traced  # no retracing over 3 epochs and a new fit
    assert model.privacy.steps == 3200 and len(history.epoch) == 3
    assert repr(model.privacy) == "PrivacyLedger(steps=3200, segments=1, records=0)"  # no growth per step
    settled = probe.rss[4:]  # after the first 1000 steps (warm-up included)
    assert max(settled) - min(settled) < 25.0, probe.rss
    assert np.all(np.isfinite(model.trainable_variables[0].numpy()))


def test_negative_control_the_counter_sees_a_retrace():
    """A forced new train function is traced again, and the counter sees it."""
    model = CountingDPSequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = CountingDPSequential.traces
    model.fit(np.zeros((64, 4), np.float32), np.zeros(64, np.int64), batch_size=8, epochs=1, steps_per_epoch=2, verbose=0)
    model.make_train_function(force=True)  # what a retrace costs: a new trace
    model.fit(np.zeros((64, 4), np.float32), np.zeros(64, np.int64), batch_size=8, epochs=1, steps_per_epoch=2, verbose=0)
    assert CountingDPSequential.traces >= before + 2
