"""Poisson sampling into fixed-shape padded batches.

DP-SGD's privacy accounting (`PoissonSampledDpEvent`) holds only when every
record joins each step's batch independently with probability
`q = expected_batch_size / num_examples`. The realised batch size is then
Binomial(N, q): it changes from step to step, which would make a compiled
training step retrace. This module pads every batch to one fixed length
`padded_size` (with a 0/1 mask), chosen so that a larger draw happens with
probability at most `overflow_probability` per step. A draw that is larger
anyway is never truncated (truncation would change the sampling distribution
and void the accounting): it is padded to the next multiple of
`padded_size` instead.

Whose randomness: a record's only identity is its index, and the draw is
N i.i.d. Bernoulli(q) coins over the indices (a walk of geometric gaps with
that law), keyed by the run's key and the step and by nothing in the data.
Removing a record leaves the draws of the records before it bit for bit the
same and gives each record after it the coin of the index before its own:
the other records' coins are still i.i.d. Bernoulli(q), so their joint law
(all the accountant sees) is unchanged by the removal. Replacing a record
changes no draw. (People, who have ids, get draws keyed by their own id:
`tfdp.data.users`; tests/data/test_sampler_coupling.py checks both.)

Example:

```python
sampler = PoissonSampler(num_examples=60000, expected_batch_size=256, seed=1)
dataset = make_dataset(sampler, (x_train, y_train))
for (x, y), mask in dataset:   # one element per DP-SGD step
    ...                        # rows with mask == 0 are padding
```
"""

import math
import numbers
from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from tfdp.accounting.calibration import steps_per_epoch as default_steps_per_epoch
from tfdp.data.reader import read_batches
from tfdp.data.sampling import draws, fold_key, padded_draw, poisson_indices, sampling_key
from tfdp.data.sources import as_source

__all__ = ["PoissonSampler", "padded_batch_size", "make_dataset", "gathered_batches"]


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_num_examples(num_examples):
    if not _is_int(num_examples):
        raise TypeError(
            "Expected `num_examples` to be an integer. "
            f"Received: num_examples={num_examples!r} "
            f"of type {type(num_examples).__name__}"
        )
    if num_examples < 1:
        raise ValueError(
            "Expected `num_examples` >= 1. "
            f"Received: num_examples={num_examples}"
        )
    return int(num_examples)


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


# Binomial tail ------------------------------------------------------------------


def _log_binomial_window(n, q, lo, hi, mode, log_pmf_mode):
    """Log pmf of Binomial(n, q) on k = lo..hi (lo <= mode <= hi).

    Anchored at the mode (computed with `math.lgamma`) and extended outwards
    with cumulative sums of the log pmf ratios
    log(p(k + 1) / p(k)) = log(n - k) - log(k + 1) + log(q / (1 - q)),
    which avoids the cancellation of large `lgamma` differences.
    """
    log_odds = math.log(q) - math.log1p(-q)
    out = np.empty(hi - lo + 1, dtype=np.float64)
    out[mode - lo] = log_pmf_mode
    if hi > mode:
        k = np.arange(mode, hi, dtype=np.float64)
        steps = np.log(n - k) - np.log(k + 1.0) + log_odds
        out[mode - lo + 1 :] = log_pmf_mode + np.cumsum(steps)
    if lo < mode:
        # log(p(k - 1) / p(k)) = log(k) - log(n - k + 1) - log_odds, k = mode..lo+1
        k = np.arange(mode, lo, -1, dtype=np.float64)
        steps = np.log(k) - np.log(n - k + 1.0) - log_odds
        out[: mode - lo][::-1] = log_pmf_mode + np.cumsum(steps)
    return out


def _log_geometric_remainder(log_pmf_edge, log_ratio):
    """Log of p_edge * r / (1 - r): a bound on the mass beyond a window edge."""
    if log_ratio >= 0.0:
        return math.inf
    return log_pmf_edge + log_ratio - math.log(-math.expm1(log_ratio))


