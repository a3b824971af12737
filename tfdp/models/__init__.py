"""Keras models whose `fit` trains with differential privacy."""

from tfdp.models.dp_model import DPModel, DPSequential


def load_model(filepath, **kwargs):
    """`keras.models.load_model` for files tfdp saved.

    `import tfdp` loads its Keras classes only on first use, so a bare
    `keras.models.load_model` right after `import tfdp` cannot find
    `DPSequential`, `DPSGD` or `Scattering2D`; this function (also
    `tfdp.load_model`) imports every class tfdp saves first.

    Example: `model = tfdp.load_model("run/last.keras")`.
    """
    import keras

    import tfdp.layers  # noqa: F401  (registers tfdp's layers with Keras)
    import tfdp.optimizers  # noqa: F401  (and its optimizers)

    return keras.models.load_model(filepath, **kwargs)


__all__ = ["DPModel", "DPSequential", "load_model"]
