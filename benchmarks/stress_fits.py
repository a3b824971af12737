"""Many short fits in one process: input pipelines torn down at every moment.

Issue 35 (item 1): one `fit` in about 185 hung for minutes in the input
iterator's teardown (a Python generator drew the Poisson batches). This
script runs FITS short fits in one child process, cycling through what
tears a pipeline down: epoch ends, EarlyStopping, `stop_training` from a
callback, an exception and a KeyboardInterrupt raised from callbacks
mid-epoch, on arrays, memmaps, a RecordSource, physical batches, XLA and
DPIS. Each fit has a watchdog (faulthandler: a fit that runs past
--fit-timeout seconds dumps every thread's stack and kills the child), and
the child has an overall timeout. It prints the count of fits finished and
the time; rc 0 only if every fit finished.

    python benchmarks/stress_fits.py --fits 1000
"""

import argparse
import faulthandler
import os
import subprocess
import sys
import tempfile
import threading
import time


class Raised(Exception):
    """Raised from a callback on purpose."""


def _scenarios(workdir):
    import keras
    import numpy as np

    import tfdp

    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 6)).astype(np.float32)
    y = rng.integers(0, 3, 160)
    np.save(os.path.join(workdir, "x.npy"), x)
    memmap = np.load(os.path.join(workdir, "x.npy"), mmap_mode="r")
    records = tfdp.data.RecordSource(list(zip(x, y)), num_threads=2)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def model(optimizer=None, jit_compile=False):
        built = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                   keras.layers.Dense(3)])
        built.compile(optimizer=optimizer or tfdp.optimizers.DPSGD(
            0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss, jit_compile=jit_compile)
        return built

    class RaiseAt(keras.callbacks.Callback):
        def __init__(self, batch, error):
            super().__init__()
            self.batch, self.error = batch, error

        def on_train_batch_end(self, batch, logs=None):
            if batch == self.batch:
                raise self.error

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                self.model.stop_training = True

    models = {"plain": model(), "xla": model(jit_compile=True)}
    early = keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=0)

    def fit(name, data, expected=(), **kwargs):
        try:
            models[name].fit(*data, batch_size=16, verbose=0, **kwargs)
        except expected:
            pass

    def dpis():
        optimizer = tfdp.optimizers.DPIS(learning_rate=0.1, l2_norm_clip=1.0, target_epsilon=8.0,
                                         epochs=2, sigma_n=5.0)
        model(optimizer).fit(x, y, batch_size=16, epochs=2, verbose=0)

    return [
        ("arrays, 3 epochs", lambda: fit("plain", (x, y), epochs=3)),
        ("early stopping", lambda: fit("plain", (x, y), epochs=5, callbacks=[early])),
        ("exception mid-epoch", lambda: fit("plain", (x, y), Raised, epochs=2,
                                            callbacks=[RaiseAt(3, Raised("on purpose"))])),
        ("memmap, 2 epochs", lambda: fit("plain", (memmap, y), epochs=2)),
        ("record source, exception", lambda: fit("plain", (records,), Raised, epochs=2,
                                                 callbacks=[RaiseAt(5, Raised("on purpose"))])),
        ("physical batches", lambda: fit("plain", (x, y), epochs=2, physical_batch_size=5)),
        ("KeyboardInterrupt mid-epoch", lambda: fit("plain", (x, y), KeyboardInterrupt, epochs=2,
                                                    callbacks=[RaiseAt(1, KeyboardInterrupt())])),
        ("stop_training", lambda: fit("plain", (records,), epochs=3, callbacks=[StopAt()])),
        ("xla", lambda: fit("xla", (x, y), epochs=2)),
        ("dpis", dpis),
    ]


def child(fits, fit_timeout, workdir):
    scenarios = _scenarios(workdir)
    start = time.perf_counter()
    for index in range(fits):
        name, run = scenarios[index % len(scenarios)]
        faulthandler.dump_traceback_later(fit_timeout, exit=True)
        run()
        faulthandler.cancel_dump_traceback_later()
        if (index + 1) % 50 == 0 or index + 1 == fits:
            print(f"{index + 1} fits in {time.perf_counter() - start:.0f} s (last: {name})", flush=True)
    print(f"DONE {fits}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fits", type=int, default=1000)
    parser.add_argument("--fit-timeout", type=float, default=300.0,
                        help="seconds one fit may run before it counts as hung")
    parser.add_argument("--timeout", type=float, default=4 * 3600.0,
                        help="seconds the whole child may run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as workdir:
            child(args.fits, args.fit_timeout, workdir)
        return 0
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    command = [sys.executable, os.path.abspath(__file__), "--child", "--fits", str(args.fits),
               "--fit-timeout", str(args.fit_timeout)]
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    done = 0
    watchdog = threading.Timer(args.timeout, process.kill)  # the child's own timeout
    watchdog.start()
    for line in process.stdout:  # progress, and a hung fit's stacks
        if line.startswith("DONE "):
            done = int(line.split()[1])
        print(line, end="", flush=True)
    process.wait()
    watchdog.cancel()
    seconds = time.perf_counter() - start
    print(f"{done} of {args.fits} fits finished in {seconds:.0f} s; child rc {process.returncode}")
    return 0 if done == args.fits and process.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
