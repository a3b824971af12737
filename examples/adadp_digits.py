"""AdaDP on scikit-learn's digits (8x8 images, 1437 training records).

Trains the 64-32-10 tanh MLP with AdaDP at epsilon = 3 (delta = 1e-5) and
prints test accuracy, the ledger's epsilon (the guarantee), the paper's
Theorem 1 epsilon (a reproduction, not a guarantee) and the last step's
phase and noise. The defaults are `tfdp train --mechanism adadp`'s
(`tfdp.optimizers.adadp.RECIPE_DEFAULTS["digits"]`).

`--tune` picks those defaults without touching the test split: it carves a
validation split (the last 20% of a fixed permutation of the training
records), trains on the rest for every (batch size, learning rate) of the
grid and two seeds, and prints the mean validation accuracy of each.

    python examples/adadp_digits.py
    python examples/adadp_digits.py --noise-shape public   # public set: first half of the test split
    python examples/adadp_digits.py --variant adal         # adaptive learning rate only
    python examples/adadp_digits.py --variant adan --learning-rate 2.0
    python examples/adadp_digits.py --tune --batch-sizes 64,128,256,512 --learning-rates 0.005,0.01,0.02,0.05
"""

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import tfdp
from tfdp import accounting, recipes
from tfdp.data import load_digits
from tfdp.optimizers.adadp import RECIPE_DEFAULTS


def train(train_data, eval_data, args, batch_size, learning_rate, seed, public=None):
    """Trains AdaDP at `args.epsilon` and returns (model, accuracy on eval_data)."""
    x_train, y_train = train_data
    q = batch_size / len(x_train)
    steps = args.epochs * max(1, round(len(x_train) / batch_size))
    sigma = accounting.calibrate_noise_multiplier(args.epsilon, args.delta, q, steps)
    if seed is not None:
        keras.utils.set_random_seed(seed)
    model = recipes.build_model("digits")
    shape = dict(noise_shape="public", public_data=public) if public is not None else {}
    optimizer = tfdp.optimizers.AdaDP(
        learning_rate=learning_rate, l2_norm_clip=args.l2_norm_clip,
        noise_multiplier=sigma, local_clipping=args.local_clipping,
        adaptive_noise=args.variant != "adal", adaptive_learning_rate=args.variant != "adan",
        gamma_prime=args.gamma_prime, seed=seed, **shape,
    )
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(
        x_train, y_train, batch_size=batch_size, epochs=args.epochs, verbose=0,
        callbacks=[tfdp.callbacks.PrivacyBudget(epsilon=args.epsilon, delta=args.delta)],
    )
    _, accuracy = model.evaluate(*eval_data, verbose=0)
    return model, history, sigma, accuracy


def tune(args, train_data):
    x, y = train_data
    order = np.random.default_rng(1234).permutation(len(x))
    cut = int(0.8 * len(x))
    fit_part = (x[order[:cut]], y[order[:cut]])
    validation = (x[order[cut:]], y[order[cut:]])
    print(f"Tuning on a validation split of the training data: {cut} training, "
          f"{len(x) - cut} validation records (the test split is not read); "
          f"{args.variant}, {args.local_clipping}, {args.noise_shape} shape, gamma' {args.gamma_prime}, "
          f"epsilon {args.epsilon}, {args.epochs} epochs, "
          f"seeds {args.seeds}\n")
    print("| batch size | learning rate | validation accuracy (mean over seeds) | per seed "
          "| last step's noise std spread / mean |")
    print("|---|---|---|---|---|", flush=True)
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        for learning_rate in [float(r) for r in args.learning_rates.split(",")]:
            runs = [train(fit_part, validation, args, batch_size, learning_rate, seed)
                    for seed in range(args.seeds)]
            scores = [r[3] for r in runs]
            ratios = [r[1].history["adadp_noise_std_spread"][-1] / r[1].history["adadp_noise_std_mean"][-1]
                      for r in runs]
            print(f"| {batch_size} | {learning_rate:g} | {statistics.mean(scores):.4f} | "
                  f"{', '.join(f'{s:.4f}' for s in scores)} | {statistics.mean(ratios):.2f} |",
                  flush=True)


def main():
    defaults = RECIPE_DEFAULTS["digits"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=defaults["batch_size"])
    parser.add_argument("--learning-rate", type=float, default=defaults["learning_rate"])
    parser.add_argument("--l2-norm-clip", type=float, default=1.0)
    parser.add_argument("--local-clipping", default="whitened_l2", choices=("whitened_l2", "coordinate"))
    parser.add_argument("--noise-shape", default="released", choices=("released", "public"))
    parser.add_argument("--gamma-prime", type=float, default=0.9, help="EMA weight of the old s")
    parser.add_argument("--variant", default="adadp", choices=("adadp", "adal", "adan"))
    parser.add_argument("--seed", type=int, default=None, help="reproducible noise (not private)")
    parser.add_argument("--tune", action="store_true", help="grid search on a validation split")
    parser.add_argument("--batch-sizes", default="64,128,256,512")
    parser.add_argument("--learning-rates", default="0.005,0.01,0.02,0.05")
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()

    (x_train, y_train), (x_test, y_test) = load_digits()
    if args.tune:
        tune(args, (x_train, y_train))
        return
    public = None
    if args.noise_shape == "public":
        # The public set: the test split's first half; accuracy on the second half.
        half = len(x_test) // 2
        public = (x_test[:half], y_test[:half])
        x_test, y_test = x_test[half:], y_test[half:]
    model, history, sigma, accuracy = train(
        (x_train, y_train), (x_test, y_test), args, args.batch_size, args.learning_rate,
        args.seed, public,
    )
    q = args.batch_size / len(x_train)
    logs = {k: v[-1] for k, v in history.history.items()}
    print(f"{args.variant} ({args.local_clipping}, {args.noise_shape} shape) on digits: "
          f"test accuracy {accuracy:.4f} on {len(x_test)} test records")
    print(f"epsilon (tfdp ledger, the guarantee) = {model.privacy.epsilon(args.delta):.3f} "
          f"at delta = {args.delta}, sigma* = {sigma:.3f}, {model.privacy.steps} steps")
    print(f"epsilon (paper Theorem 1, NOT a guarantee) = "
          f"{model.optimizer.paper_epsilon(args.delta, q, model.privacy.steps):.3f}")
    phase = "adaptive" if logs["adadp_phase"] >= 0.5 else "warm-up"
    print(f"last step: phase {phase}, noise std on the sum: mean "
          f"{logs['adadp_noise_std_mean']:.4g}, spread {logs['adadp_noise_std_spread']:.4g}")


if __name__ == "__main__":
    main()
