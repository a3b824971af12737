"""tfdp: differentially private training for Keras 3 on TensorFlow.

Two changes to a Keras script make it private:

>>> import keras, tfdp
>>> model = tfdp.DPSequential([keras.Input((64,)), keras.layers.Dense(10)])
>>> model.compile(
...     optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.1),
...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

Then `model.fit(...)` trains on Poisson-sampled batches with clipped, noised
per-example gradients, and `model.privacy.epsilon(delta=1e-5)` reads the
privacy ledger. `tfdp.accounting` answers privacy questions without training.

`import tfdp` itself is light: each name below is imported on first use, so
`tfdp.accounting` (and the `tfdp epsilon` / `tfdp calibrate` commands) never
load TensorFlow or Keras; `tfdp.DPModel`, `tfdp.optimizers` and the other
training names do. tfdp's Keras classes are registered as soon as the
program imports Keras, so `keras.models.load_model` reads the files tfdp
saves (`tfdp._keras_registration`).
"""

import importlib

from tfdp import tf_log_level  # first: TF_CPP_MIN_LOG_LEVEL before TensorFlow's import
from tfdp import _keras_registration  # noqa: E402

__version__ = "0.1.0"

__all__ = ["DPModel", "DPSequential", "accounting", "callbacks", "load_model", "optimizers"]

# Public names and the module each is read from, imported on first access.
_MODELS = ("DPModel", "DPSequential", "load_model")
_SUBMODULES = (
    "accounting", "auditing", "callbacks", "cli", "data", "distribute", "layers",
    "mechanisms", "models", "optimizers", "per_example", "preprocessing", "recipes", "training",
    "tuning",
)


def __getattr__(name):
    if name in _MODELS:
        value = getattr(importlib.import_module("tfdp.models"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"tfdp.{name}")
    else:
        raise AttributeError(f"module 'tfdp' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_MODELS) | set(_SUBMODULES))


_keras_registration.install()
