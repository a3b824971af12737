"""Keras models whose `fit` trains with differential privacy."""

from tfdp.models.dp_model import DPModel, DPSequential

__all__ = ["DPModel", "DPSequential"]
