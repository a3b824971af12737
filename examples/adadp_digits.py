"""AdaDP on scikit-learn's digits (8x8 images, 1437 training records).

Trains the 64-32-10 tanh MLP with AdaDP at epsilon = 3 (delta = 1e-5) and
prints test accuracy, the ledger's epsilon (the guarantee), the paper's
Theorem 1 epsilon (a reproduction, not a guarantee) and the last step's
phase and noise. A large expected batch (512) keeps
beta^2 sigma*^2 d / b^2 below 1 (see `tfdp.optimizers.AdaDP`).

    python examples/adadp_digits.py
    python examples/adadp_digits.py --local-clipping whitened_l2 --learning-rate 0.03
    python examples/adadp_digits.py --variant adal     # adaptive learning rate only
    python examples/adadp_digits.py --variant adan --learning-rate 2.0
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras

import tfdp
from tfdp import accounting, recipes
from tfdp.data import load_digits


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--l2-norm-clip", type=float, default=1.0)
    parser.add_argument("--local-clipping", default="coordinate", choices=("coordinate", "whitened_l2"))
    parser.add_argument("--variant", default="adadp", choices=("adadp", "adal", "adan"))
    parser.add_argument("--seed", type=int, default=None, help="reproducible noise (not private)")
    args = parser.parse_args()

    (x_train, y_train), (x_test, y_test) = load_digits()
    q = args.batch_size / len(x_train)
    steps = args.epochs * max(1, round(len(x_train) / args.batch_size))
    sigma = accounting.calibrate_noise_multiplier(args.epsilon, args.delta, q, steps)
    if args.seed is not None:
        keras.utils.set_random_seed(args.seed)
    model = recipes.build_model("digits")
    optimizer = tfdp.optimizers.AdaDP(
        learning_rate=args.learning_rate, l2_norm_clip=args.l2_norm_clip,
        noise_multiplier=sigma, local_clipping=args.local_clipping,
        adaptive_noise=args.variant != "adal", adaptive_learning_rate=args.variant != "adan",
        seed=args.seed,
    )
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
        callbacks=[tfdp.callbacks.PrivacyBudget(epsilon=args.epsilon, delta=args.delta)],
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    logs = {k: v[-1] for k, v in history.history.items()}
    print(f"{args.variant} ({args.local_clipping}) on digits: test accuracy {accuracy:.4f}")
    print(f"epsilon (tfdp ledger, the guarantee) = {model.privacy.epsilon(args.delta):.3f} "
          f"at delta = {args.delta}, sigma* = {sigma:.3f}, {model.privacy.steps} steps")
    print(f"epsilon (paper Theorem 1, NOT a guarantee) = "
          f"{optimizer.paper_epsilon(args.delta, q, model.privacy.steps):.3f}")
    phase = "adaptive" if logs["adadp_phase"] >= 0.5 else "warm-up"
    print(f"last step: phase {phase}, noise std on the sum: mean "
          f"{logs['adadp_noise_std_mean']:.4g}, spread {logs['adadp_noise_std_spread']:.4g}")


if __name__ == "__main__":
    main()
