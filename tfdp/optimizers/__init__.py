"""Keras optimizers that train with differential privacy.

`DPOptimizer(inner_optimizer, l2_norm_clip, noise_multiplier)` makes any Keras
optimizer private; `DPSGD` is DP-SGD with SGD's arguments.
"""

from tfdp.optimizers.dp_optimizer import DPOptimizer
from tfdp.optimizers.dpsgd import DPSGD

__all__ = ["DPOptimizer", "DPSGD"]
