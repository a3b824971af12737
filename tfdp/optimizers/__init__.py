"""Keras optimizers that train with differential privacy.

`DPOptimizer(inner_optimizer, l2_norm_clip, noise_multiplier)` makes any Keras
optimizer private; `DPSGD` is DP-SGD with SGD's arguments.
"""

from tfdp.optimizers.adadp import AdaDP
from tfdp.optimizers.dp_optimizer import DPOptimizer
from tfdp.optimizers.dpsgd import DPSGD
from tfdp.optimizers.dpis import DPIS
from tfdp.optimizers.sadpsgd import SADPSGD

__all__ = ["AdaDP", "DPIS", "DPOptimizer", "DPSGD", "SADPSGD"]
