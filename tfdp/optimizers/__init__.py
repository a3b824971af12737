"""Keras optimizers that train with differential privacy.

`DPOptimizer(inner_optimizer, l2_norm_clip, noise_multiplier)` makes any Keras
optimizer private; `DPSGD` is DP-SGD with SGD's arguments; `DPBandMF` adds
banded correlated noise and trains from a tf.data pipeline in a fixed order.
"""

from tfdp.optimizers.adadp import AdaDP
from tfdp.optimizers.bandmf import DPBandMF
from tfdp.optimizers.dp_optimizer import DPOptimizer
from tfdp.optimizers.dpsgd import DPSGD
from tfdp.optimizers.dpis import DPIS
from tfdp.optimizers.sadpsgd import SADPSGD
from tfdp.optimizers.sparse_embeddings import SparseNoise

__all__ = ["AdaDP", "DPBandMF", "DPIS", "DPOptimizer", "DPSGD", "SADPSGD", "SparseNoise"]
