"""User-level against example-level DP-SGD on Fashion-MNIST split into people.

The question: when one person owns many records, what does protecting the
person cost, against the only alternative example-level DP offers, group
privacy? Fashion-MNIST's 60,000 training images are split into pseudo-users
(a fixed seed; the images are shuffled first, so a user's records are a
random sample, not one person's style):

- uniform: 6,000 users of 10 records.
- zipf: each user's record count drawn from a Zipf law truncated at 1,000
  records, P(n) proportional to n^-2 for n = 1 .. 1000 (numpy's
  `Generator.zipf(2.0)` with draws over 1,000 redrawn), drawn until the
  60,000 records are used (the last user gets what is left). With the split
  seed this gives 12,517 users, at most 945 records (one user), median 1,
  mean 4.8, 61% of users with one record (`splits` prints it).

Two ways to reach user-level (epsilon, delta), delta = 1e-5:

- "user": user-level DP-SGD, `fit(x, y, user_ids=ids, examples_per_user=k,
  batch_size=b)`. Each step samples users with q = b / U, takes k records
  of each, clips each user's gradient of their mean loss to 0.1 and adds
  noise once; sigma from `tfdp.accounting.calibrate_noise_multiplier` at
  (epsilon, delta, q = b / U, steps) with the PLD accountant (every sigma
  and epsilon here is PLD's: the RDP accountant's largest order cannot
  certify the Zipf split's per-record epsilon of about 0.001; past tfdp's
  calibration range, sigma 1e4, `calibrate` bisects with
  `tfdp.accounting.compute_epsilon`). k is fixed
  in advance, not tuned: 10 on the uniform split (every user's whole
  data), 4 on the Zipf split (a small value above its median of 1: its
  85th percentile, so most users' records all fit and heavy users give 4
  a step). b = round(2048 / k) users, so a step reads about 2,048 records
  like the example-level runs.
- "example": example-level DP-SGD (expected batch 2,048 records) calibrated
  so that its group-privacy bound for the LARGEST user, g records, meets the
  same user-level target. The standard group-privacy conversion:
  (eps, delta)-DP for one record implies (g eps, g e^((g - 1) eps) delta)-DP
  for groups of g records (chain the DP inequality over the g records one at
  a time: delta (1 + e^eps + ... + e^((g - 1) eps)) <= g e^((g - 1) eps) delta).
  So the per-record target is eps_rec = epsilon / g and delta_rec = delta /
  (g e^((g - 1) epsilon / g)). g = 10 (uniform) or 945 (zipf).

Model and settings (benchmarks/results.py's momentum rows, the papers'):
the tanh CNN of `tfdp.recipes.tanh_cnn`, SGD learning rate 4.0, momentum
0.9, clip 0.1. Every run takes the same number of steps, epochs x 29
(29 = round(60000 / 2048), an example-level epoch); a user-level "epoch"
is set to those 29 steps too (`steps_per_epoch=29`), so each run computes
the same number of per-record gradients. What is cut: 10 epochs instead of
the papers' 40 (this machine has 2 shared cores; the 16 runs fit in about
45 minutes), so the accuracies are below the 40-epoch figures in
RESULTS.md; each sigma is calibrated for the 290 steps actually run.
Nothing is tuned (no validation split is read); the test split is read
once per run, after training.

    nice -n 10 python benchmarks/user_level_fashion_mnist.py splits
    nice -n 10 python benchmarks/user_level_fashion_mnist.py run --split uniform --method user --epsilon 1 --seed 0
    nice -n 10 python benchmarks/user_level_fashion_mnist.py all    # the 16 runs, skipping those done
    python benchmarks/user_level_fashion_mnist.py table             # -> benchmarks/results/user_level_fashion_mnist.md
    nice -n 10 python benchmarks/user_level_fashion_mnist.py cost   # s/step at k = 1, 4, 16 (3 minutes)

Each run writes benchmarks/results/user_level/SPLIT_METHOD_epsE_seedS_epN.json
(a folder of its own: benchmarks/results.py reads every JSON directly in
benchmarks/results/).
"""

import argparse
import glob
import json
import math
import os
import shlex
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdp  # noqa: E402
from tfdp import recipes  # noqa: E402
from tfdp.data import load_fashion_mnist  # noqa: E402

