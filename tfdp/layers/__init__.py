"""Keras layers for private learning: fixed feature transforms (no weights,
so no privacy cost).

>>> from tfdp.layers import Scattering2D
>>> Scattering2D(J=2, L=8).get_config()["J"]
2
"""

from tfdp.layers.features import compute_features
from tfdp.layers.private_normalization import ChannelStatistics, private_channel_statistics
from tfdp.layers.scattering import Scattering2D

__all__ = ["ChannelStatistics", "Scattering2D", "compute_features", "private_channel_statistics"]
