"""SA-DPSGD on scikit-learn's 8x8 digits (offline, about a minute on 2 cores).

The public energy set is half of the held-out split (records never trained
on, which we declare public); accuracy is measured on the other half, which
the annealing never read. The noise is calibrated so that the planned steps
spend epsilon = 3 (delta = 1e-5) under the sound accounting, which charges
every candidate step, accepted or not.

    python examples/sadpsgd_digits.py
    python examples/sadpsgd_digits.py --epochs 40 --epsilon 2 --seed 1

Prints the test accuracy, the epsilon guaranteed (all T candidates), the
paper's claimed epsilon (accepted steps only, classic conversion: not a
guarantee), and tau / T.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp import recipes  # noqa: E402
from tfdp.data import load_digits  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--initial-temperature", type=float, default=10.0, help="Q0 (paper: 10)")
    parser.add_argument("--rejection-threshold", type=int, default=10, help="mu0 (paper: 10)")
    parser.add_argument("--seed", type=int, default=0, help="reproducible noise (not private: demo only)")
    args = parser.parse_args(argv)

    (x_train, y_train), (x_held, y_held) = load_digits()
    half = len(x_held) // 2
    x_public, y_public = x_held[:half], y_held[:half]  # the energy set
    x_test, y_test = x_held[half:], y_held[half:]  # never read by training

    settings = recipes.DEFAULTS["digits"]
    batch_size = settings["batch_size"]
    q = batch_size / len(x_train)
    steps = args.epochs * round(len(x_train) / batch_size)
    sigma = tfdp.accounting.calibrate_noise_multiplier(args.epsilon, args.delta, q, steps)

    keras.utils.set_random_seed(args.seed)
    model = recipes.build_model("digits")
    optimizer = tfdp.optimizers.SADPSGD(
        learning_rate=settings["learning_rate"],
        l2_norm_clip=settings["l2_norm_clip"],
        noise_multiplier=sigma,
        public_energy_data=(x_public, y_public),
        initial_temperature=args.initial_temperature,
        rejection_threshold=args.rejection_threshold,
        seed=args.seed,
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(
        x_train, y_train, batch_size=batch_size, epochs=args.epochs, verbose=2,
        callbacks=[tfdp.callbacks.PrivacyBudget(epsilon=args.epsilon, delta=args.delta)],
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    tau = int(optimizer.accepted_count.numpy())
    print(f"noise multiplier            {sigma:.4f}")
    print(f"test accuracy               {accuracy:.4f}  ({len(x_test)} examples)")
    print(f"epsilon (guarantee)         {model.privacy.epsilon(args.delta):.4f}  "
          f"(delta={args.delta}, all {model.privacy.steps} candidate steps)")
    print(f"paper-claimed epsilon       {optimizer.paper_claimed_epsilon(args.delta):.4f}  "
          f"(NOT a guarantee: {tau} accepted steps, classic conversion)")
    print(f"accepted / candidates       {tau} / {model.privacy.steps}")


if __name__ == "__main__":
    main()
