"""Cyclic Poisson sampling: DP-BandMF's amplified mode on random-access data.

Every record i gets a secret group g(i) in {0, ..., b-1}, drawn independently
and uniformly from the stream's groups key. Step t of a stream that began at
model step s samples only group (t - s) mod b: each member of that group
joins the batch independently with probability q, the other records not at
all. A record's group is therefore active once every b steps, and within an
active step it is Poisson-sampled, which is the participation pattern that
amplified DP-BandMF is accounted for (`tfdp.accounting.bandmf.amplified_event`,
Choquette-Choo et al. 2023, jax-privacy's INDEPENDENT partition).

Whose randomness: record i's group is a function of the groups key and i
only (element i of one stateless stream), and within a step the active
group's members get i.i.d. Bernoulli(q) coins by their place in the group.
A record's only identity is its index: removing a record leaves the groups
of the records before it bit for bit the same and shifts the later ones to
the draw of the index before theirs, i.i.d. all the same, so the other
records' groups and coins have the same joint law with or without it, and
replacing a record changes no draw. So the guarantee is add-or-remove
(tests/data/test_sampler_coupling.py).

Expected batch size and steps: with N records, a step draws q N / b records
on average. `DPModel.fit(x, y, batch_size=B)` with a `DPBandMF(bands=b)`
optimizer reads B as that expected batch size, as for DP-SGD, so
q = B b / N (at most 1: B <= N / b), and an epoch has round(N / B) steps
unless `steps_per_epoch` says otherwise: about one expected visit of every
record, spread over N / (B b) rounds of b steps.

The draws run in the TensorFlow graph like `PoissonSampler`'s: step t's draw
is a function of (key, t) and of the groups, which are fixed for the stream.

Example:

>>> from tfdp.data.sampling import sampling_key
>>> sampler = CyclicPoissonSampler(1000, 25, bands=4, groups_key=sampling_key(0), seed=0)
>>> sampler.sampling_probability           # q = 25 * 4 / 1000 in the active group
0.1
>>> draw = sampler.draw(sampler.key, step=2)
>>> rows = draw["indices"][draw["mask"] == 1].numpy()
>>> bool((sampler.groups[rows] == 2).all())   # only group 2 at step 2
True
"""

import numpy as np
import tensorflow as tf

from tfdp.data.poisson import DEFAULT_OVERFLOW_PROBABILITY, PoissonSampler, padded_batch_size
from tfdp.data.sampling import ALGORITHM, fold_key, poisson_indices

__all__ = ["CyclicPoissonSampler", "record_groups", "cyclic_sampling_probability"]


def record_groups(groups_key, num_examples, bands):
    """Each record's group: N independent uniform draws in {0, ..., b-1}.

    Args:
        groups_key: int64 [2], the stream's secret groups key.
        num_examples: N >= 1.
        bands: b >= 1.

    Returns:
        np.ndarray of int64 [N].

    Example:

    >>> from tfdp.data.sampling import sampling_key
    >>> groups = record_groups(sampling_key(0), 10000, 4)
    >>> sorted(set(groups.tolist())), bool(abs(np.mean(groups == 1) - 0.25) < 0.02)
    ([0, 1, 2, 3], True)
    """
    return tf.random.stateless_uniform(
        [int(num_examples)], seed=tf.cast(groups_key, tf.int64), minval=0,
        maxval=int(bands), dtype=tf.int64, alg=ALGORITHM,
    ).numpy()


def cyclic_sampling_probability(expected_batch_size, bands, num_examples):
    """q = B b / N: the rate within the active group for an expected batch B.

    Raises:
        ValueError: if q > 1 (B > N / b), with what to change.

    Example:

    >>> cyclic_sampling_probability(64, 8, 60000)
    0.008533333333333334
    """
    q = float(expected_batch_size) * int(bands) / int(num_examples)
    if q > 1.0:
        raise ValueError(
            "DPBandMF on arrays samples each step from one of `bands` groups of about "
            "N / bands records, each member with probability q = batch_size * bands / N "
            "(batch_size is a step's expected batch size, as for DP-SGD), and q must be "
            f"<= 1: use batch_size <= N / bands = {int(num_examples) / int(bands):g}, or "
            f"fewer bands. Received: batch_size={expected_batch_size}, bands={bands}, "
            f"N={num_examples} (q={q:g})"
        )
    return q


