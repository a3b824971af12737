"""Long fits of the zoo: DP against plain Keras over hundreds of steps.

What users run is a long fit: many steps an epoch, many epochs. For every
model of `benchmarks/throughput.py`'s zoo, one child process builds the
plain Keras model and the same model as a `tfdp.DPModel` (same weights),
traces both with a short fit, then fits each for one epoch of `--steps`
steps (200 by default: a Fashion-MNIST epoch is 234 steps of 256), the two
alternating for `--rounds` rounds. Each fit is timed two ways at once: its
wall time (what a user waits for, input pipeline, callbacks and the
epsilon included) and its steady step time (a callback reads the loss at
the first call ending at step 10 or later and at the last step). The
fixed per-fit cost is the wall time less `--steps` steady steps: the input
pipeline's start, the first steps, the end of fit. Rows give medians over
rounds; the ratio columns are the medians of the per-round ratios.
Synthetic data, as the zoo.

    python benchmarks/long_fit.py                              # whole zoo, float32
    python benchmarks/long_fit.py --only mlp tanh_cnn_256 --rounds 3
    python benchmarks/long_fit.py --only mlp --steps-per-execution 1 8   # Keras's lever
    python benchmarks/long_fit.py --jit-compile true           # both models under XLA
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import throughput  # noqa: E402

FIRST_TIMED_STEP = 10


def timed_fit(model, x, y, batch, steps):
    """(wall seconds, steady seconds a step) of one epoch of `steps` steps."""
    import keras
    import numpy as np

    marks = []  # (step index, time) at the first call ending past step 10, and the last

    class Marks(keras.callbacks.Callback):
        def on_train_batch_end(self, batch_index, logs=None):
            # With steps_per_execution k, Keras calls this every k steps.
            if batch_index == steps - 1 or (batch_index >= FIRST_TIMED_STEP and not marks):
                float(np.asarray(logs["loss"]))  # waits for this step
                marks.append((batch_index, time.perf_counter()))

    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=steps, verbose=0,
              callbacks=[Marks()])
    wall = time.perf_counter() - start
    (first, start_time), (last, end_time) = marks[0], marks[-1]
    return wall, (end_time - start_time) / (last - first)


def child(name, steps, rounds, jit_compile, steps_per_execution):
    """Interleaved long fits of one zoo model: a dict of per-round figures."""
    batch = throughput.ZOO[name][0]
    throughput.ZOO[name] = (batch, steps)  # build() sizes the data: steps + 1 batches
    models = {}
    for spe in steps_per_execution:
        plain, private, x, y = throughput.make_models(name, jit_compile=jit_compile,
                                                      steps_per_execution=spe)
        for kind, model in (("plain", plain), ("dp", private)):
            model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=2 * spe, verbose=0)
            models[f"{spe}/{kind}"] = model
    figures = {key: [] for key in models}
    for _ in range(rounds):
        for key, model in models.items():
            wall, steady = timed_fit(model, x, y, batch, steps)
            figures[key].append({"fit": batch * steps / wall, "step": batch / steady,
                                 "per_fit_ms": 1e3 * (wall - steps * steady)})
    return {"figures": figures,
            "path": models[f"{steps_per_execution[0]}/dp"].per_example_path.split(": ", 1)[1]}


def median_ratio(figures, numerator, denominator, field):
    return statistics.median(a[field] / b[field]
                             for a, b in zip(figures[numerator], figures[denominator]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(throughput.ZOO))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jit-compile", choices=["false", "true"], default="false")
    parser.add_argument("--steps-per-execution", type=int, nargs="+", default=[1],
                        help="Keras's steps_per_execution values to measure, interleaved")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= FIRST_TIMED_STEP + 1:
        parser.error(f"--steps must be > {FIRST_TIMED_STEP + 1}. Received: {args.steps}")
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    jit = args.jit_compile == "true"
    print(f"{args.steps} steps a fit, {args.rounds} rounds, XLA {'on' if jit else 'off'}; "
          "ex/s are medians over rounds, ratios medians of per-round ratios.\n")
    print("| model | batch | steps/execution | per-example path | Keras ex/s (step / fit) "
          "| tfdp ex/s (step / fit) | DP/plain (step / fit) | per-fit ms (Keras / tfdp) |")
    print("|---" * 8 + "|")
    for name in args.only or throughput.ZOO:
        command = [sys.executable, __file__, "--child",
                   json.dumps([name, args.steps, args.rounds, jit, args.steps_per_execution])]
        done = subprocess.run(command, capture_output=True, text=True)
        batch = throughput.ZOO[name][0]
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["failed"])[-1]
            print(f"| {name} | {batch} | | fails: {last[:120]} |", flush=True)
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        figures = result["figures"]
        for spe in args.steps_per_execution:
            plain, dp = f"{spe}/plain", f"{spe}/dp"

            def med(key, field):
                return statistics.median(r[field] for r in figures[key])

            print(f"| {name} | {batch} | {spe} | {result['path']} "
                  f"| {med(plain, 'step'):.0f} / {med(plain, 'fit'):.0f} "
                  f"| {med(dp, 'step'):.0f} / {med(dp, 'fit'):.0f} "
                  f"| {median_ratio(figures, dp, plain, 'step'):.2f} / "
                  f"{median_ratio(figures, dp, plain, 'fit'):.2f} "
                  f"| {med(plain, 'per_fit_ms'):.0f} / {med(dp, 'per_fit_ms'):.0f} |", flush=True)


if __name__ == "__main__":
    main()