def _binomial_log_tails(n, q, log_target):
    """Upper bounds on log P(X > P), X ~ Binomial(n, q), for P = lo..hi.

    Returns `(lo, log_tails)`. The window [lo, hi] around the mode is widened
    until (a) the mass above `hi` is provably below `target * e^-30` and
    (b) the mass below `lo` is provably below 1/2, so every P with
    P(X > P) <= target (< 1) lies in the window. The probabilities inside the
    window are summed exactly in log space (from the far end, so small terms
    are not lost); the mass above `hi` is added as its geometric upper bound
    (beyond the mode the pmf ratio p(k+1)/p(k) decreases, so the tail above
    `hi` is at most p(hi) r / (1 - r) with r = p(hi+1)/p(hi)). The result is
    therefore an upper bound on the true tail, up to float64 rounding.
    """
    mode = min(n, int(math.floor((n + 1) * q)))
    log_pmf_mode = (
        math.lgamma(n + 1)
        - math.lgamma(mode + 1)
        - math.lgamma(n - mode + 1)
        + mode * math.log(q)
        + (n - mode) * math.log1p(-q)
    )
    log_odds = math.log(q) - math.log1p(-q)
    width = int(math.ceil(10.0 * math.sqrt(n * q * (1.0 - q)))) + 16
    while True:
        lo = max(0, mode - width)
        hi = min(n, mode + width)
        log_pmf = _log_binomial_window(n, q, lo, hi, mode, log_pmf_mode)
        if hi == n:
            log_upper_rest = -math.inf
        else:
            log_ratio_up = math.log(n - hi) - math.log(hi + 1.0) + log_odds
            log_upper_rest = _log_geometric_remainder(log_pmf[-1], log_ratio_up)
        if lo == 0:
            log_lower_rest = -math.inf
        else:
            log_ratio_down = math.log(lo) - math.log(n - lo + 1.0) - log_odds
            log_lower_rest = _log_geometric_remainder(log_pmf[0], log_ratio_down)
        if log_upper_rest <= log_target - 30.0 and log_lower_rest <= math.log(0.5):
            break
        width *= 2
    # log_tails[j] = log P(X > lo + j) = log(sum_{k > lo + j} p(k) + rest).
    reversed_cumulative = np.logaddexp.accumulate(log_pmf[::-1])[::-1]
    log_tails = np.empty_like(log_pmf)
    log_tails[:-1] = np.logaddexp(reversed_cumulative[1:], log_upper_rest)
    log_tails[-1] = log_upper_rest
    return lo, log_tails


def padded_batch_size(
    num_examples, sampling_probability, overflow_probability=1e-12, multiple=8
):
    """Smallest padded batch length that a Poisson draw overflows rarely.

    Returns the smallest `P` with `P(Binomial(N, q) > P) <= overflow_probability`,
    rounded up to a multiple of `multiple` (and at least `multiple`).

    The tail is computed, not approximated: the binomial pmf is summed in log
    space over a window around the mode that holds all but a provably tiny
    remainder, and that remainder is added as a geometric upper bound. The
    computed tail is thus an upper bound on the true tail (up to float64
    rounding), so the returned size never understates the overflow risk.

    Args:
        num_examples: int, the number of records `N` (>= 1).
        sampling_probability: float in (0, 1], the per-record inclusion
            probability `q`.
        overflow_probability: float in (0, 1), the largest acceptable
            probability that one step's draw is longer than the result.
        multiple: int >= 1; the result is rounded up to a multiple of it.

    Returns:
        int, the padded batch length.

    Example:

    >>> padded_batch_size(60000, 256 / 60000)
    376
    >>> padded_batch_size(100, 1.0, multiple=1)
    100
    """
    n = _check_num_examples(num_examples)
    if not _is_real(sampling_probability) or not (
        0.0 < float(sampling_probability) <= 1.0
    ):
        raise ValueError(
            "Expected `sampling_probability` in (0, 1]. "
            f"Received: sampling_probability={sampling_probability!r}"
        )
    if not _is_real(overflow_probability) or not (
        0.0 < float(overflow_probability) < 1.0
    ):
        raise ValueError(
            "Expected `overflow_probability` in (0, 1). "
            f"Received: overflow_probability={overflow_probability!r}"
        )
    if not _is_int(multiple) or multiple < 1:
        raise ValueError(
            f"Expected `multiple` to be an integer >= 1. Received: multiple={multiple!r}"
        )
    q = float(sampling_probability)
    multiple = int(multiple)
    if q == 1.0:
        size = n
    else:
        lo, log_tails = _binomial_log_tails(n, q, math.log(overflow_probability))
        fits = np.flatnonzero(log_tails <= math.log(overflow_probability))
        # The window guarantees that the last entry fits.
        size = lo + int(fits[0])
    return max(multiple, _round_up(size, multiple))


# Sampler ------------------------------------------------------------------------