class CyclicPoissonSampler(PoissonSampler):
    """Poisson sampling of the active group only (the module docstring).

    A `PoissonSampler` (same padding, `make_dataset`, in-graph draws) whose
    step t draws each member of group (t - stream_start) mod b with
    probability q = expected_batch_size * b / N and no other record. With
    b = 1 it draws exactly what `PoissonSampler` draws for the same key.

    Args:
        num_examples: N >= 1.
        expected_batch_size: B, a step's expected batch size, in
            [1, N / bands].
        bands: b >= 1, the number of groups (DPBandMF's bands).
        groups_key: int64 [2], the secret key of the record groups.
        stream_start: the model step at which group 0 is active.
        steps_per_epoch, seed, overflow_probability, multiple, fixed_shape:
            as for `PoissonSampler`.

    Attributes:
        sampling_probability: q, within the active group.
        groups: int64 [N], each record's group (secret).
        padded_size: the padded batch length (a draw from the largest group
            overflows it with probability at most `overflow_probability`).
    """

    def __init__(self, num_examples, expected_batch_size, bands, groups_key, stream_start=0,
                 steps_per_epoch=None, seed=None, *,
                 overflow_probability=DEFAULT_OVERFLOW_PROBABILITY, multiple=8,
                 fixed_shape=True):
        if isinstance(bands, bool) or not isinstance(bands, (int, np.integer)) or bands < 1:
            raise ValueError(f"Expected `bands` to be an int >= 1. Received: bands={bands!r}")
        super().__init__(num_examples, expected_batch_size, steps_per_epoch, seed,
                         overflow_probability=overflow_probability, multiple=multiple,
                         fixed_shape=fixed_shape)
        self.bands = int(bands)
        self.stream_start = int(stream_start)
        self.sampling_probability = cyclic_sampling_probability(
            expected_batch_size, self.bands, self.num_examples)
        self.groups = record_groups(groups_key, self.num_examples, self.bands)
        counts = np.bincount(self.groups, minlength=self.bands)
        self._largest_group = max(1, int(counts.max()))
        self._members = tf.constant(np.argsort(self.groups, kind="stable"), tf.int64)
        self._offsets = tf.constant(np.concatenate([[0], np.cumsum(counts)]), tf.int64)
        self.padded_size = padded_batch_size(
            self._largest_group, self.sampling_probability,
            overflow_probability=overflow_probability, multiple=multiple,
        )

    def __repr__(self):
        return (
            f"CyclicPoissonSampler(num_examples={self.num_examples}, "
            f"expected_batch_size={self.expected_batch_size}, bands={self.bands}, "
            f"sampling_probability={self.sampling_probability:g}, "
            f"padded_size={self.padded_size})"
        )

    def active_group(self, step):
        """The group step `step` samples: (step - stream_start) mod b."""
        return tf.math.floormod(tf.cast(step, tf.int64) - self.stream_start, self.bands)

    def sample_indices(self, key, step):
        """Step `step`'s draw: each member of the active group with probability q.

        The walk of `poisson_indices` over the largest group's length, cut at
        the active group's size, is N_g independent Bernoulli(q) coins; its
        positions index the group's members (ascending record order).

        Args:
            key: int64 [2], the stream's key.
            step: integer scalar, the model step.

        Returns:
            int64 tensor: the sorted indices of the included records.
        """
        group = self.active_group(step)
        first = self._offsets[group]
        size = self._offsets[group + 1] - first
        picks = poisson_indices(fold_key(key, step), self._largest_group,
                                self.sampling_probability)
        picks = tf.boolean_mask(picks, picks < size)
        return tf.gather(self._members, first + picks)

    def shard_population(self, num_workers):
        """The most members of one group within one worker's shard (index %
        W == w): a draw includes only the active group's members.

        Example:

        >>> from tfdp.data.sampling import sampling_key
        >>> sampler = CyclicPoissonSampler(1000, 25, bands=4, groups_key=sampling_key(0))
        >>> 125 <= sampler.shard_population(2) < 150   # about 1000 / (4 x 2), not 500
        True
        """
        workers = int(num_workers)
        shards = np.arange(self.num_examples) % workers
        counts = np.bincount(self.groups * workers + shards, minlength=self.bands * workers)
        return max(1, int(counts.max()))

    def traced_draw(self):
        """Traced once per sampler: the groups are this sampler's own."""
        return self._trace_own_draw()
