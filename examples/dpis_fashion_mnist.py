"""DPIS on Fashion-MNIST with the 4-layer tanh CNN (long on 2 CPU cores).

The paper's Table 2 settings for Fashion-MNIST: k = 5, a_E = 1 (the whole run
plans future epochs with the worst-case K~), no adaptive clipping; sigma_N =
0.02 * 60,000 = 1200 (Fashion-MNIST's size is public) and sigma_K the
default. Model and step settings are the DP-SGD (tanh) ones of
MECHANISMS.md section 6 (learning rate 4, expected batch 2048, clip 0.1),
40 epochs. The paper's DPIS rows use ScatterNet features instead (not
available offline), so compare with its DP-SGD-TS row, not its DPIS row.

    python examples/dpis_fashion_mnist.py                    # epsilon 3, 40 epochs
    python examples/dpis_fashion_mnist.py --epochs 2         # a quick look

Prints the test accuracy, the epsilon spent (tfdp's ledger) and the sigma_G
schedule.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp import recipes  # noqa: E402
from tfdp.data import load_fashion_mnist  # noqa: E402

FASHION_MNIST_SIZE = 60000  # public: the size of the published training split


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--learning-rate", type=float, default=4.0)
    parser.add_argument("--l2-norm-clip", type=float, default=0.1)
    parser.add_argument("--k", type=float, default=5.0, help="probability multiplier (paper: 5)")
    parser.add_argument("--epoch-divider", type=float, default=1.0, help="a_E (paper, FMNIST: 1)")
    parser.add_argument("--data-dir", default=None, help="Fashion-MNIST IDX files (default: Debian's)")
    parser.add_argument("--seed", type=int, default=0, help="reproducible noise (not private: demo only)")
    parser.add_argument("--verbose", type=int, choices=(0, 1, 2), default=2)
    args = parser.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = load_fashion_mnist(data_dir=args.data_dir)
    keras.utils.set_random_seed(args.seed)
    model = recipes.build_model("fashion_mnist")
    optimizer = tfdp.optimizers.DPIS(
        learning_rate=args.learning_rate,
        l2_norm_clip=args.l2_norm_clip,
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        epochs=args.epochs,
        sigma_n=0.02 * FASHION_MNIST_SIZE,
        k=args.k,
        epoch_divider=args.epoch_divider,
        seed=args.seed,
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=args.verbose)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=2048, verbose=0)
    sigmas = " ".join(f"{row['sigma_g']:.3f}" for row in optimizer.epoch_history)
    print(f"sigma_G per epoch  {sigmas}")
    print(f"test accuracy      {accuracy:.4f}")
    print(f"epsilon            {model.privacy.epsilon(args.delta):.4f}  (delta={args.delta}, "
          f"target {args.epsilon})")


if __name__ == "__main__":
    main()