from results import EpochLog  # noqa: E402  (benchmarks/results.py)

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS_DIR = os.path.join(HERE, "results", "user_level")
TABLE_PATH = os.path.join(HERE, "results", "user_level_fashion_mnist.md")

SPLITS = ("uniform", "zipf")
METHODS = ("user", "example")
EPSILONS = (1.0, 3.0)
SEEDS = (0, 1)
EPOCHS = 10
DELTA = 1e-5
RECORDS_PER_STEP = 2048
CLIP, LEARNING_RATE, MOMENTUM = 0.1, 4.0, 0.9
SPLIT_SEED = 0
# PLD for every calibration and bound: RDP's largest order cannot certify the
# Zipf split's per-record epsilon of about 0.001 (it gives 0.011 even at sigma 1e4).
ACCOUNTANT = "pld"
ZIPF_EXPONENT, ZIPF_MAX_RECORDS = 2.0, 1000
UNIFORM_RECORDS = 10
# Records a step uses of each sampled user, fixed in advance (module docstring).
EXAMPLES_PER_USER = {"uniform": 10, "zipf": 4}


def split_users(split, num_records):
    """One user id per record, for `split` ("uniform" or "zipf"); fixed seed."""
    rng = np.random.default_rng(SPLIT_SEED)
    if split == "uniform":
        counts = np.full(num_records // UNIFORM_RECORDS, UNIFORM_RECORDS)
    elif split == "zipf":
        counts, total = [], 0
        while total < num_records:
            n = int(rng.zipf(ZIPF_EXPONENT))
            if n > ZIPF_MAX_RECORDS:  # truncated Zipf: redraw
                continue
            n = min(n, num_records - total)
            counts.append(n)
            total += n
        counts = np.array(counts)
    else:
        raise ValueError(f"Expected split in {SPLITS}. Received: split={split!r}")
    if counts.sum() != num_records:
        raise ValueError(f"The split covers {counts.sum()} of {num_records} records")
    ids = np.empty(num_records, np.int64)
    ids[rng.permutation(num_records)] = np.repeat(np.arange(len(counts)), counts)
    return ids


def split_summary(ids):
    counts = np.bincount(ids)
    return {
        "users": int(len(counts)),
        "max_records": int(counts.max()),
        "median_records": float(np.median(counts)),
        "mean_records": float(counts.mean()),
        "users_with_one_record": float(np.mean(counts == 1)),
        "p85_records": float(np.percentile(counts, 85)),
    }


def group_conversion(epsilon, delta, group):
    """Per-record (eps, delta) whose group bound for `group` records is (epsilon, delta).

    (eps, d)-DP implies (g eps, g e^((g-1) eps) d)-DP for groups of g records.
    """
    eps_rec = epsilon / group
    return eps_rec, delta / (group * math.exp((group - 1) * eps_rec))


def group_bound(eps_rec, delta_rec, group):
    """The group-privacy (epsilon, delta) of an (eps_rec, delta_rec)-DP mechanism."""
    return group * eps_rec, group * math.exp((group - 1) * eps_rec) * delta_rec


def calibrate(epsilon, delta, q, steps):
    """The smallest noise multiplier with PLD epsilon <= `epsilon`: tfdp's
    calibration, which searches sigma in [1e-2, 1e4]; past 1e4 (the Zipf
    split's per-record epsilon of 0.001 over 290 steps), a bisection on
    log sigma over (1e4, 1e8] with `tfdp.accounting.compute_epsilon`,
    returning a sigma it evaluated as feasible."""
    try:
        return tfdp.accounting.calibrate_noise_multiplier(
            epsilon, delta, q, steps, accountant=ACCOUNTANT)
    except ValueError as error:
        if "cannot be reached" not in str(error):
            raise
    low, high = 1e4, 1e8  # infeasible, feasible

    def epsilon_at(sigma):
        return tfdp.accounting.compute_epsilon(sigma, q, steps, delta, accountant=ACCOUNTANT)

    if epsilon_at(high) > epsilon:
        raise ValueError(f"epsilon={epsilon} is out of reach even at sigma={high:g}")
    while high / low > 1.0001:
        middle = math.sqrt(low * high)
        low, high = (low, middle) if epsilon_at(middle) <= epsilon else (middle, high)
    return high


def group_bound_text(eps_rec, delta_rec, group):
    """`group_bound` as text, its delta as a power of 10 when it overflows a float."""
    log10_delta = (math.log(group) + (group - 1) * eps_rec + math.log(delta_rec)) / math.log(10)
    delta = f"{10 ** log10_delta:.3g}" if log10_delta < 6 else f"10^{log10_delta:.0f}"
    return f"({group * eps_rec:g}, {delta})"


def run_name(split, method, epsilon, seed, epochs):
    return f"{split}_{method}_eps{epsilon:g}_seed{seed}_ep{epochs}"


def run(split, method, epsilon, seed, epochs, verbose=2, command=None):
    """Trains one configuration and writes its JSON; returns the result dict."""
    (x, y), (x_test, y_test) = load_fashion_mnist()
    ids = split_users(split, len(x))
    summary = split_summary(ids)
    users, group = summary["users"], summary["max_records"]
    steps_per_epoch = round(len(x) / RECORDS_PER_STEP)
    steps = epochs * steps_per_epoch
    if method == "user":
        k = EXAMPLES_PER_USER[split]
        batch_size = round(RECORDS_PER_STEP / k)  # expected users a step
        q = batch_size / users
        target_epsilon, target_delta = epsilon, DELTA
        fit_args = dict(user_ids=ids, examples_per_user=k)
    elif method == "example":
        k, batch_size = None, RECORDS_PER_STEP
        q = batch_size / len(x)
        target_epsilon, target_delta = group_conversion(epsilon, DELTA, group)
        fit_args = {}
    else:
        raise ValueError(f"Expected method in {METHODS}. Received: method={method!r}")
    sigma = calibrate(target_epsilon, target_delta, q, steps)
    keras.utils.set_random_seed(seed)
    model = tfdp.DPSequential(recipes.tanh_cnn(), name="tanh_cnn")
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(
            LEARNING_RATE, momentum=MOMENTUM, l2_norm_clip=CLIP, noise_multiplier=sigma, seed=seed),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    log = EpochLog()
    budget = tfdp.callbacks.PrivacyBudget(target_epsilon, target_delta, accountant=ACCOUNTANT)
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, steps_per_epoch=steps_per_epoch,
              callbacks=[budget, log], verbose=verbose, **fit_args)
    train_seconds = time.perf_counter() - start
    # The test split, read once, after training.
    test_accuracy = float(model.evaluate(x_test, y_test, verbose=0)[1])
    spent = model.privacy.epsilon(target_delta, accountant=ACCOUNTANT)
    result = {
        "split": split,
        "method": method,
        "target_epsilon": epsilon,
        "delta": DELTA,
        "seed": seed,
        "epochs": epochs,
        "steps": int(model.privacy.steps),
        "planned_steps": steps,
        "users": users,
        "largest_user_records": group,
        "split_summary": summary,
        "examples_per_user": k,
        "batch_size": batch_size,
        "batch_size_counts": "users" if method == "user" else "records",
        "sampling_probability": q,
        "noise_multiplier": sigma,
        "accountant": ACCOUNTANT,
        "relation": model.privacy.relation,
        "mechanism_epsilon": spent,
        "mechanism_delta": target_delta,
        # User level: the ledger's epsilon is per person. Example level: the
        # group bound of the ledger's per-record (epsilon, delta) for the largest user.
        "user_level_bound": [spent, DELTA] if method == "user" else list(
            group_bound(spent, target_delta, group)),
        "test_accuracy": test_accuracy,
        "train_seconds": train_seconds,
        "seconds_per_epoch": float(np.median([r["seconds"] for r in log.rows[1:]] or [0.0])),
        "learning_rate": LEARNING_RATE,
        "momentum": MOMENTUM,
        "l2_norm_clip": CLIP,
        "history": log.rows,
        "command": command,
    }
    os.makedirs(RUNS_DIR, exist_ok=True)
    with open(os.path.join(RUNS_DIR, run_name(split, method, epsilon, seed, epochs) + ".json"),
              "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k not in ("history", "split_summary")}),
          flush=True)
    return result


