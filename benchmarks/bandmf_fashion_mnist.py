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

Printed: each run's row as it ends, then a Markdown table, one row per
(model, epsilon, mechanism, seed), and the mean over seeds, in the form of
RESULTS.md's tables. Each run is written to benchmarks/results/bandmf/NAME.json
as soon as it ends (with the command, the device, TensorFlow's version and
--jobs), and with `--output FILE.md` the tables, the devices and the commands
are written to that file as well (rewritten after every run, so a cut grid
keeps what finished).

`--jobs K` trains K runs at a time in K spawned worker processes (the
longest runs first; a worker takes the next run when its run ends), each
with cpus // K TensorFlow threads and GPU memory taken as needed; the
ScatterNet features are computed once before, and the workers load them. A
failed run is reported (with its traceback) and the others go on; the exit
status is nonzero if any failed. `--from-saved` trains nothing: it prints
(and with --output writes) the tables of the requested grid (--models,
--epsilons, --seeds, --mechanisms, --epochs, --train-subset) from those JSON
files, and refuses, naming them, if some runs were not saved.

    python benchmarks/bandmf_fashion_mnist.py                     # 2 models x 2 eps x 3 mechs x 2 seeds x 40 epochs: hours
    python benchmarks/bandmf_fashion_mnist.py --jobs 8            # the same grid 8 runs at a time (on a GPU)
    python benchmarks/bandmf_fashion_mnist.py --from-saved --output benchmarks/results/bandmf_fashion_mnist.md
    python benchmarks/bandmf_fashion_mnist.py --epochs 1 --epsilons 3 --seeds 0 \\
        --models tanh_cnn --train-subset 12288                     # a smoke run (minutes)
"""

import argparse
import json
import multiprocessing
import os
import shlex
import statistics
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed

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
TRAIN_RECORDS = 60000  # Fashion-MNIST's training split
COST = {"tanh_cnn": 4, "scatternet": 1}  # a run's relative time: --jobs starts the longest first
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
    parser.add_argument("--jobs", type=int, default=1,
                        help="train this many runs at a time, in worker processes sharing the "
                             "CPU threads and the GPU")
    parser.add_argument("--from-saved", action="store_true",
                        help="train nothing: the tables of the requested runs from their JSON "
                             "files in benchmarks/results/bandmf/")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1. Received: jobs={args.jobs}")
    command = "python benchmarks/bandmf_fashion_mnist.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))

    rows, failed = (saved_rows(args), []) if args.from_saved else train_grid(args, command)
    lines = tables(rows, args, command)
    print("\n" + "\n".join(lines), flush=True)
    if args.output:
        write_output(args.output, lines, rows)
    if failed:
        sys.exit(f"{len(failed)} of {len(grid(args))} runs failed (tracebacks above): "
                 + ", ".join(run_name(run) for run in failed))


def grid(args):
    """The requested runs, as (model, epsilon, seed, mechanism), in table order."""
    return [(model_name, epsilon, seed, mechanism) for model_name in args.models
            for epsilon in args.epsilons for seed in args.seeds for mechanism in args.mechanisms]


def run_of(result):
    return result["model"], result["target_epsilon"], result["seed"], result["mechanism"]


def run_name(run):
    model_name, epsilon, seed, mechanism = run
    return f"{model_name} eps={epsilon:g} seed={seed} {mechanism}"


def train_grid(args, command):
    """Trains the requested runs, printing each one's row as it ends; returns
    (their results, the runs that failed)."""
    rows, failed = [], []
    for run, outcome in run_all(args, grid(args), command):
        if isinstance(outcome, BaseException):
            print(f"FAILED: {run_name(run)}", file=sys.stderr, flush=True)
            traceback.print_exception(outcome)
            failed.append(run)
            continue
        rows.append(outcome)
        print(table_row(outcome), flush=True)
        if args.output:  # the runs so far, should the rest not finish
            write_output(args.output, tables(rows, args, command), rows)
    return rows, failed


def run_all(args, runs, command):
    """Yields (run, its result or the exception it raised) as runs end: in this
    process for --jobs 1, else in `args.jobs` worker processes."""
    if args.jobs == 1:
        start_worker(args, command)
        for run in runs:
            try:
                yield run, train_run(run)
            except Exception as error:  # reported by train_grid; the other runs go on
                yield run, error
        return
    configure_tensorflow()
    data = tfdp.data.load_dataset("fashion_mnist", data_dir=args.data_dir)
    for model_name in args.models:  # cached under runs/ once, for the workers to load
        inputs(model_name, data, args.train_subset)
    threads = max(1, len(os.sched_getaffinity(0)) // args.jobs)
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=start_worker, initargs=(args, command, threads)) as pool:
        futures = {pool.submit(train_run, run): run
                   for run in sorted(runs, key=lambda run: COST[run[0]], reverse=True)}
        for future in as_completed(futures):
            yield futures[future], future.exception() or future.result()


def configure_tensorflow(threads=None):
    """GPU memory taken as needed (so that processes can share a GPU) and, if
    given, `threads` TensorFlow threads; before TensorFlow initialises."""
    for gpu in tf.config.list_physical_devices("GPU"):
        tf.config.experimental.set_memory_growth(gpu, True)
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)


WORKER = {}  # this process's arguments, command, data and model inputs (start_worker)


def start_worker(args, command, threads=None):
    """Prepares this process to train runs with `train_run`."""
    absl_logging.set_verbosity(absl_logging.ERROR)
    configure_tensorflow(threads)
    WORKER.update(args=args, command=command, inputs={},
                  data=tfdp.data.load_dataset("fashion_mnist", data_dir=args.data_dir))


def train_run(run):
    """Trains one run of the grid (tuning its bands if asked), saves and returns its result."""
    args = WORKER["args"]
    model_name, epsilon, seed, mechanism = run
    if model_name not in WORKER["inputs"]:
        WORKER["inputs"][model_name] = inputs(model_name, WORKER["data"], args.train_subset)
    train_data, test_data = WORKER["inputs"][model_name]
    bands = args.bands
    if mechanism == "bandmf" and args.tune_bands:
        bands, _ = tuned_bands(model_name, epsilon, seed, args.epochs, train_data,
                               args.tune_bands, args.verbose)
    result = train(model_name, mechanism, epsilon, seed, args.epochs, train_data, test_data,
                   bands=bands, verbose=args.verbose, amplified_bands=args.amplified_bands)
    result.update(command=WORKER["command"], device=device_name(), tensorflow=tf.__version__,
                  jobs=args.jobs)
    save(result)
    return result


def device_name():
    """The GPU this process trains on, with TensorFloat-32's state (read after
    a fit, which turns it off), or else the CPU."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", gpus[0].name)
        tf32 = (tf.config.experimental.tensor_float_32_execution_enabled()
                and os.environ.get("NVIDIA_TF32_OVERRIDE") != "0")
        return f"{name} ({'TF32 on' if tf32 else 'TF32 off'})"
    try:
        with open("/proc/cpuinfo") as file:
            names = [line.split(":", 1)[1].strip() for line in file if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0]} x {len(names)}" if names else f"CPU ({os.cpu_count()} threads)"