# Padding rows cost as much compute as real ones, and an oversized draw costs
# only one more trace of the step (its shape is then cached) and one longer
# step, so the default tolerates one overflow in a million steps: at N 60,000
# the padded length is 336 for b = 256 (376 at 1e-12) and 2,264 for b = 2,048.
DEFAULT_OVERFLOW_PROBABILITY = 1e-6


class PoissonSampler:
    """Draws Poisson-sampled batches of record indices, padded to a fixed length.

    Every step, each of the `num_examples` records joins the batch
    independently with probability `q = expected_batch_size / num_examples`
    (the sampling the DP-SGD accountant assumes). Batches are padded to
    `padded_size` rows with a float mask (1 for a sampled record, 0 for
    padding). A draw longer than `padded_size` (probability at most
    `overflow_probability` per step) is padded to the smallest multiple of
    `padded_size` that holds it; it is never truncated.

    With `fixed_shape=False` a batch is padded only to a multiple of
    `multiple` rows (at least `multiple`): for a step that is traced once for
    any batch length (TensorFlow without XLA), padding rows are wasted work.

    The draws happen in the TensorFlow graph (`tfdp.data.sampling`): step
    `t`'s draw is a function of the secret `key` and `t` alone.

    Args:
        num_examples: int, the number of records `N` (>= 1).
        expected_batch_size: number in [1, num_examples], the expected batch
            size `b`.
        steps_per_epoch: int >= 1, the steps an epoch of `make_dataset` has.
            Defaults to `round(num_examples / expected_batch_size)` (at least 1).
        seed: int or None. None (the default) keys the draws with OS entropy,
            so no two runs share a sampling stream; an int makes them
            reproducible. Neither is ever saved.
        overflow_probability: float in (0, 1), passed to `padded_batch_size`
            (default 1e-6, see `DEFAULT_OVERFLOW_PROBABILITY`).
        multiple: int >= 1, passed to `padded_batch_size`.
        fixed_shape: True (default) pads every batch to `padded_size` (one
            shape, for XLA); False pads to a multiple of `multiple` only.

    Attributes:
        num_examples, expected_batch_size, steps_per_epoch, seed: as given.
        sampling_probability: `q = expected_batch_size / num_examples`.
        padded_size: the padded batch length.
        key: the secret sampling key (int64 [2]).

    Example:

    >>> sampler = PoissonSampler(1000, 50, seed=0)
    >>> sampler.steps_per_epoch, sampler.padded_size
    (20, 88)
    >>> draw = sampler.draw(sampler.key, step=0)
    >>> real = draw["indices"][draw["mask"] == 1]   # step 0's records
    """

    def __init__(
        self,
        num_examples,
        expected_batch_size,
        steps_per_epoch=None,
        seed=None,
        *,
        overflow_probability=DEFAULT_OVERFLOW_PROBABILITY,
        multiple=8,
        fixed_shape=True,
    ):
        self.num_examples = _check_num_examples(num_examples)
        if not _is_real(expected_batch_size):
            raise TypeError(
                "Expected `expected_batch_size` to be a number. "
                f"Received: expected_batch_size={expected_batch_size!r} "
                f"of type {type(expected_batch_size).__name__}"
            )
        if not 1 <= expected_batch_size <= self.num_examples:
            raise ValueError(
                "Expected 1 <= `expected_batch_size` <= the number of examples "
                f"({self.num_examples}). "
                f"Received: expected_batch_size={expected_batch_size}"
            )
        self.expected_batch_size = expected_batch_size
        if steps_per_epoch is None:  # the count calibration assumes
            steps_per_epoch = default_steps_per_epoch(self.num_examples, expected_batch_size)
        elif not _is_int(steps_per_epoch) or steps_per_epoch < 1:
            raise ValueError(
                "Expected `steps_per_epoch` to be an integer >= 1. "
                f"Received: steps_per_epoch={steps_per_epoch!r}"
            )
        self.steps_per_epoch = int(steps_per_epoch)
        if seed is not None and (not _is_int(seed) or seed < 0):
            raise TypeError(
                "Expected `seed` to be None or a non-negative integer. "
                f"Received: seed={seed!r}"
            )
        self.seed = seed
        self.sampling_probability = float(expected_batch_size) / self.num_examples
        self.padded_size = padded_batch_size(
            self.num_examples,
            self.sampling_probability,
            overflow_probability=overflow_probability,
            multiple=multiple,
        )
        self.multiple = int(multiple)
        self.fixed_shape = bool(fixed_shape)
        self.key = sampling_key(seed)  # seed=None: fresh OS entropy. Never saved.
        self._own_draw = None  # see _trace_own_draw

    def __repr__(self):
        return (
            f"PoissonSampler(num_examples={self.num_examples}, "
            f"expected_batch_size={self.expected_batch_size}, "
            f"steps_per_epoch={self.steps_per_epoch}, "
            f"padded_size={self.padded_size})"
        )

    @property
    def num_records(self):
        """The records the draws index: `num_examples` (a user sampler's differ)."""
        return self.num_examples

    def shard_population(self, num_workers):
        """The most units (records, or users) of one worker's shard (index %
        W == w) that a draw can include, each with probability
        `sampling_probability`: what a shard's padded length is sized for
        (`tfdp.distribute.distribute_poisson_batches`).

        Example:

        >>> PoissonSampler(1000, 10).shard_population(3)
        334
        """
        return -(-self.num_examples // int(num_workers))

    def sample_indices(self, key, step):
        """Step `step`'s Poisson draw (`tfdp.data.sampling.poisson_indices`).

        Each record is included independently with probability `q`; the draw
        is a function of (`key`, `step`) only.

        Args:
            key: int64 [2], the stream's key (`key`, or a key derived from it).
            step: integer scalar, the step's number.

        Returns:
            int64 tensor: the sorted indices of the included records
            (possibly empty).

        Example:

        >>> sampler = PoissonSampler(10, 10, seed=0)
        >>> sampler.sample_indices(sampler.key, 0).numpy()
        array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
        """
        return poisson_indices(
            fold_key(key, step), self.num_examples, self.sampling_probability
        )

    def padded_length(self, count):
        """The padded length of a draw of `count` records (a tensor).

        `padded_size` if the draw fits, else the smallest multiple of
        `padded_size` that holds it (with `fixed_shape=False`: the smallest
        positive multiple of `multiple` that holds it): never shorter than
        the draw.
        """
        count = tf.cast(count, tf.int64)
        unit = self.padded_size if self.fixed_shape else self.multiple
        return tf.maximum(tf.constant(unit, tf.int64), (count + unit - 1) // unit * unit)

    def pad(self, indices):
        """Pads a draw (see `padded_length`); it is never truncated.

        Args:
            indices: 1-D integer tensor, one step's sampled indices.

        Returns:
            dict with "indices" (int64 [L]) and "mask" (float32 [L]); padding
            rows have index 0 and mask 0.

        Example:

        >>> sampler = PoissonSampler(100, 10, seed=0)
        >>> draw = sampler.pad(tf.constant([3, 7]))
        >>> draw["indices"].numpy()[:3], draw["mask"].numpy()[:3]
        (array([3, 7, 0]), array([1., 1., 0.], dtype=float32))
        """
        return padded_draw(indices, self.padded_length(tf.size(indices)))

    def draw(self, key, step):
        """Step `step`'s draw, `draw_in_graph(key, step)` run as traced.

        The sampler interface of `tfdp.data.sampling.draws`: in the graph,
        a function of (`key`, `step`) only (`traced_draw` says how often it
        is traced).
        """
        return self.traced_draw()(tf.cast(key, tf.int64), tf.cast(step, tf.int64))

    def draw_in_graph(self, key, step):
        """The draw's ops: `pad(sample_indices(key, step))`."""
        return self.pad(self.sample_indices(key, step))

    def traced_draw(self):
        """`draw_in_graph` as a `tf.function`, shared by samplers that draw
        alike (same class, `sample_indices`, N, q and padding): `fit` makes a
        sampler a call, and retracing the draw cost about 0.2 s a `fit`. A
        sampler whose draw reads data of its own (record groups, users'
        records) traces its own: `_trace_own_draw`."""
        pick = self.sample_indices
        config = (type(self), getattr(pick, "__func__", pick), self.num_examples,
                  self.sampling_probability, self.padded_size, self.multiple,
                  self.fixed_shape)
        traced = _TRACED_DRAWS.get(config)
        if traced is None:
            if len(_TRACED_DRAWS) >= _MOST_TRACED_DRAWS:
                del _TRACED_DRAWS[next(iter(_TRACED_DRAWS))]
            traced = _TRACED_DRAWS[config] = _trace(self.draw_in_graph)
        return traced

    def _trace_own_draw(self):
        """`draw_in_graph` traced once for this sampler alone (see `traced_draw`)."""
        if self._own_draw is None:
            self._own_draw = _trace(self.draw_in_graph)
        return self._own_draw


_TRACED_DRAWS = {}
_MOST_TRACED_DRAWS = 32


def _trace(draw_in_graph):
    """`draw_in_graph(key, step)` as a `tf.function` of an int64 [2] key and
    an int64 step."""
    return tf.function(
        draw_in_graph, autograph=False,
        input_signature=[tf.TensorSpec([2], tf.int64), tf.TensorSpec([], tf.int64)],
    )


# tf.data ------------------------------------------------------------------------


def _leaf_paths(structure, path=""):
    """Readable paths of the leaves of a nested structure, in `tf.nest` order."""
    if isinstance(structure, Mapping):
        items = [(f"{path}[{key!r}]", structure[key]) for key in sorted(structure)]
    elif isinstance(structure, (list, tuple)):
        items = [(f"{path}[{i}]", value) for i, value in enumerate(structure)]
    else:
        return [f"arrays{path}"]
    paths = []
    for child_path, value in items:
        paths.extend(_leaf_paths(value, child_path))
    return paths


def make_dataset(sampler, arrays, *, first_step=0, repeat=False):
    """A `tf.data.Dataset` of Poisson-sampled, padded batches.

    Each element is one training step: `(batch_arrays, mask)`, where
    `batch_arrays` has the structure of `arrays` with each array gathered at
    the step's indices (leading dimension L, usually `sampler.padded_size`)
    and `mask` is float32 `[L]` (1 for a sampled record, 0 for padding).
    Iterating the dataset yields exactly `sampler.steps_per_epoch` elements,
    and every iteration (every Keras epoch) draws fresh batches. With
    `repeat=True` it yields steps endlessly instead (pass Keras
    `steps_per_epoch`; Keras then keeps one iterator for the whole `fit`).
    The leading dimension in `element_spec` is None so that a rare oversized
    draw (padded to a multiple of `padded_size`) fits the same signature.

    The draws happen in TensorFlow (`tfdp.data.sampling`): step t's draw is
    a function of the sampler's secret key and t, so no Python runs on the
    pipeline's threads for in-memory arrays, which are converted to tensors
    once and gathered in TensorFlow. A source (`tfdp.data.RecordSource`,
    `ArraySource`) or a tuple `(x, y[, w])` holding a NumPy memmap is never
    loaded whole: each step reads only its sampled records
    (`tfdp.data.reader`).

    Args:
        sampler: a `PoissonSampler`.
        arrays: a nested structure (tuple, list, dict) of numpy arrays or
            tensors, all with first dimension `sampler.num_examples`, or a
            source of `sampler.num_examples` records.
        first_step: int >= 0, the number of the first step (the draws of
            steps t and t' differ; `fit` starts at the steps already run).
        repeat: False (one epoch per iteration) or True (endless).

    Returns:
        A `tf.data.Dataset` with known cardinality `sampler.steps_per_epoch`
        (infinite with `repeat=True`).

    Example:

    >>> x, y = np.zeros((1000, 3), np.float32), np.arange(1000)
    >>> sampler = PoissonSampler(len(x), expected_batch_size=50, seed=0)
    >>> dataset = make_dataset(sampler, (x, y))
    >>> for (x_batch, y_batch), mask in dataset.take(1):
    ...     print(x_batch.shape, int(tf.reduce_sum(mask)) <= x_batch.shape[0])
    (88, 3) True
    """
    if not isinstance(sampler, PoissonSampler):
        raise TypeError(
            "Expected `sampler` to be a `PoissonSampler`. "
            f"Received: sampler={sampler!r} of type {type(sampler).__name__}"
        )
    if not _is_int(first_step) or first_step < 0:
        raise ValueError(
            f"Expected `first_step` to be an integer >= 0. Received: first_step={first_step!r}"
        )
    steps = None if repeat else sampler.steps_per_epoch
    pairs = draws(sampler, sampler.key, first_step, steps).map(
        lambda draw: (draw["indices"], draw["mask"])
    )
    source = as_source(arrays)
    if source is not None:
        if len(source) != sampler.num_records:
            raise ValueError(
                f"Expected the source to hold the sampler's {_records_name(sampler)} "
                f"({sampler.num_records}) records. Received: {len(source)} records"
            )
        return _finish(steps, read_batches(pairs, source, rows=sampler.padded_size))
    leaves = tf.nest.flatten(arrays)
    paths = _leaf_paths(arrays)
    if len(paths) != len(leaves):
        paths = [f"leaf {i} of arrays" for i in range(len(leaves))]
    if not leaves:
        raise ValueError(
            "Expected `arrays` to hold at least one array. "
            f"Received: arrays={arrays!r}"
        )
    tensors = []
    for path, value in zip(paths, leaves):
        if value is None:
            raise ValueError(f"Expected an array at `{path}`. Received: None")
        tensor = tf.convert_to_tensor(value)
        if tensor.shape.rank is None or tensor.shape.rank == 0:
            raise ValueError(
                f"Expected `{path}` to have a first (example) dimension. "
                f"Received: shape={tensor.shape}"
            )
        tensors.append(tensor)
    for path, tensor in zip(paths, tensors):
        if tensor.shape[0] != sampler.num_records:
            first_dims = ", ".join(
                f"{p}: {t.shape[0]}" for p, t in zip(paths, tensors)
            )
            raise ValueError(
                "Expected every array in `arrays` to have first dimension "
                f"equal to the sampler's {_records_name(sampler)} ({sampler.num_records}). "
                f"Received: {path} with first dimension {tensor.shape[0]} "
                f"(first dimensions: {first_dims})"
            )
    structure = tf.nest.pack_sequence_as(arrays, tensors)
    return _finish(steps, gathered_batches(pairs, structure))


def _records_name(sampler):
    """How errors name the sampler's record count: a user sampler's
    `num_examples` counts users, not the records its draws index."""
    return "num_examples" if sampler.num_records == sampler.num_examples else "num_records"


PREFETCHED_STEPS = 2


def _finish(steps, dataset):
    """Cardinality (`steps`, or infinite for None), prefetch of
    `PREFETCHED_STEPS` batches, no autotuning, no static optimizations.

    Keras makes a new iterator over a finite dataset at every epoch end, and
    with tf.data's autotuning on, deleting the old one waited for its
    tuning thread: about 0.5 s at one epoch end in two (tanh CNN at batch
    2048, 6-step epochs: 0.75 s an epoch, 1.25 s with the wait). Without it
    the map keeps its default parallelism (one call per core).

    tf.data's default static optimizations rewrite the pipeline's graph when
    an iterator is made, and that graph holds the in-memory arrays the
    gather reads: every iterator (every `fit`) serialized and copied them,
    a cost that grew with the data (`benchmarks/pipeline_start.py`). The
    pipeline is already what they would make of it (its gather is a
    parallel map, its end a prefetch), so they are off.
    """
    cardinality = tf.data.INFINITE_CARDINALITY if steps is None else steps
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(cardinality))
    options = tf.data.Options()
    options.autotune.enabled = False
    return unrewritten(dataset.prefetch(PREFETCHED_STEPS).with_options(options))


def unrewritten(dataset):
    """`dataset` with tf.data's default static optimizations off: making an
    iterator then leaves the pipeline's graph, and the in-memory arrays it
    holds, as they are (see `_finish`).

    Example:

    >>> options = unrewritten(tf.data.Dataset.range(3)).options()
    >>> options.experimental_optimization.apply_default_optimizations
    False
    """
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    return dataset.with_options(options)


def gathered_batches(pairs, tensors):
    """`(batch, mask)` elements from a dataset of `(indices, mask)` pairs.

    Args:
        pairs: a `tf.data.Dataset` of (int64 [L], float32 [L]) pairs, e.g.
            a sampler's draws (`tfdp.data.sampling.draws`).
        tensors: a nested structure of tensors, gathered at `indices`, or
            a source (`tfdp.data.sources.as_source`), read at `indices`.

    Returns:
        A `tf.data.Dataset` of `(batch, mask)`, batches gathered in
        TensorFlow (or read from the source), in the order of `pairs`.

    Example:

    >>> pairs = tf.data.Dataset.from_tensors((tf.constant([4, 1, 0], tf.int64),
    ...                                       tf.constant([1.0, 1.0, 0.0])))
    >>> batch, mask = next(iter(gathered_batches(pairs, tf.range(10) * 2)))
    >>> batch.numpy(), mask.numpy()
    (array([8, 2, 0], dtype=int32), array([1., 1., 0.], dtype=float32))
    """
    source = as_source(tensors)
    if source is not None:
        return read_batches(pairs, source)

    def gather(rows, mask):
        return tf.nest.map_structure(lambda t: tf.gather(t, rows), tensors), mask

    return pairs.map(gather, num_parallel_calls=tf.data.AUTOTUNE)
