"""DPIS on scikit-learn's 8x8 digits (offline, about a minute on 2 cores).

DPIS (seed 002) samples records by gradient norm and chooses its noise
multiplier sigma_G every epoch so that all planned epochs spend at most
epsilon (here 3, delta 1e-5); everything it releases (N~ once, K~ per epoch,
every step) is in the model's privacy ledger. Digits is a public dataset, so
its size is public too: sigma_N = 0.02 * N is then the paper's setting
without reading anything private (with private data use 0.02 times a public
estimate of N).

    python examples/dpis_digits.py
    python examples/dpis_digits.py --epsilon 1 --epochs 20 --seed 1

Prints the test accuracy, the epsilon spent (tfdp's ledger: a guarantee for
everything DPIS released) and the per-epoch sigma_G / K~ schedule.
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
    parser.add_argument("--k", type=float, default=5.0, help="probability multiplier (paper: 5)")
    parser.add_argument("--epoch-divider", type=float, default=0.8, help="a_E (paper: 0.8)")
    parser.add_argument("--adaptive-clipping", action="store_true", help="section 3.5")
    parser.add_argument("--seed", type=int, default=0, help="reproducible noise (not private: demo only)")
    parser.add_argument("--verbose", type=int, choices=(0, 1, 2), default=2)
    args = parser.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = load_digits()
    settings = recipes.DEFAULTS["digits"]
    keras.utils.set_random_seed(args.seed)
    model = recipes.build_model("digits")
    optimizer = tfdp.optimizers.DPIS(
        learning_rate=settings["learning_rate"],
        l2_norm_clip=settings["l2_norm_clip"],
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        epochs=args.epochs,
        sigma_n=0.02 * len(x_train),  # digits is public, and so is its size
        k=args.k,
        epoch_divider=args.epoch_divider,
        adaptive_clipping=args.adaptive_clipping,
        seed=args.seed,
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(
        x_train, y_train, batch_size=settings["batch_size"], epochs=args.epochs,
        verbose=args.verbose,
        callbacks=[tfdp.callbacks.PrivacyBudget(epsilon=args.epsilon, delta=args.delta)],
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    schedule = optimizer.epoch_history
    print("epoch  sigma_G   K~/(N~ C)  C_e")
    for row in schedule:
        ratio = row["k_tilde"] / (row["n_tilde"] * row["clip_norm"])
        print(f"{row['epoch'] + 1:5d}  {row['sigma_g']:.4f}   {ratio:.3f}      {row['clip_norm']:.4g}")
    print(f"test accuracy   {accuracy:.4f}  ({len(x_test)} examples)")
    print(f"epsilon         {model.privacy.epsilon(args.delta):.4f}  (delta={args.delta}, "
          f"{model.privacy.steps} steps, N~ and {len(schedule)} K~ releases; target {args.epsilon})")


if __name__ == "__main__":
    main()
