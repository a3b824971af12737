"""Ready-made models and settings for the built-in datasets.

Shared by `tfdp train`, examples/ and benchmarks/, so the numbers each prints
come from the same model definitions.

Example:

>>> from tfdp import recipes
>>> model = recipes.build_model("digits")
>>> model.count_params()  # 2,410 weights and DPModel's step counter
2411
"""

import keras

from tfdp.models import DPSequential

# Defaults per dataset: the digits MLP reaches >= 90% at epsilon 3 in about
# 10 seconds on 2 CPU cores; Fashion-MNIST uses SA-DPSGD's Table 2 settings with
# SGD momentum 0.9, which DPIS states and Tramer and Boneh's code uses (it
# reached the papers' 86% at epsilon 3: RESULTS.md).
DEFAULTS = {
    "digits": dict(
        epochs=30, batch_size=64, learning_rate=0.5, momentum=0.0,
        l2_norm_clip=1.0, epsilon=3.0, delta=1e-5,
    ),
    "fashion_mnist": dict(
        epochs=40, batch_size=2048, learning_rate=4.0, momentum=0.9,
        l2_norm_clip=0.1, epsilon=3.0, delta=1e-5,
    ),
}


def digits_mlp():
    """64-32-10 tanh MLP for scikit-learn's 8x8 digits (2,410 parameters)."""
    return [
        keras.Input((64,)),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(10),
    ]


def tanh_cnn(input_shape=(28, 28, 1), num_classes=10):
    """The 4-layer tanh CNN of SA-DPSGD, DPIS and Papernot et al. (2021).

    26,010 parameters on 28x28x1 inputs (MECHANISMS.md section 6).
    """
    return [
        keras.Input(input_shape),
        keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="tanh"),
        keras.layers.MaxPooling2D(2, strides=1),
        keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="tanh"),
        keras.layers.MaxPooling2D(2, strides=1),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(num_classes),
    ]


def build_model(dataset, private=True):
    """The built-in model for `dataset` ("digits" or "fashion_mnist").

    Args:
        dataset: dataset name.
        private: True for a `tfdp.DPSequential`, False for a plain
            `keras.Sequential` (the non-private baseline).
    """
    layers = {"digits": digits_mlp, "fashion_mnist": tanh_cnn}
    if dataset not in layers:
        raise ValueError(f"Expected `dataset` in {sorted(layers)}. Received: dataset={dataset!r}")
    cls = DPSequential if private else keras.Sequential
    return cls(layers[dataset](), name=f"{dataset}_model")
