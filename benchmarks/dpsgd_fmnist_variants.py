"""Short DP-SGD runs on Fashion-MNIST that probe the gap to the papers' 86%.

Each variant changes one thing from benchmarks/results.py's settings (tanh
CNN, expected batch 2048, clip 0.1, lr 4.0, noise calibrated to epsilon 3
over 40 epochs) and trains for `--epochs` epochs, printing per-epoch training
accuracy and the final test accuracy. The tuning is not privately accounted.

    python benchmarks/dpsgd_fmnist_variants.py --variant baseline --epochs 10
    python benchmarks/dpsgd_fmnist_variants.py --variant standardized --epochs 10
    python benchmarks/dpsgd_fmnist_variants.py --variant momentum --learning-rate 0.4 --epochs 10
    python benchmarks/dpsgd_fmnist_variants.py --variant momentum --learning-rate 4.0 --epochs 10
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp import recipes  # noqa: E402
from tfdp.data import load_fashion_mnist  # noqa: E402

VARIANTS = ("baseline", "standardized", "momentum")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=VARIANTS, default="baseline")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    (x, y), (x_test, y_test) = load_fashion_mnist()
    if args.variant == "standardized":  # the training split's mean and std
        mean, std = x.mean(), x.std()
        x, x_test = (x - mean) / std, (x_test - mean) / std
    keras.utils.set_random_seed(args.seed)
    model = recipes.build_model("fashion_mnist")
    sigma = tfdp.accounting.calibrate_noise_multiplier(3.0, 1e-5, 2048 / len(x), 40 * round(len(x) / 2048))
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(
            args.learning_rate, momentum=0.9 if args.variant == "momentum" else 0.0,
            l2_norm_clip=0.1, noise_multiplier=sigma, seed=args.seed,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(x, y, batch_size=2048, epochs=args.epochs, verbose=0)
    test_accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
    print(f"variant={args.variant} lr={args.learning_rate} epochs={args.epochs} "
          f"train accuracy per epoch={[round(a, 4) for a in history.history['accuracy']]} "
          f"test accuracy={test_accuracy:.4f} epsilon={model.privacy.epsilon(1e-5):.3f}")


if __name__ == "__main__":
    main()
