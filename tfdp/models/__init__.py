"""Keras models whose `fit` trains with differential privacy."""

from tfdp.models.dp_model import DPModel, DPSequential
from tfdp.models import keras_file_ledgers  # noqa: F401  (plain Keras files keep their ledger)
from tfdp.models import saved_model_ledgers  # noqa: F401  (so do SavedModels, exports)


def load_model(filepath, **kwargs):
    """`keras.models.load_model` for files tfdp saved (also `tfdp.load_model`).

    After `import tfdp`, `keras.models.load_model` reads them as well: tfdp
    registers its Keras classes when Keras is imported
    (`tfdp._keras_registration`). Either way the model loads ready to train
    on as it was saved: its privacy ledger, its optimizer's state, which
    variables train and its LoRA factors (`tfdp.models.training_state`), and
    a KerasHub causal LM's output projection tied to its token embedding
    (`tfdp.models.tied_layers`).

    Args:
        filepath: a `.keras` file.
        **kwargs: passed to `keras.models.load_model`.

    Returns:
        The model.

    Example: `model = tfdp.load_model("run/last.keras")`.
    """
    import keras

    import tfdp.layers  # noqa: F401  (registers tfdp's layers with Keras)
    import tfdp.optimizers  # noqa: F401  (and its optimizers)

    from tfdp.models.restore import naming_the_file

    with naming_the_file(filepath):  # a damaged ledger's error names the file
        return keras.models.load_model(filepath, **kwargs)


__all__ = ["DPModel", "DPSequential", "load_model"]
