"""Tramer and Boneh's private data normalization of features, accounted.

Each channel of the features is normalized by its mean and variance over
the training set, released with the Gaussian mechanism: every example's
vector of per-channel means (over positions) is clipped to L2 norm
`mean_clip`, its vector of per-channel mean squares to `square_clip`; each
clipped sum gets N(0, (noise_multiplier * clip)^2) noise per channel and is
divided by the data set size (treated as public, as DP-SGD's 1/(q N) scaling
does). The two releases are recorded in the ledger as one
ComposedDpEvent of two GaussianDpEvents(noise_multiplier) before the
statistics are returned. A record whose per-channel mean (or mean-square)
vector has a NaN or Inf entry contributes nothing to that sum, so no record
can make a released value non-finite. Unlike the paper's code, the clip bounds are public
arguments (the paper took them from the data's median norms, unaccounted).

Example:

>>> import numpy as np
>>> from tfdp.accounting import PrivacyLedger
>>> ledger = PrivacyLedger()
>>> features = np.ones([1000, 7, 7, 3], "float32")
>>> stats = private_channel_statistics(features, ledger, mean_clip=2.0,
...                                    square_clip=2.0, noise_multiplier=8.0, seed=0)
>>> stats.mean.shape, round(ledger.epsilon(delta=1e-5), 3) > 0
((3,), True)
>>> stats.layer()(features).shape
TensorShape([1000, 7, 7, 3])
"""

import dataclasses

import dp_accounting
import keras
import numpy as np

from tfdp.mechanisms.gaussian import numpy_normal
from tfdp.preprocessing import provenance


@dataclasses.dataclass(frozen=True)
class ChannelStatistics:
    """Released per-channel statistics and the DpEvent they cost.

    Attributes:
        mean: float array [K], noisy per-channel mean.
        variance: float array [K], noisy mean square minus mean^2, floored at 0.
        event: the dp_accounting event recorded for the release.
    """

    mean: np.ndarray
    variance: np.ndarray
    event: dp_accounting.DpEvent
    ledger: object = dataclasses.field(default=None, repr=False, compare=False)

    def layer(self, epsilon=1e-5):
        """A fixed `keras.layers.Normalization` computing
        (x - mean) / sqrt(variance + epsilon) on the last axis.

        Its state has a provenance (`tfdp.preprocessing`): a `DPModel`
        holding it accepts it at `fit`, and charges `event` to its own
        ledger unless it is the ledger this release was recorded in."""
        layer = keras.layers.Normalization(
            axis=-1, mean=self.mean, variance=self.variance + epsilon
        )
        provenance.register_private(
            layer, "Tramer and Boneh's private channel statistics "
            "(tfdp.layers.private_channel_statistics)", "record", self.event, 0.0,
            charged=self.ledger)
        return layer


def _clip_rows(vectors, bound):
    """Clips each row to L2 norm `bound`; a row with a NaN or Inf entry
    becomes 0 (it contributes nothing, as a non-finite gradient in
    `tfdp.mechanisms.dpsgd.clip_factors`)."""
    finite = np.all(np.isfinite(vectors), axis=1, keepdims=True)
    vectors = np.where(finite, vectors, 0.0)
    # Norms of rows scaled to max |entry| 1, so huge finite rows do not overflow.
    scale = np.maximum(np.max(np.abs(vectors), axis=1, keepdims=True), 1e-300)
    norms = np.linalg.norm(vectors / scale, axis=1, keepdims=True) * scale
    return vectors * np.minimum(1.0, bound / np.maximum(norms, 1e-30))


def private_channel_statistics(
    features, ledger, mean_clip, square_clip, noise_multiplier, seed=None
):
    """Releases per-channel mean and variance of `features` with Gaussian noise.

    Args:
        features: array [N, ..., K] (channels last), e.g. cached scattering
            features [N, 7, 7, 81]. One example per row; an example whose
            statistic is not finite (NaN, Inf, or a square that overflows)
            counts as zeros in that statistic's sum.
        ledger: the `tfdp.accounting.PrivacyLedger` to charge (for a model,
            `model.privacy`); the release is recorded before returning.
        mean_clip: L2 bound on each example's per-channel mean vector.
        square_clip: L2 bound on each example's per-channel mean-square vector.
        noise_multiplier: noise std over sensitivity, > 0, for both releases.
        seed: noise seed; None draws it from OS entropy.

    Returns:
        `ChannelStatistics` (mean, variance, event).
    """
    for name, value in (("mean_clip", mean_clip), ("square_clip", square_clip),
                        ("noise_multiplier", noise_multiplier)):
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"Expected `{name}` > 0 and finite. Received: {name}={value!r}")
    features = np.asarray(features, np.float64)
    if features.ndim < 2 or len(features) == 0:
        raise ValueError(
            f"Expected `features` [N, ..., K] with N >= 1. Received: shape={features.shape}"
        )
    n, k = len(features), features.shape[-1]
    flat = features.reshape(n, -1, k)
    rng = np.random.default_rng(seed)
    event = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(noise_multiplier)] * 2
    )
    ledger.record(event)
    sums = []
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite rows are dropped
        statistics = ((flat.mean(axis=1), mean_clip), ((flat**2).mean(axis=1), square_clip))
    for per_example, clip in statistics:
        noise = numpy_normal(rng, noise_multiplier * clip, size=k)
        sums.append(_clip_rows(per_example, clip).sum(axis=0) + noise)
    mean, square = sums[0] / n, sums[1] / n
    variance = np.maximum(square - mean**2, 0.0)
    return ChannelStatistics(mean.astype(np.float32), variance.astype(np.float32), event, ledger)
