"""Time to a process's first DP step: a fresh interpreter's first and second fit.

Each round starts a new Python process per tree (`--trees`, each a tfdp
checkout put first on PYTHONPATH; the trees alternate, so load hits them
alike) that imports tfdp, fits a small MLP for 2 steps, then fits a new
model of the same shape. The first fit pays what a process pays once (its
checks' traces, and whatever converts or loads on first use) on top of what
every fit pays; the second shows the rest. Plain Keras's first fit of the
same model, in the same kind of process, is the reference. Prints medians
over `--rounds` and the CPU (`lscpu`).

    python benchmarks/first_fit.py --rounds 3
    python benchmarks/first_fit.py --trees /path/to/old /path/to/new --rounds 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
start = time.perf_counter()
import keras, numpy as np
import tfdp
imported = time.perf_counter() - start
rng = np.random.default_rng(0)
x, y = rng.normal(size=(512, 20)).astype("float32"), rng.integers(0, 3, 512)

def fit(private):
    layers = [keras.Input((20,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if private:
        model = tfdp.DPSequential(layers)
        model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0,
                                                      noise_multiplier=1.0), loss=loss)
    else:
        model = keras.Sequential(layers)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    begin = time.perf_counter()
    model.fit(x, y, batch_size=64, epochs=1, steps_per_epoch=2, verbose=0)
    return time.perf_counter() - begin

private = sys.argv[1] == "dp"
first = fit(private)
second = fit(private)
print(json.dumps({"import": imported, "first": first, "second": second,
                  "tfdp": tfdp.__file__}))
"""


def child(tree, kind):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in [env.get("PYTHONPATH")] if p])
    # Run from a neutral folder: `python -c` puts the working directory
    # first on sys.path, before PYTHONPATH (a checkout there would win).
    out = subprocess.run([sys.executable, "-c", CHILD, kind], env=env, check=True,
                         capture_output=True, text=True, cwd=tempfile.gettempdir()).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if tree and not os.path.realpath(result["tfdp"]).startswith(os.path.realpath(tree)):
        raise RuntimeError(f"the child imported {result['tfdp']}, not tfdp from {tree}")
    return result


def cpu_name():
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="*", default=[""],
                        help="tfdp checkouts to compare (default: the installed tfdp)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs = [("keras", "", "plain")] + [(tree or "installed tfdp", tree, "dp") for tree in args.trees]
    times = {label: [] for label, _, _ in runs}
    for _ in range(args.rounds):
        for label, tree, kind in runs:
            times[label].append(child(tree, kind))
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; {args.rounds} rounds, medians, seconds\n")
    print("| process | import | first fit | second fit |")
    print("|---|---|---|---|")
    for label, rows in times.items():
        med = {key: statistics.median(row[key] for row in rows)
               for key in ("import", "first", "second")}
        name = "plain Keras" if label == "keras" else f"tfdp DP ({label})"
        print(f"| {name} | {med['import']:.2f} | {med['first']:.2f} | {med['second']:.2f} |")


if __name__ == "__main__":
    main()