def saved_rows(args):
    """The saved results of the requested runs; exits naming the runs not saved."""
    records = min(args.train_subset or TRAIN_RECORDS, TRAIN_RECORDS)
    paths = [result_path(*run, args.epochs, records) for run in grid(args)]
    missing = [os.path.relpath(path, ROOT) for path in paths if not os.path.exists(path)]
    if missing:
        sys.exit(f"--from-saved: {len(missing)} of the {len(paths)} requested runs have no "
                 f"saved result: {', '.join(missing)}")
    rows = []
    for path in paths:
        with open(path) as file:
            rows.append(json.load(file))
    return rows


def table_row(result):
    return (f"| {result['model']} | {result['target_epsilon']:g} | {NAMES[result['mechanism']]} | "
            f"{result['seed']} | {result['bands'] or '-'} | {result['noise_multiplier']:.3f} | "
            f"{result['accuracy']:.4f} | {result['epsilon']:.3f} ({result['relation']}) | "
            f"{result['steps']} | {result['seconds_per_epoch']:.1f} |")


def tables(rows, args, command):
    """The per-run table (in grid order), the mean over seeds and the commands,
    as Markdown lines."""
    order = {run: position for position, run in enumerate(grid(args))}
    return (["| model | epsilon | mechanism | seed | bands | sigma | test acc | epsilon spent "
             "(relation) | steps | s/epoch |",
             "|---|---|---|---|---|---|---|---|---|---|"]
            + [table_row(row) for row in sorted(rows, key=lambda row: order[run_of(row)])]
            + [""] + summary(rows, args, command))


def summary(rows, args, command):
    """The mean (and spread) over seeds, as Markdown lines, then the commands
    that trained the runs and printed the tables (one if the same)."""
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
    trained = list(dict.fromkeys(row["command"] for row in rows))
    if set(trained) <= {command}:
        return out + ["", f"Command: `{command}`"]
    return out + ["", "Command: " + ", ".join(f"`{c}`" for c in trained)
                  + f" (training), then `{command}` (these tables)"]


def write_output(path, lines, rows):
    """The tables, with the device(s) their runs trained on, as a Markdown file."""
    devices = ", ".join(dict.fromkeys(row.get("device", "not recorded") for row in rows))
    versions = ", ".join(dict.fromkeys(row.get("tensorflow", "not recorded") for row in rows))
    jobs = max((row.get("jobs", 1) for row in rows), default=1)
    shared = (f"; up to {jobs} runs at a time shared it (--jobs {jobs}), so s/epoch is under "
              "that load" if jobs > 1 else "")
    header = [
        "# DP-BandMF against DP-SGD on Fashion-MNIST (delta 1e-5)",
        "",
        f"Written by benchmarks/bandmf_fashion_mnist.py on {time.strftime('%Y-%m-%d')}. Trained "
        f"on: {devices}; TensorFlow {versions}{shared}. Test accuracy on the full test split; "
        "each epsilon read from the model's ledger after training.",
        "",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        file.write("\n".join(header + lines) + "\n")


def result_path(model_name, epsilon, seed, mechanism, epochs, records):
    return os.path.join(RESULTS_DIR, f"{model_name}_{mechanism}_eps{epsilon:g}_seed{seed}_"
                                     f"epochs{epochs}_n{records}.json")


def save(result):
    """Writes `result` to its JSON file (whole: a run cut while writing leaves none)."""
    path = result_path(*run_of(result), result["epochs"], result["train_records"])
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(path + ".part", "w") as file:
        json.dump(result, file, indent=1)
    os.replace(path + ".part", path)


if __name__ == "__main__":
    main()
