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
  batch_size=B)` on the arrays, `--amplified-bands` b (default 4) secret
  groups, step t Poisson-samples group t mod b with q = B b / N (expected
  batch B, as DP-SGD's), round(N / B) steps per epoch, sigma calibrated so
  that ceil(steps / b) DP-SGD steps of rate q spend epsilon
  (`tfdp.accounting.bandmf.calibrate_amplified`, add-or-remove).
The guarantees are under different neighbouring relations (the table
says which); zero-out is what a fixed order allows (positions are public).
Every epsilon is read from the model's ledger after training.

Tuning: only `bands`, and only with `--tune-bands B1 B2 ...`. For each
(model, epsilon) and each DP-BandMF mechanism requested (fixed order and
amplified, separately), every candidate trains once, with seed 0, on the
training set less a validation split of 5,000 records (carved with a fixed
permutation) and is scored by its accuracy on that split; the best wins (the
fewer bands on a tie), and every seed's final run trains with it on the full
training set and reports the test accuracy. The test set is never used to
choose. A candidate must suit both the carved and the full training set:
bands <= steps per epoch for the fixed order, q = B b / N <= 1 for the
amplified mode (both amount to bands <= (N - 5,000) // B); the others are
skipped (named on stderr), and a mechanism with none left is refused before
anything trains. The tuning runs are not covered by the reported epsilon
(they train on the same private records, as any tuning on private data).
Nothing else was tuned: model, optimizer, learning rate, clip, batch size
and epochs are the settings above for every mechanism; DP-SGD has no bands.

Printed: each run's row as it ends (and each tuning run's validation
accuracy, and each choice), then a Markdown table, one row per (model,
epsilon, mechanism, seed), the mean over seeds, in the form of RESULTS.md's
tables, and with --tune-bands a third table: the bands chosen on the
validation split, with every candidate's validation accuracy. Each run is
written to benchmarks/results/bandmf/NAME.json as soon as it ends (with the
command, the device, TensorFlow's version and --jobs): a tuned final run as
NAME_tuned.json, with a "tuned_bands" record (candidates, validation
accuracy of each, chosen, tuning seed, validation records), each tuning run
as its own NAME_tune_b<bands>.json (its n is the carved training set's);
DP-SGD's runs keep their names (nothing of them is tuned), so the tables of
a tuned grid can take them from an untuned one (`--from-saved`).
With `--output FILE.md` the tables, the devices and the commands are written
to that file as well (rewritten after every run, so a cut grid keeps what
finished).

`--jobs K` trains K runs at a time in K spawned worker processes, each with
cpus // K TensorFlow threads and GPU memory taken as needed; the ScatterNet
features are computed once before, and the workers load them. The tuning
runs and the DP-SGD runs are ready at once, a tuned DP-BandMF final run as
soon as the tuning of its (model, epsilon, mechanism) has ended; of the
runs ready, the longest model's (tanh CNN) start first, and a model's
tuning runs before its final runs. A failed run is
reported (with its traceback) and the others go on (the final runs whose
tuning lost a run are not trained); the exit status is nonzero if any
failed. `--from-saved` trains nothing: it prints (and with --output writes)
the tables of the requested grid (--models, --epsilons, --seeds,
--mechanisms, --epochs, --train-subset, --tune-bands) from those JSON files,
and refuses, naming them, if some runs were not saved or were tuned among
other candidates.

    python benchmarks/bandmf_fashion_mnist.py                     # 2 models x 2 eps x 3 mechs x 2 seeds x 40 epochs: hours
    python benchmarks/bandmf_fashion_mnist.py --jobs 8            # the same grid 8 runs at a time (on a GPU)
    python benchmarks/bandmf_fashion_mnist.py --jobs 8 --tune-bands 2 4 8 16   # bands tuned first
    python benchmarks/bandmf_fashion_mnist.py --from-saved --output benchmarks/results/bandmf_fashion_mnist.md
    python benchmarks/bandmf_fashion_mnist.py --epochs 1 --epsilons 3 --seeds 0 \\
        --models tanh_cnn --train-subset 12288                     # a smoke run (minutes)
"""

import argparse
import collections
import json
import multiprocessing
import os
import shlex
import statistics
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

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
TUNABLE = ("bandmf", "bandmf_amplified")  # the mechanisms with bands (--tune-bands)
NAMES = {"dpsgd": "DP-SGD (Poisson)", "bandmf": "DP-BandMF (fixed order)",
         "bandmf_amplified": "DP-BandMF (amplified)"}
VALIDATION = 5000  # records carved from the training set to choose the bands on
SPLIT_SEED = 1234  # the fixed permutation that carves them
TUNING_SEED = 0  # the seed of every tuning run
TRAIN_RECORDS = 60000  # Fashion-MNIST's training split
COST = {"tanh_cnn": 4, "scatternet": 1}  # a run's relative time: --jobs starts the longest first
SETTINGS = {
    "tanh_cnn": dict(features="none", batch_size=2048, learning_rate=4.0, momentum=0.9,
                     l2_norm_clip=0.1),
    "scatternet": dict(features="scatternet", batch_size=8192, learning_rate=16.0,
                       momentum=0.9, l2_norm_clip=0.1),
}

# One training run. A final run (tuning False) trains on the training set and
# is evaluated on the test set; `tuned` is then the record of how its bands
# were chosen (or None). A tuning run trains with `bands` on the training set
# less the validation split and is evaluated on that split.
Task = collections.namedtuple("Task", "model epsilon seed mechanism bands tuning tuned")


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


def validation_split(train_data):
    """(the training data less the validation split, the validation split):
    the last VALIDATION records of a fixed permutation are held out."""
    x, y = train_data
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    fit, held = order[:-VALIDATION], order[-VALIDATION:]
    return (x[fit], y[fit]), (x[held], y[held])


def train(model_name, mechanism, epsilon, seed, epochs, train_data, eval_data, bands=None,
          verbose=0):
    """One run; returns its result dict (accuracy on `eval_data`). `bands`:
    the fixed order's (None: the steps per epoch) or the amplified mode's."""
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(SETTINGS), default=["tanh_cnn", "scatternet"])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--mechanisms", nargs="+", choices=MECHANISMS, default=list(MECHANISMS))
    parser.add_argument("--bands", type=int, default=None,
                        help="fixed-order DP-BandMF's bands (default: the steps per epoch)")
    parser.add_argument("--amplified-bands", type=int, default=None,
                        help="amplified DP-BandMF's bands (groups; default 4); "
                             "q = batch * bands / N <= 1")
    parser.add_argument("--output", default=None,
                        help="also write the tables and the command to this Markdown file")
    parser.add_argument("--tune-bands", type=int, nargs="+", default=None,
                        help="choose both DP-BandMF mechanisms' bands among these, per model and "
                             "epsilon, on a validation split of the training data (seed 0)")
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
    if args.tune_bands:
        if min(args.tune_bands) < 1:
            parser.error(f"--tune-bands takes band counts of at least 1. "
                         f"Received: tune_bands={args.tune_bands}")
        if args.bands is not None or args.amplified_bands is not None:
            parser.error("--tune-bands chooses the bands: give no --bands or --amplified-bands "
                         f"with it. Received: bands={args.bands}, "
                         f"amplified_bands={args.amplified_bands}")
    if args.amplified_bands is None:
        args.amplified_bands = 4
    args.candidates = tuning_candidates(args)
    command = "python benchmarks/bandmf_fashion_mnist.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))

    if args.from_saved:
        (rows, tuning_rows), failed, total = saved_rows(args), [], 0
    else:
        rows, tuning_rows, failed, total = train_grid(args, command)
    lines = tables(rows, tuning_rows, args, command)
    print("\n" + "\n".join(lines), flush=True)
    if args.output:
        write_output(args.output, lines, rows + tuning_rows)
    if failed:
        sys.exit(f"{len(failed)} of {total} runs failed or were not trained (tracebacks above): "
                 + ", ".join(task_name(task) for task in failed))


def grid(args):
    """The requested final runs, as (model, epsilon, seed, mechanism), in table order."""
    return [(model_name, epsilon, seed, mechanism) for model_name in args.models
            for epsilon in args.epsilons for seed in args.seeds for mechanism in args.mechanisms]


def tuned(args, mechanism):
    """Whether `mechanism`'s bands are chosen on the validation split."""
    return bool(args.tune_bands) and mechanism in TUNABLE


def tuning_groups(args):
    """The (model, epsilon, mechanism) whose bands are tuned, in table order."""
    return [(model_name, epsilon, mechanism) for model_name in args.models
            for epsilon in args.epsilons for mechanism in args.mechanisms
            if tuned(args, mechanism)]


def records_of(args):
    """The number of training records of the final runs."""
    return min(args.train_subset or TRAIN_RECORDS, TRAIN_RECORDS)


def feasible_bands(model_name, mechanism, candidates, records):
    """(the candidates `mechanism` allows both on `records` training records
    less the validation split and on all of them, ascending; those it does
    not; why). Fixed order: bands <= steps per epoch; amplified: q = batch *
    bands / N <= 1. The carved set is the smaller, so its limit holds for both,
    and for either mechanism it is (N - VALIDATION) // batch."""
    batch = SETTINGS[model_name]["batch_size"]
    carved = records - VALIDATION
    limit = max(carved, 0) // batch
    kept = sorted(bands for bands in set(candidates) if bands <= limit)
    skipped = sorted(bands for bands in set(candidates) if bands > limit)
    if mechanism == "bandmf":
        why = (f"the fixed order needs bands <= steps per epoch, {carved} // {batch} = {limit} "
               f"on the {carved} records left for tuning")
    else:
        why = (f"the amplified mode needs q = {batch} * bands / {carved} <= 1, so bands <= "
               f"{limit}, on the {carved} records left for tuning")
    return kept, skipped, why


def tuning_candidates(args):
    """{(model, mechanism): the --tune-bands candidates it allows} for the tuned
    mechanisms; says on stderr which were skipped, and exits naming the
    mechanisms that allow none."""
    candidates, refused = {}, []
    for model_name in args.models:
        for mechanism in args.mechanisms:
            if not tuned(args, mechanism):
                continue
            kept, skipped, why = feasible_bands(model_name, mechanism, args.tune_bands,
                                                records_of(args))
            if not kept:
                refused.append(f"{model_name} {NAMES[mechanism]} ({why})")
            elif skipped:
                print(f"--tune-bands: {model_name} {NAMES[mechanism]}: skipped bands "
                      f"{', '.join(map(str, skipped))}: {why}", file=sys.stderr, flush=True)
            candidates[model_name, mechanism] = kept
    if refused:
        sys.exit("--tune-bands: no candidate suits " + "; ".join(refused)
                 + f". Received: tune_bands={args.tune_bands}, train_subset={args.train_subset}")
    return candidates


def tuning_record(candidates, scores):
    """The "tuned_bands" record of a final run from the validation accuracy of
    each candidate (`scores`): the best wins, the fewer bands on a tie."""
    chosen = max(sorted(candidates), key=lambda bands: scores[bands])  # the first of the best
    return {"candidates": list(candidates),
            "validation_accuracy": {str(bands): scores[bands] for bands in candidates},
            "chosen": chosen, "tuning_seed": TUNING_SEED, "validation_records": VALIDATION}


class Plan:
    """The runs of the grid, and when each can start: the tuning runs and the
    final runs of untuned mechanisms at once; the final runs of a tuned
    (model, epsilon, mechanism) when its tuning runs have all ended, with the
    chosen bands. Of the runs ready, the longest model's start first, a
    tuning run before a final run, then in table order."""

    def __init__(self, args):
        self.args, self.ready, self.groups = args, [], {}
        for model_name, epsilon, seed, mechanism in grid(args):
            if not tuned(args, mechanism):
                bands = {"bandmf": args.bands, "bandmf_amplified": args.amplified_bands}
                self.ready.append(Task(model_name, epsilon, seed, mechanism,
                                       bands.get(mechanism), False, None))
                continue
            key = (model_name, epsilon, mechanism)
            if key not in self.groups:
                self.groups[key] = dict(candidates=args.candidates[model_name, mechanism],
                                        scores={}, failed=[], finals=[])
                self.ready += [Task(model_name, epsilon, TUNING_SEED, mechanism, bands, True, None)
                               for bands in self.groups[key]["candidates"]]
            self.groups[key]["finals"].append(
                Task(model_name, epsilon, seed, mechanism, None, False, None))
        self.total = len(self.ready) + sum(len(group["finals"]) for group in self.groups.values())

    def priority(self, task):
        args = self.args
        return (-COST[task.model], not task.tuning, args.models.index(task.model),
                args.epsilons.index(task.epsilon), args.mechanisms.index(task.mechanism),
                task.seed, task.bands or 0)

    def next(self):
        """The ready run to start next (taken off the ready ones), or None."""
        if not self.ready:
            return None
        task = min(self.ready, key=self.priority)
        self.ready.remove(task)
        return task

    def done(self, task, outcome):
        """Records how `task` ended (its result or its exception); returns (the
        tuning record, if this ended the tuning of its group, and the final runs
        given up because a tuning run of their group failed, each with why)."""
        if not task.tuning:
            return None, []
        group = self.groups[task.model, task.epsilon, task.mechanism]
        if isinstance(outcome, BaseException):
            group["failed"].append(task.bands)
        else:
            group["scores"][task.bands] = outcome["accuracy"]
        if len(group["scores"]) + len(group["failed"]) < len(group["candidates"]):
            return None, []
        if group["failed"]:
            error = RuntimeError(f"not trained: the tuning run(s) with bands {group['failed']} of "
                                 f"{task.model} eps={task.epsilon:g} {task.mechanism} failed")
            return None, [(final, error) for final in group["finals"]]
        record = tuning_record(group["candidates"], group["scores"])
        self.ready += [final._replace(bands=record["chosen"], tuned=record)
                       for final in group["finals"]]
        return record, []


def run_of(result):
    return result["model"], result["target_epsilon"], result["seed"], result["mechanism"]


def task_name(task):
    name = f"{task.model} eps={task.epsilon:g} seed={task.seed} {task.mechanism}"
    return name + f" (tuning, bands={task.bands})" if task.tuning else name


def train_grid(args, command):
    """Trains the requested runs (their tuning first where asked), printing each
    one's row as it ends; returns (the final runs' results, the tuning runs'
    results, the runs that failed or were given up, the number of runs)."""
    plan = Plan(args)
    rows, tuning_rows, failed = [], [], []
    for task, outcome in run_all(args, command, plan):
        record, given_up = plan.done(task, outcome)
        if isinstance(outcome, BaseException):
            print(f"FAILED: {task_name(task)}", file=sys.stderr, flush=True)
            traceback.print_exception(outcome)
            failed.append(task)
        elif task.tuning:
            tuning_rows.append(outcome)
            print(f"tuning: {task.model} eps={task.epsilon:g} {NAMES[task.mechanism]} "
                  f"bands={task.bands}: validation acc {outcome['accuracy']:.4f} "
                  f"(trained on {outcome['train_records']} records)", flush=True)
        else:
            rows.append(outcome)
            print(table_row(outcome), flush=True)
        if record:
            scores = ", ".join(f"{bands}: {accuracy:.4f}"
                               for bands, accuracy in record["validation_accuracy"].items())
            print(f"chosen: {task.model} eps={task.epsilon:g} {NAMES[task.mechanism]}: bands "
                  f"{record['chosen']} (validation acc by bands {scores})", flush=True)
        for final, error in given_up:
            print(f"FAILED: {task_name(final)}: {error}", file=sys.stderr, flush=True)
            failed.append(final)
        if args.output:  # the runs so far, should the rest not finish
            write_output(args.output, tables(rows, tuning_rows, args, command),
                         rows + tuning_rows)
    return rows, tuning_rows, failed, plan.total


def run_all(args, command, plan):
    """Yields (task, its result or the exception it raised) as runs end, in
    this process for --jobs 1, else in `args.jobs` worker processes. The
    caller reports each one to `plan.done` before taking the next, so that the
    runs it releases can start."""
    if args.jobs == 1:
        start_worker(args, command)
        while (task := plan.next()) is not None:
            try:
                yield task, train_task(task)
            except Exception as error:  # reported by train_grid; the other runs go on
                yield task, error
        return
    configure_tensorflow()
    data = tfdp.data.load_dataset("fashion_mnist", data_dir=args.data_dir)
    for model_name in args.models:  # cached under runs/ once, for the workers to load
        inputs(model_name, data, args.train_subset)
    threads = max(1, len(os.sched_getaffinity(0)) // args.jobs)
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=start_worker, initargs=(args, command, threads)) as pool:
        running = {}
        while True:
            while len(running) < args.jobs and (task := plan.next()) is not None:
                try:
                    running[pool.submit(train_task, task)] = task
                except BrokenProcessPool as error:  # a worker died: no run can start
                    yield task, error
            if not running:
                return
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                yield running.pop(future), future.exception() or future.result()


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
    """Prepares this process to train runs with `train_task`."""
    absl_logging.set_verbosity(absl_logging.ERROR)
    configure_tensorflow(threads)
    WORKER.update(args=args, command=command, inputs={},
                  data=tfdp.data.load_dataset("fashion_mnist", data_dir=args.data_dir))


def train_task(task):
    """Trains one run (a final run or a tuning run), saves and returns its result."""
    args = WORKER["args"]
    if task.model not in WORKER["inputs"]:
        WORKER["inputs"][task.model] = inputs(task.model, WORKER["data"], args.train_subset)
    train_data, eval_data = WORKER["inputs"][task.model]
    if task.tuning:
        train_data, eval_data = validation_split(train_data)
    result = train(task.model, task.mechanism, task.epsilon, task.seed, args.epochs, train_data,
                   eval_data, bands=task.bands, verbose=args.verbose)
    result.update(command=WORKER["command"], device=device_name(), tensorflow=tf.__version__,
                  jobs=args.jobs)
    if task.tuning:
        result.update(tuning_run=True, validation_records=VALIDATION, evaluated_on=(
            f"validation split: {VALIDATION} records carved from the {records_of(args)} training "
            f"records (permutation seed {SPLIT_SEED}); not covered by the final runs' epsilon"))
    if task.tuned:
        result["tuned_bands"] = task.tuned
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
    """The saved results of the requested final runs and of their tuning runs;
    exits naming the runs not saved, or tuned otherwise than the saved tuning
    runs of the requested candidates say."""
    records = records_of(args)
    finals = [result_path(*run, args.epochs, records, "_tuned" if tuned(args, run[3]) else "")
              for run in grid(args)]
    tunings = [result_path(model_name, epsilon, TUNING_SEED, mechanism, args.epochs,
                           records - VALIDATION, f"_tune_b{bands}")
               for model_name, epsilon, mechanism in tuning_groups(args)
               for bands in args.candidates[model_name, mechanism]]
    missing = [os.path.relpath(path, ROOT) for path in finals + tunings
               if not os.path.exists(path)]
    if missing:
        sys.exit(f"--from-saved: {len(missing)} of the {len(finals) + len(tunings)} requested "
                 f"runs have no saved result: {', '.join(missing)}")
    rows, tuning_rows = [load(path) for path in finals], [load(path) for path in tunings]
    scores = {(row["model"], row["target_epsilon"], row["mechanism"], row["bands"]):
              row["accuracy"] for row in tuning_rows}
    mismatched = []
    for path, row in zip(finals, rows):
        if tuned(args, row["mechanism"]):
            candidates = args.candidates[row["model"], row["mechanism"]]
            expected = tuning_record(candidates, {
                bands: scores[row["model"], row["target_epsilon"], row["mechanism"], bands]
                for bands in candidates})
            saved = row.get("tuned_bands")
            if saved != expected:
                mismatched.append(f"{os.path.relpath(path, ROOT)} ("
                                  + (f"tuned among {saved['candidates']}, chose {saved['chosen']}"
                                     if saved else "not tuned") + ")")
    if mismatched:
        sys.exit("--from-saved: these runs were not tuned by the saved tuning runs of the "
                 f"requested candidates: {'; '.join(mismatched)}. "
                 f"Received: tune_bands={args.tune_bands}")
    return rows, tuning_rows


def load(path):
    with open(path) as file:
        return json.load(file)


def table_row(result):
    return (f"| {result['model']} | {result['target_epsilon']:g} | {NAMES[result['mechanism']]} | "
            f"{result['seed']} | {result['bands'] or '-'} | {result['noise_multiplier']:.3f} | "
            f"{result['accuracy']:.4f} | {result['epsilon']:.3f} ({result['relation']}) | "
            f"{result['steps']} | {result['seconds_per_epoch']:.1f} |")


def tables(rows, tuning_rows, args, command):
    """The per-run table (in grid order), the mean over seeds, the bands chosen
    (with --tune-bands) and the commands, as Markdown lines."""
    order = {run: position for position, run in enumerate(grid(args))}
    lines = (["| model | epsilon | mechanism | seed | bands | sigma | test acc | epsilon spent "
              "(relation) | steps | s/epoch |",
              "|---|---|---|---|---|---|---|---|---|---|"]
             + [table_row(row) for row in sorted(rows, key=lambda row: order[run_of(row)])]
             + [""] + summary(rows, args))
    if tuning_groups(args):
        lines += [""] + tuning_table(tuning_rows, args)
    return lines + [""] + commands(rows + tuning_rows, command)


def column_name(args, mechanism):
    """The summary's column name of `mechanism`, saying whether its bands were tuned."""
    name = NAMES[mechanism]
    return name[:-1] + ", bands tuned)" if tuned(args, mechanism) else name


def summary(rows, args):
    """The mean (and spread) over seeds, as Markdown lines."""
    out = ["| model | epsilon | " + " | ".join(f"{column_name(args, m)} test acc %"
                                               for m in args.mechanisms) + " | seeds | epochs |",
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
    return out


def tuning_table(tuning_rows, args):
    """The bands chosen on the validation split, with every candidate's
    validation accuracy (the chosen one's in bold), as Markdown lines."""
    out = [f"Bands chosen on the validation split ({VALIDATION:,} records carved from the "
           f"training data; one run per candidate, seed {TUNING_SEED}, trained on the rest; "
           "these tuning runs are not covered by the epsilons above):",
           "",
           "| model | epsilon | mechanism | bands chosen | validation accuracy by bands |",
           "|---|---|---|---|---|"]
    for model_name, epsilon, mechanism in tuning_groups(args):
        candidates = args.candidates[model_name, mechanism]
        scores = {row["bands"]: row["accuracy"] for row in tuning_rows
                  if (row["model"], row["target_epsilon"], row["mechanism"])
                  == (model_name, epsilon, mechanism)}
        chosen = (tuning_record(candidates, scores)["chosen"]
                  if len(scores) == len(candidates) else None)
        cells = ", ".join(f"{bands}: -" if bands not in scores else
                          f"{bands}: **{scores[bands]:.4f}**" if bands == chosen else
                          f"{bands}: {scores[bands]:.4f}" for bands in candidates)
        out.append(f"| {model_name} | {epsilon:g} | {NAMES[mechanism]} | "
                   f"{chosen or '(tuning)'} | {cells} |")
    return out


def commands(rows, command):
    """The commands that trained `rows` and printed the tables (one if the same)."""
    trained = list(dict.fromkeys(row["command"] for row in rows))
    if set(trained) <= {command}:
        return [f"Command: `{command}`"]
    return ["Command: " + ", ".join(f"`{c}`" for c in trained)
            + f" (training), then `{command}` (these tables)"]


def write_output(path, lines, rows):
    """The tables, with the device(s) their runs (`rows`: the final and the
    tuning runs) trained on, as a Markdown file."""
    devices = ", ".join(dict.fromkeys(row.get("device", "not recorded") for row in rows))
    versions = ", ".join(dict.fromkeys(row.get("tensorflow", "not recorded") for row in rows))
    jobs = max((row.get("jobs", 1) for row in rows), default=1)
    shared = (f"; up to {jobs} runs at a time shared it (--jobs {jobs}), so s/epoch is under "
              "that load" if jobs > 1 else "")
    tuning = (" DP-BandMF's bands were chosen on a validation split carved from the training "
              "data (the last table); those tuning runs are not covered by the epsilons reported."
              if any(row.get("tuning_run") for row in rows) else "")
    header = [
        "# DP-BandMF against DP-SGD on Fashion-MNIST (delta 1e-5)",
        "",
        f"Written by benchmarks/bandmf_fashion_mnist.py on {time.strftime('%Y-%m-%d')}. Trained "
        f"on: {devices}; TensorFlow {versions}{shared}. Test accuracy on the full test split; "
        f"each epsilon read from the model's ledger after training.{tuning}",
        "",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        file.write("\n".join(header + lines) + "\n")


def result_path(model_name, epsilon, seed, mechanism, epochs, records, suffix=""):
    """A run's JSON file; `suffix`: "_tuned" for a final run with tuned bands,
    "_tune_b<bands>" for a tuning run (then `records` is the carved set's)."""
    return os.path.join(RESULTS_DIR, f"{model_name}_{mechanism}_eps{epsilon:g}_seed{seed}_"
                                     f"epochs{epochs}_n{records}{suffix}.json")


def save(result):
    """Writes `result` to its JSON file (whole: a run cut while writing leaves none)."""
    suffix = (f"_tune_b{result['bands']}" if result.get("tuning_run")
              else "_tuned" if "tuned_bands" in result else "")
    path = result_path(*run_of(result), result["epochs"], result["train_records"], suffix)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(path + ".part", "w") as file:
        json.dump(result, file, indent=1)
    os.replace(path + ".part", path)


if __name__ == "__main__":
    main()
