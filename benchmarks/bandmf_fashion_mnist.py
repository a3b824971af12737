"""DP-BandMF (from a tf.data pipeline in a fixed order, and amplified by
cyclic Poisson sampling from arrays) against DP-SGD with Poisson sampling on
Fashion-MNIST, at the same epsilon (delta 1e-5).

Models and settings (the papers' where they exist):
- tanh CNN (MECHANISMS.md section 6, `tfdp.recipes`): SGD lr 4, momentum
  0.9, clip 0.1, batch 2048, 40 epochs;
- ScatterNet + linear (Tramer and Boneh 2021, `tfdp.recipes.SCATTERNET_DEFAULTS`):
  SGD lr 16, momentum 0.9, clip 0.1, batch 8192, 40 epochs; the features are
  computed once and cached under runs/ (as benchmarks/results.py does).
Both mechanisms use the same model, optimizer, clip, batch size and epochs:
- DP-SGD: Poisson sampling with q = B / N, sigma calibrated so that the
  planned epochs x round(N / B) steps spend epsilon (add-or-remove);
- DP-BandMF: `tf.data.Dataset.from_tensor_slices(...).shuffle(N, seed,
  reshuffle_each_iteration=False).batch(B, drop_remainder=True)`, P = N // B
  steps per epoch, `bands` (default P, the most the fixed order allows),
  the strategy optimised for the planned steps, sigma calibrated so that
  ceil(steps / P) = epochs Gaussian participations spend epsilon
  (`tfdp.accounting.bandmf.calibrate_fixed_order`, zero-out relation);
- DP-BandMF amplified (`--mechanisms bandmf_amplified`): `fit(x, y,
  batch_size=B)` on the arrays, `--amplified-bands` b (default 4, not
  tuned) secret groups, step t Poisson-samples group t mod b with
  q = B b / N (expected batch B, as DP-SGD's), round(N / B) steps per epoch,
  sigma calibrated so that ceil(steps / b) DP-SGD steps of rate q spend
  epsilon (`tfdp.accounting.bandmf.calibrate_amplified`, add-or-remove).
The guarantees are under different neighbouring relations (the table
says which); zero-out is what a fixed order allows (positions are public).
Every epsilon is read from the model's ledger after training.

Tuning: only `bands`, and only with `--tune-bands B1 B2 ...`: each candidate
trains on the training set less a validation split of 5,000 records (carved
with a fixed permutation), the best validation accuracy wins, then the run
trains on the full training set and reports the test accuracy. The tuning
runs themselves are not covered by the reported epsilon (as any tuning on
private data). Nothing else was tuned.

Printed: a Markdown table, one row per (model, epsilon, mechanism, seed),
then the mean over seeds, in the form of RESULTS.md's tables; each run is
also written to benchmarks/results/bandmf/NAME.json, and with `--output
FILE.md` the tables and the command are written to that file as well.

    python benchmarks/bandmf_fashion_mnist.py                     # 2 models x 2 eps x 3 mechs x 2 seeds x 40 epochs: hours
    python benchmarks/bandmf_fashion_mnist.py --epochs 1 --epsilons 3 --seeds 0 \\
        --models tanh_cnn --train-subset 12288                     # a smoke run (minutes)
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

import tfdp  # noqa: E402
from tfdp import recipes  # noqa: E402
from tfdp.accounting import bandmf as bandmf_accounting  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results", "bandmf")
DELTA = 1e-5
MECHANISMS = ("dpsgd", "bandmf", "bandmf_amplified")
NAMES = {"dpsgd": "DP-SGD (Poisson)", "bandmf": "DP-BandMF (fixed order)",
         "bandmf_amplified": "DP-BandMF (amplified)"}
VALIDATION = 5000
SETTINGS = {
    "tanh_cnn": dict(features="none", batch_size=2048, learning_rate=4.0, momentum=0.9,
                     l2_norm_clip=0.1),
    "scatternet": dict(features="scatternet", batch_size=8192, learning_rate=16.0,
                       momentum=0.9, l2_norm_clip=0.1),
}


class EpochClock(keras.callbacks.Callback):
    """Seconds per epoch (median over epochs after the first, which traces)."""

    def on_train_begin(self, logs=None):
        self.ends = [time.perf_counter()]

    def on_epoch_end(self, epoch, logs=None):
        self.ends.append(time.perf_counter())

    def seconds(self):
        laps = np.diff(self.ends)
        return float(np.median(laps[1:] if len(laps) > 1 else laps))


def inputs(model_name, data, subset):
    (x_train, y_train), (x_test, y_test) = data
    if subset:
        x_train, y_train = x_train[:subset], y_train[:subset]
    features = SETTINGS[model_name]["features"]
    if features != "none":
        x_train = cached_features(features, "train", x_train)
        x_test = cached_features(features, "test", x_test)
    return (x_train, y_train), (x_test, y_test)


def cached_features(features, split, images):
    path = os.path.join(ROOT, "runs", f"fashion_mnist_{features}_{split}_{len(images)}.npy")
    if os.path.exists(path):
        return np.load(path)
    (values,) = recipes.prepare_inputs("fashion_mnist", features, images)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.save(path, values)
    return values


def train(model_name, mechanism, epsilon, seed, epochs, train_data, eval_data, bands=None,
          verbose=0, amplified_bands=4):
    """One run; returns its result dict (accuracy on `eval_data`)."""
    settings = SETTINGS[model_name]
    x, y = train_data
    batch = settings["batch_size"]
    keras.utils.set_random_seed(seed)
    model = recipes.build_model("fashion_mnist", features=settings["features"])
    inner = keras.optimizers.SGD(settings["learning_rate"], momentum=settings["momentum"])
    clip = settings["l2_norm_clip"]
    if mechanism == "dpsgd":
        steps = epochs * max(1, round(len(x) / batch))
        sigma = tfdp.accounting.calibrate_noise_multiplier(epsilon, DELTA, batch / len(x), steps)
        optimizer = tfdp.optimizers.DPOptimizer(inner, clip, sigma, seed=seed)
        fit_args = dict(x=x, y=y, batch_size=batch)
        relation = "add or remove"
    elif mechanism == "bandmf_amplified":
        steps = epochs * max(1, round(len(x) / batch))
        bands = amplified_bands
        q = batch * bands / len(x)
        sigma = bandmf_accounting.calibrate_amplified(epsilon, DELTA, steps, bands, q)
        optimizer = tfdp.optimizers.DPBandMF(inner, clip, sigma, bands=bands, seed=seed)
        fit_args = dict(x=x, y=y, batch_size=batch)
        relation = "add or remove"
    else:
        per_epoch = len(x) // batch
        bands = per_epoch if bands is None else bands
        sigma = bandmf_accounting.calibrate_fixed_order(
            epsilon, DELTA, epochs * per_epoch, per_epoch, bands)
        optimizer = tfdp.optimizers.DPBandMF(inner, clip, sigma, bands=bands, seed=seed)
        dataset = (tf.data.Dataset.from_tensor_slices((x, y))
                   .shuffle(len(x), seed=seed, reshuffle_each_iteration=False)
                   .batch(batch, drop_remainder=True))
        fit_args = dict(x=dataset)
        relation = "zero-out"
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    clock = EpochClock()
    model.fit(**fit_args, epochs=epochs, verbose=verbose,
              callbacks=[clock, tfdp.callbacks.PrivacyBudget(epsilon=epsilon, delta=DELTA)])
    _, accuracy = model.evaluate(*eval_data, batch_size=2048, verbose=0)
    return {
        "model": model_name, "mechanism": mechanism, "target_epsilon": epsilon, "seed": seed,
        "epochs": epochs, "bands": bands, "noise_multiplier": sigma, "relation": relation,
        "accuracy": float(accuracy), "epsilon": model.privacy.epsilon(DELTA),
        "steps": model.privacy.steps, "seconds_per_epoch": clock.seconds(),
        "train_records": len(x), **settings,
    }


def tuned_bands(model_name, epsilon, seed, epochs, train_data, candidates, verbose):
    """The candidate with the best accuracy on a validation split of the
    training data (never the test set)."""
    x, y = train_data
    order = np.random.default_rng(1234).permutation(len(x))
    fit, held = order[:-VALIDATION], order[-VALIDATION:]
    scores = {}
    for bands in candidates:
        result = train(model_name, "bandmf", epsilon, seed, epochs, (x[fit], y[fit]),
                       (x[held], y[held]), bands=bands, verbose=verbose)
        scores[bands] = result["accuracy"]
        print(f"  tuning {model_name} eps={epsilon:g} seed={seed}: bands={bands} "
              f"validation acc {result['accuracy']:.4f}", file=sys.stderr, flush=True)
    return max(scores, key=scores.get), scores


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(SETTINGS), default=["tanh_cnn", "scatternet"])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--mechanisms", nargs="+", choices=MECHANISMS, default=list(MECHANISMS))
    parser.add_argument("--bands", type=int, default=None,
                        help="fixed-order DP-BandMF's bands (default: the steps per epoch)")
    parser.add_argument("--amplified-bands", type=int, default=4,
                        help="amplified DP-BandMF's bands (groups); q = batch * bands / N <= 1")
    parser.add_argument("--output", default=None,
                        help="also write the tables and the command to this Markdown file")
    parser.add_argument("--tune-bands", type=int, nargs="+", default=None,
                        help="choose bands among these on a validation split of the training data")
    parser.add_argument("--train-subset", type=int, default=None,
                        help="train on the first M records only (smoke runs; not the papers' setting)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--verbose", type=int, choices=(0, 1, 2), default=0)
    args = parser.parse_args(argv)
    absl_logging.set_verbosity(absl_logging.ERROR)

    data = tfdp.data.load_dataset("fashion_mnist", data_dir=args.data_dir)
    command = "python benchmarks/bandmf_fashion_mnist.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    rows = []
    lines = []

    def emit(line=""):
        print(line, flush=True)
        lines.append(line)

    emit("| model | epsilon | mechanism | seed | bands | sigma | test acc | epsilon spent "
         "(relation) | steps | s/epoch |")
    emit("|---|---|---|---|---|---|---|---|---|---|")
    for model_name in args.models:
        train_data, test_data = inputs(model_name, data, args.train_subset)
        for epsilon in args.epsilons:
            for seed in args.seeds:
                for mechanism in args.mechanisms:
                    bands = args.bands
                    if mechanism == "bandmf" and args.tune_bands:
                        bands, _ = tuned_bands(model_name, epsilon, seed, args.epochs,
                                               train_data, args.tune_bands, args.verbose)
                    result = train(model_name, mechanism, epsilon, seed, args.epochs,
                                   train_data, test_data, bands=bands, verbose=args.verbose,
                                   amplified_bands=args.amplified_bands)
                    result["command"] = command
                    rows.append(result)
                    save(result)
                    emit(f"| {model_name} | {epsilon:g} | {NAMES[mechanism]} | {seed} | "
                         f"{result['bands'] or '-'} | {result['noise_multiplier']:.3f} | "
                         f"{result['accuracy']:.4f} | {result['epsilon']:.3f} "
                         f"({result['relation']}) | {result['steps']} | "
                         f"{result['seconds_per_epoch']:.1f} |")
                    if args.output:  # the runs so far, should the rest not finish
                        write_output(args.output, lines + [""] + summary(rows, args, command))
    for line in [""] + summary(rows, args, command):
        emit(line)
    if args.output:
        write_output(args.output, lines)


def summary(rows, args, command):
    """The mean (and spread) over seeds, as Markdown lines, then the command."""
    out = ["| model | epsilon | " + " | ".join(f"{NAMES[m]} test acc %" for m in args.mechanisms)
           + " | seeds | epochs |",
           "|---|---|" + "---|" * len(args.mechanisms) + "---|---|"]
    for model_name in args.models:
        for epsilon in args.epsilons:
            cells = []
            for mechanism in args.mechanisms:
                values = [r["accuracy"] for r in rows if r["model"] == model_name
                          and r["target_epsilon"] == epsilon and r["mechanism"] == mechanism]
                spread = f" ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 else ""
                cells.append(f"{100 * statistics.mean(values):.1f}{spread}" if values else "-")
            seeds = len({r["seed"] for r in rows if r["model"] == model_name
                         and r["target_epsilon"] == epsilon})
            out.append(f"| {model_name} | {epsilon:g} | {' | '.join(cells)} | {seeds} | "
                       f"{args.epochs} |")
    return out + ["", f"Command: `{command}`"]


def write_output(path, lines):
    """The printed tables, with the machine they ran on, as a Markdown file."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as file:
            names = [line.split(":", 1)[1].strip() for line in file if line.startswith("model name")]
        cpu = f"{names[0]} x {len(names)}" if names else cpu
    except OSError:
        pass
    header = [
        "# DP-BandMF against DP-SGD on Fashion-MNIST (delta 1e-5)",
        "",
        f"Written by benchmarks/bandmf_fashion_mnist.py on {time.strftime('%Y-%m-%d')}, "
        f"CPU: {cpu}, TensorFlow {tf.__version__}. Test accuracy on the full test split; "
        "each epsilon read from the model's ledger after training.",
        "",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        file.write("\n".join(header + lines) + "\n")


def save(result):
    name = (f"{result['model']}_{result['mechanism']}_eps{result['target_epsilon']:g}_"
            f"seed{result['seed']}_epochs{result['epochs']}_n{result['train_records']}")
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(os.path.join(RESULTS_DIR, name + ".json"), "w") as file:
        json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
