"""Peak memory of a DP-SGD step against `physical_batch_size` (issue 26).

The tanh CNN on random 28x28x1 inputs, logical (expected) batch 8192 of
16384 records (q = 0.5), one step per physical batch size k, each k in a
fresh subprocess, and the unsplit step (physical_batch_size=None). The
padded logical batch is longer than 8192 (the oversized-draw margin), so
k = 8192 takes two chunks. Each run builds the model and data, resets the
kernel's resident-set high-water mark (`/proc/self/clear_refs`), traces and
takes one step, then `--steps` more (timed: s/step); the table gives the
high-water mark above the resident set before the first step: the step's
peak (per-example work, chunk buffers, the padded batch gathered from the
arrays) plus tracing, which is alike for every k. The allocator keeps freed
memory, so the figures bound the step's peak from above and vary by tens of
MB between runs. TensorFlow's own CPU allocator statistics
(`tf.config.experimental.get_memory_info("CPU:0")`) read 0 on this build, so
the kernel's figure is used (Linux only).

    python benchmarks/physical_batch_memory.py
"""

import argparse
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

KS = (256, 512, 1024, 2048, 4096, 8192)


def _status_kb(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(k, batch, steps):
    """One run in this process (k 0: unsplit); prints "k peak_mb s_per_step"."""
    import keras
    import numpy as np

    import tfdp
    from tfdp import recipes

    keras.utils.set_random_seed(0)
    n = 2 * batch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, n)
    model = tfdp.DPSequential(recipes.tanh_cnn())
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    physical = k or None
    fit = dict(batch_size=batch, epochs=1, verbose=0, physical_batch_size=physical)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current resident set
    before = _status_kb("VmRSS")
    model.fit(x, y, steps_per_epoch=1, **fit)  # trace and warm up
    start = time.perf_counter()
    model.fit(x, y, steps_per_epoch=steps, **fit)
    seconds = (time.perf_counter() - start) / steps
    peak = _status_kb("VmHWM")
    print(f"{k} {(peak - before) / 1024:.0f} {seconds:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS) + [0],
                        help="physical batch sizes; 0 runs the unsplit step")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        measure(args.one, args.batch, args.steps)
        return
    print(f"logical batch {args.batch} (expected) of {2 * args.batch} records, tanh CNN, {args.steps} steps per k, CPU")
    print("| physical_batch_size k | peak RSS above baseline (MB) | s/step |")
    print("|---:|---:|---:|")
    # The children import tfdp from the checkout this script sits in.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    for k in args.ks:
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(k), "--batch", str(args.batch),
             "--steps", str(args.steps)],
            check=True, capture_output=True, text=True, env=env,
        ).stdout.split()
        label = str(k) if k else "None (unsplit)"
        print(f"| {label} | {out[-2]} | {out[-1]} |", flush=True)


if __name__ == "__main__":
    main()
