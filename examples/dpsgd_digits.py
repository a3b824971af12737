"""DP-SGD on scikit-learn's 8x8 digits (offline, about 15 seconds on 2 cores).

The 64-32-10 tanh MLP of `tfdp.recipes`, the noise calibrated so that 30
epochs spend epsilon = 3 (delta = 1e-5); `PrivacyBudget` stops training if
the budget would be exceeded. The same run as `tfdp train --dataset digits`,
written out as a Keras user would.

    python examples/dpsgd_digits.py
    python examples/dpsgd_digits.py --epsilon 1 --weight-decay 0.001
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp.data import load_digits  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--weight-decay", type=float, default=0.0, help="lambda, placed before clipping")
    parser.add_argument("--adam", action="store_true", help="DP-Adam instead of DP-SGD")
    args = parser.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = load_digits()
    steps = args.epochs * round(len(x_train) / args.batch_size)
    sigma = tfdp.accounting.calibrate_noise_multiplier(
        args.epsilon, args.delta, args.batch_size / len(x_train), steps
    )
    private = dict(l2_norm_clip=1.0, noise_multiplier=sigma, weight_decay=args.weight_decay)
    if args.adam:
        optimizer = tfdp.optimizers.DPOptimizer(keras.optimizers.Adam(0.01), **private)
    else:
        optimizer = tfdp.optimizers.DPSGD(learning_rate=0.5, **private)

    model = tfdp.DPSequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(10),
    ])
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2,
        validation_data=(x_test, y_test),
        callbacks=[tfdp.callbacks.PrivacyBudget(epsilon=args.epsilon, delta=args.delta)],
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"noise multiplier  {sigma:.4f}")
    print(f"test accuracy     {accuracy:.4f}")
    print(model.privacy.statement(args.delta))


if __name__ == "__main__":
    main()
