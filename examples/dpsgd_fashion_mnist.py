"""DP-SGD on Fashion-MNIST with the 4-layer tanh CNN (SA-DPSGD's Table 2 settings).

Learning rate 4.0, expected batch 2048 (Poisson), clip 0.1, the noise
calibrated so that `--epochs` spend `--epsilon` (delta = 1e-5). Reads the IDX
files of Debian's `dataset-fashion-mnist` (or `--data-dir`). A 40-epoch run
takes tens of minutes on 2 CPU cores; `--epochs 2` is a quick look.

    python examples/dpsgd_fashion_mnist.py --epochs 2
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp import recipes  # noqa: E402
from tfdp.data import load_fashion_mnist  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = load_fashion_mnist(args.data_dir)
    batch_size = 2048
    steps = args.epochs * round(len(x_train) / batch_size)
    sigma = tfdp.accounting.calibrate_noise_multiplier(
        args.epsilon, args.delta, batch_size / len(x_train), steps
    )
    model = recipes.build_model("fashion_mnist")
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(learning_rate=4.0, l2_norm_clip=0.1, noise_multiplier=sigma),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(
        x_train, y_train, batch_size=batch_size, epochs=args.epochs, verbose=2,
        validation_data=(x_test, y_test),
        callbacks=[tfdp.callbacks.PrivacyBudget(epsilon=args.epsilon, delta=args.delta)],
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"noise multiplier  {sigma:.4f}")
    print(f"test accuracy     {accuracy:.4f}")
    print(f"epsilon           {model.privacy.epsilon(args.delta):.4f} (delta={args.delta})")


if __name__ == "__main__":
    main()