def load_runs(epochs):
    runs = []
    for path in sorted(glob.glob(os.path.join(RUNS_DIR, f"*_ep{epochs}.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def table(epochs):
    """The markdown table of the runs with `epochs`, written to TABLE_PATH and printed."""
    runs = load_runs(epochs)
    groups = {}
    for r in runs:
        groups.setdefault((r["split"], r["target_epsilon"], r["method"]), []).append(r)
    ids = {split: split_summary(split_users(split, 60000)) for split in SPLITS}
    lines = [
        "Fashion-MNIST split into pseudo-users; user-level (epsilon, delta = 1e-5) for every row.",
        f"Splits: uniform, {ids['uniform']['users']:,} users of 10 records; zipf, record counts "
        f"P(n) ~ n^-{ZIPF_EXPONENT:g} truncated at {ZIPF_MAX_RECORDS}: "
        f"{ids['zipf']['users']:,} users, largest {ids['zipf']['max_records']} records, "
        f"median {ids['zipf']['median_records']:g}, mean {ids['zipf']['mean_records']:.1f}.",
        "'user': user-level DP-SGD (k records of each sampled user, per-user clipping; "
        "b = expected users a step, sigma calibrated at q = b / U). Every sigma and epsilon: "
        "the PLD accountant.",
        "'example': example-level DP-SGD (b = 2048 records) at eps_rec = epsilon / g, "
        "delta_rec = delta / (g e^((g-1) eps_rec)), so its group bound for the largest user "
        "(g records) is (epsilon, delta).",
        f"tanh CNN, SGD lr {LEARNING_RATE:g}, momentum {MOMENTUM:g}, clip {CLIP:g}; "
        f"{epochs} epochs of 29 steps (about 2,048 records a step) for every row; no tuning. "
        "Accuracy on the full test split (10,000), in %.",
        "",
        "| split | epsilon | method | k | b | ledger (epsilon, delta) | user-level bound "
        "| sigma | epochs (steps) | test accuracy (mean) | seed 0 | seed 1 | s/epoch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for split in SPLITS:
        for epsilon in EPSILONS:
            for method in METHODS:
                rows = sorted(groups.get((split, epsilon, method), []), key=lambda r: r["seed"])
                if not rows:
                    lines.append(f"| {split} | {epsilon:g} | {method} | | | | | | | not run | | | |")
                    continue
                r0 = rows[0]
                per_seed = {r["seed"]: f"{100 * r['test_accuracy']:.2f}" for r in rows}
                unit = "per person" if method == "user" else "per record"
                ledger = max(r["mechanism_epsilon"] for r in rows)
                bound = max(r["user_level_bound"][0] for r in rows)
                bound_delta = max(r["user_level_bound"][1] for r in rows)
                lines.append(
                    f"| {split} | {epsilon:g} | {method} | {r0['examples_per_user'] or '-'} "
                    f"| {r0['batch_size']} {r0['batch_size_counts']} "
                    f"| ({ledger:.5g}, {r0['mechanism_delta']:.3g}) {unit} "
                    f"| ({bound:.4f}, {bound_delta:.3g}) "
                    f"| {r0['noise_multiplier']:.3f} | {r0['epochs']} ({r0['steps']}) "
                    f"| {100 * statistics.mean(r['test_accuracy'] for r in rows):.2f} "
                    f"| {per_seed.get(0, '-')} | {per_seed.get(1, '-')} "
                    f"| {statistics.mean(r['seconds_per_epoch'] for r in rows):.0f} |"
                )
    lines += [
        "",
        "'user-level bound': the ledger's (epsilon, delta) for 'user' rows; for 'example' rows "
        "the group bound (g eps, g e^((g-1) eps) delta) of the ledger's per-record epsilon at "
        "delta_rec, g the largest user's records (max over the row's seeds). s/epoch: median "
        "epoch time on 2 CPU cores shared with other work (load varied).",
        "Read the other way, an example-level guarantee at delta 1e-5 says this about the "
        "largest user: "
        + "; ".join(
            f"{split} (g = {ids[split]['max_records']}): epsilon {e:g} per record gives "
            + group_bound_text(e, DELTA, ids[split]["max_records"])
            for split in SPLITS for e in EPSILONS)
        + " (a delta of 1 or more is no guarantee at all).",
    ]
    lines += [
        "",
        "Commands (each run writes benchmarks/results/user_level/NAME.json):",
        "",
        "```",
        f"nice -n 10 python benchmarks/user_level_fashion_mnist.py all --epochs {epochs}",
        f"python benchmarks/user_level_fashion_mnist.py table --epochs {epochs}",
        "```",
    ]
    text = "\n".join(lines) + "\n"
    with open(TABLE_PATH, "w") as f:
        f.write(text)
    print(text)


COST_USERS, COST_KS, COST_STEPS = 128, (1, 4, 16), 10
COST_PATH = os.path.join(HERE, "results", "user_level_cost.md")


def step_seconds(x, y, batch_size, fit_args):
    """Mean seconds of a train step of the tanh CNN (noise multiplier 1,
    not calibrated: cost only), over a second epoch of COST_STEPS steps
    after a first that traces and warms up."""
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential(recipes.tanh_cnn(), name="tanh_cnn")
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(LEARNING_RATE, momentum=MOMENTUM, l2_norm_clip=CLIP,
                                        noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    log = EpochLog()
    model.fit(x, y, batch_size=batch_size, epochs=2, steps_per_epoch=COST_STEPS,
              callbacks=[log], verbose=0, **fit_args)
    return log.rows[-1]["seconds"] / COST_STEPS


def cost():
    """Seconds a step at k = 1, 4, 16 records of 128 expected users (the
    uniform split; k = 16 repeats records), against record-level steps of
    the same expected number of records; writes COST_PATH."""
    (x, y), _ = load_fashion_mnist()
    ids = split_users("uniform", len(x))
    lines = [
        f"Seconds per train step of the tanh CNN (one epoch of {COST_STEPS} "
        "steps after a warm-up epoch), user-level at "
        f"{COST_USERS} expected users a step against record-level at the same expected "
        f"records a step ({os.cpu_count()} CPU cores, shared; run under nice).",
        "",
        "| k | users a step | records a step | user-level s/step | record-level s/step |",
        "|---|---|---|---|---|",
    ]
    for k in COST_KS:
        user = step_seconds(x, y, COST_USERS, dict(user_ids=ids, examples_per_user=k))
        record = step_seconds(x, y, COST_USERS * k, {})
        lines.append(f"| {k} | {COST_USERS} | {COST_USERS * k} | {user:.3f} | {record:.3f} |")
        print(lines[-1], flush=True)
    lines += ["", "Command: `nice -n 10 python benchmarks/user_level_fashion_mnist.py cost`"]
    text = "\n".join(lines) + "\n"
    with open(COST_PATH, "w") as f:
        f.write(text)
    print(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("splits", help="print the two splits' user counts")
    run_parser = commands.add_parser("run", help="one (split, method, epsilon, seed)")
    run_parser.add_argument("--split", choices=SPLITS, required=True)
    run_parser.add_argument("--method", choices=METHODS, required=True)
    run_parser.add_argument("--epsilon", type=float, required=True)
    run_parser.add_argument("--seed", type=int, default=0)
    run_parser.add_argument("--epochs", type=int, default=EPOCHS)
    run_parser.add_argument("--verbose", type=int, default=2)
    all_parser = commands.add_parser("all", help="every run not yet written, in order")
    all_parser.add_argument("--epochs", type=int, default=EPOCHS)
    all_parser.add_argument("--verbose", type=int, default=2)
    commands.add_parser("cost", help="seconds a step at several k (user_level_cost.md)")
    table_parser = commands.add_parser("table", help=f"write {os.path.relpath(TABLE_PATH, HERE)}")
    table_parser.add_argument("--epochs", type=int, default=EPOCHS)
    args = parser.parse_args()
    command = "python benchmarks/user_level_fashion_mnist.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:])
    if args.command == "splits":
        (x, _), _ = load_fashion_mnist()
        for split in SPLITS:
            ids = split_users(split, len(x))
            summary = split_summary(ids)
            group = summary["max_records"]
            print(split, json.dumps(summary), "example-level per-record (eps, delta) at "
                  + ", ".join(f"epsilon {e:g}: ({group_conversion(e, DELTA, group)[0]:.5f}, "
                              f"{group_conversion(e, DELTA, group)[1]:.3e})" for e in EPSILONS))
    elif args.command == "run":
        run(args.split, args.method, args.epsilon, args.seed, args.epochs, args.verbose, command)
    elif args.command == "all":
        for seed in SEEDS:
            for split in SPLITS:
                for epsilon in EPSILONS:
                    for method in METHODS:
                        name = run_name(split, method, epsilon, seed, args.epochs)
                        if os.path.exists(os.path.join(RUNS_DIR, name + ".json")):
                            continue
                        run(split, method, epsilon, seed, args.epochs, args.verbose,
                            f"{command} (run {name})")
    elif args.command == "cost":
        cost()
    else:
        table(args.epochs)


if __name__ == "__main__":
    main()
