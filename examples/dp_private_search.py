"""A private hyperparameter search on scikit-learn's digits (offline).

docs/guides/private-tuning.md as a script: `tfdp.tuning.PrivateRandomSearch`
draws a secret number of trials (geometric law, mean `--mean-trials`), trains
each with DP-SGD, scores each on a noisy validation split of the private
data, and returns only the best model, whose ledger charges the whole search.

    python examples/dp_private_search.py
    python examples/dp_private_search.py --mean-trials 5 --epochs 10
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp.data import load_digits  # noqa: E402


def build(hp):
    """A 64-h-10 MLP whose learning rate, width and clipping norm are searched;
    the noise is fixed, as a private search requires."""
    model = tfdp.DPSequential([
        keras.Input((64,)),
        keras.layers.Dense(hp.Choice("units", [16, 32]), activation="tanh"),
        keras.layers.Dense(10)])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(
            hp.Float("learning_rate", 0.1, 2.0, sampling="log"),
            l2_norm_clip=hp.Choice("l2_norm_clip", [0.5, 1.0]), noise_multiplier=1.2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mean-trials", type=float, default=3.0)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = load_digits()
    tuner = tfdp.tuning.PrivateRandomSearch(build, mean_trials=args.mean_trials,
                                            distribution="geometric")
    print(tuner.search_space_summary())
    tuner.search(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                 validation_split=0.2)
    model = tuner.get_best_models()[0]
    print("chosen:", tuner.get_best_hyperparameters()[0].values,
          f"noisy validation score {tuner.best_score:.3f}")
    accuracy = model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    epsilon = model.privacy.epsilon(1e-5)
    print(f"test accuracy {accuracy:.3f}; the whole search: epsilon {epsilon:.2f} (delta 1e-5)")
    return accuracy, epsilon


if __name__ == "__main__":
    main()
