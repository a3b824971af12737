"""AdaDP on Fashion-MNIST with the 4-layer tanh CNN (MECHANISMS.md section 6).

Trains at epsilon = 3 (delta = 1e-5) with Poisson batches of expected size
2048 and prints test accuracy, the ledger's epsilon (the guarantee), the
paper's Theorem 1 epsilon (a reproduction, not a guarantee) and the last
step's phase and noise.

The local clipping threshold G compares Var(sqrt(s)), in squared-gradient
units. The paper's G = 1e-6 suits its C = 4 and lot 600; here (C = 0.1,
batch 2048) the noisy statistic has Var(sqrt(s)) ~ 1e-10, so G = 1e-6 would
keep AdaDP in its warm-up (DP-SGD noise with the RMSprop step, i.e. ADAL)
for the whole run. The default below, 1e-14, lets local clipping start after
the first step; pass --local-clip-threshold 1e-6 for the paper's value.
The adaptive phase materializes per-example gradients (2200 x 26010 floats,
about 230 MB per step).

    python examples/adadp_fashion_mnist.py --epochs 5        # ~20 s/epoch on 2 CPU cores
    python examples/adadp_fashion_mnist.py --local-clipping coordinate   # the paper's box
    python examples/adadp_fashion_mnist.py --variant adal
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras

import tfdp
from tfdp import accounting, recipes
from tfdp.data import load_fashion_mnist


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--learning-rate", type=float, default=0.002)
    parser.add_argument("--l2-norm-clip", type=float, default=0.1)
    parser.add_argument("--local-clip-threshold", type=float, default=1e-14)
    parser.add_argument("--local-clipping", default="whitened_l2", choices=("whitened_l2", "coordinate"))
    parser.add_argument("--variant", default="adadp", choices=("adadp", "adal", "adan"))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--seed", type=int, default=None, help="reproducible noise (not private)")
    args = parser.parse_args()

    (x_train, y_train), (x_test, y_test) = load_fashion_mnist(args.data_dir)
    q = args.batch_size / len(x_train)
    steps = args.epochs * max(1, round(len(x_train) / args.batch_size))
    sigma = accounting.calibrate_noise_multiplier(args.epsilon, args.delta, q, steps)
    if args.seed is not None:
        keras.utils.set_random_seed(args.seed)
    model = recipes.build_model("fashion_mnist")
    optimizer = tfdp.optimizers.AdaDP(
        learning_rate=args.learning_rate, l2_norm_clip=args.l2_norm_clip,
        noise_multiplier=sigma, local_clip_threshold=args.local_clip_threshold,
        local_clipping=args.local_clipping, adaptive_noise=args.variant != "adal",
        adaptive_learning_rate=args.variant != "adan", seed=args.seed,
    )
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    started = time.perf_counter()
    history = model.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2,
        validation_data=(x_test, y_test),
        callbacks=[tfdp.callbacks.PrivacyBudget(epsilon=args.epsilon, delta=args.delta)],
    )
    seconds = time.perf_counter() - started
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    logs = {k: v[-1] for k, v in history.history.items()}
    print(f"{args.variant} ({args.local_clipping}) on Fashion-MNIST: test accuracy {accuracy:.4f}, "
          f"{seconds / len(history.epoch):.1f} s/epoch")
    print(f"epsilon (tfdp ledger, the guarantee) = {model.privacy.epsilon(args.delta):.3f} "
          f"at delta = {args.delta}, sigma* = {sigma:.3f}, {model.privacy.steps} steps")
    print(f"epsilon (paper Theorem 1, NOT a guarantee) = "
          f"{optimizer.paper_epsilon(args.delta, q, model.privacy.steps):.3f}")
    phase = "adaptive" if logs["adadp_phase"] >= 0.5 else "warm-up"
    print(f"last step: phase {phase}, noise std on the sum: mean "
          f"{logs['adadp_noise_std_mean']:.4g}, spread {logs['adadp_noise_std_spread']:.4g}")


if __name__ == "__main__":
    main()
