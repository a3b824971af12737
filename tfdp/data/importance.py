"""The DPIS sampler: importance-sampled batches, padded to a fixed shape.

DPIS (docs/mechanisms/dpis.md) draws each step's batch in two stages. Stage 1
(here) includes record i independently with probability
q_i = b * ghat_i / K~, where ghat_i is the record's current bound in the
per-record table (k times its last clipped gradient norm, capped at K~ / b).
Stage 2 needs the record's *current* gradient, which only the train step has,
so it runs in the optimizer (`DPIS.privatize`): it accepts row i with
probability ||g_i clipped|| / ghat_i using the uniform draw this sampler ships
with the batch.

Every batch is padded to `padded_size` rows with a mask, so the compiled train
step sees one shape. `padded_size` is chosen at the start of each epoch from
an estimate of the stage-1 size sum_i q_i that the caller computes from
RELEASED values (the ghat table and the record count are private, and the
padded length is observable): `padded_batch_size` on a Binomial with that
mean over the released record count. By Hoeffding's theorem the independent
(Poisson-binomial) count exceeds a length P no more often than a Binomial
with the same mean, so with a good estimate overflows are rare. A larger
draw is never truncated (that would change the sampling distribution the
accounting assumes): it is padded to the next multiple of `padded_size`.

The dataset built by `make_importance_dataset` runs synchronously (no
prefetch, no parallel map): each draw reads the ghat table right before its
step, after the previous step refreshed it.

Example:

```python
sampler = ImportanceSampler(num_examples=1000, expected_batch_size=50, seed=0)
sampler.start_epoch(k_tilde=40.0, ghat=np.full(1000, 0.2),    # q_i = 0.25
                    expected_size=250.0, population=1000.0)
draw = sampler.draw()
draw["indices"][draw["mask"] == 1]    # stage-1 records of one step
```
"""

import numbers

import numpy as np
import tensorflow as tf

from tfdp.data.poisson import (
    DEFAULT_OVERFLOW_PROBABILITY,
    _check_num_examples,
    _is_int,
    default_steps_per_epoch,
    padded_batch_size,
)
from tfdp.data.sampling import ALGORITHM, fold_key, padded_draw, sampling_key
from tfdp.mechanisms import importance_sampling

__all__ = ["ImportanceSampler", "make_importance_dataset"]

# Step-info keys the sampler adds to every batch (besides "mask" and
# "expected_batch_size", which every tfdp batch has).
STEP_INFO_KEYS = ("indices", "ghat", "uniform", "num_examples")


def _check_seed(seed):
    """`seed` for `sampling_key`: None, an int >= 0 or a 1-D sequence of ints."""
    if seed is None or (_is_int(seed) and seed >= 0):
        return seed
    if _is_int(seed):
        raise ValueError(f"Expected `seed` >= 0. Received: seed={seed}")
    words = np.asarray(seed)
    if words.ndim != 1 or words.size == 0 or words.dtype.kind not in "iu":
        raise TypeError(
            "Expected `seed` to be None, an int or a 1-D sequence of ints. "
            f"Received: seed={seed!r}"
        )
    return [int(w) for w in words.astype(np.int64).view(np.uint64)]


class ImportanceSampler:
    """Stage 1 of DPIS: draws records with probability b * ghat_i / K~.

    Call `start_epoch(k_tilde, ...)` at the start of each epoch (DPIS does,
    after it releases K~); then each draw (an element of
    `make_importance_dataset`, or `draw()` by hand) is one step's stage-1
    set, padded with a mask, together with the ghat_i it used and one
    U[0, 1) number per row for stage 2.

    The draws happen in the TensorFlow graph, reading the per-record table
    `ghat_table` (a variable the train step refreshes) at each draw; the
    draw of an epoch's n-th step is keyed by (seed, epoch index, n), so no
    Python runs in the input pipeline.

    Args:
        num_examples: int, the number of records N (>= 1).
        expected_batch_size: number in [1, num_examples], b.
        steps_per_epoch: int >= 1, the draws per epoch (default
            round(N / b), as `PoissonSampler`).
        seed: None (OS entropy), an int, or a sequence of ints. Epoch e's
            draws are keyed by (seed, e), so a resumed run (later epoch
            index) never replays earlier draws.
        overflow_probability: float in (0, 1), passed to `padded_batch_size`.
        multiple: int >= 1, passed to `padded_batch_size`.
        ghat_table: None (the sampler makes its own float32 [N] variable) or
            a float32 `tf.Variable` holding one ghat per record, read at
            every draw.

    Attributes:
        ghat_table: the per-record table the draws read.
        padded_size: the current epoch's padded batch length.
        k_tilde: the current epoch's K~.
        epoch_index: the current epoch's index.
        overflow_count: draws longer than `padded_size` so far.
        draw_count: draws so far.
        stage1_count: records drawn in stage 1 so far.

    Example:

    >>> sampler = ImportanceSampler(1000, 50, seed=0)
    >>> sampler.start_epoch(40.0, np.full(1000, 0.2), expected_size=250.0, population=1000.0)
    >>> sampler.padded_size
    320
    >>> sorted(sampler.draw())
    ['ghat', 'indices', 'mask', 'uniform']
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
        ghat_table=None,
    ):
        self.num_examples = _check_num_examples(num_examples)
        if isinstance(expected_batch_size, bool) or not isinstance(
            expected_batch_size, numbers.Real
        ):
            raise TypeError(
                "Expected `expected_batch_size` to be a number. Received: "
                f"expected_batch_size={expected_batch_size!r}"
            )
        if not 1 <= expected_batch_size <= self.num_examples:
            raise ValueError(
                "Expected 1 <= `expected_batch_size` <= the number of examples "
                f"({self.num_examples}). Received: expected_batch_size={expected_batch_size}"
            )
        self.expected_batch_size = float(expected_batch_size)
        if steps_per_epoch is None:
            steps_per_epoch = default_steps_per_epoch(self.num_examples, expected_batch_size)
        elif not _is_int(steps_per_epoch) or steps_per_epoch < 1:
            raise ValueError(
                "Expected `steps_per_epoch` to be an integer >= 1. "
                f"Received: steps_per_epoch={steps_per_epoch!r}"
            )
        self.steps_per_epoch = int(steps_per_epoch)
        self.key = sampling_key(_check_seed(seed))
        self._overflow_probability = overflow_probability
        self._multiple = multiple
        if ghat_table is None:
            ghat_table = tf.Variable(tf.ones([self.num_examples], tf.float32), trainable=False)
        elif not isinstance(ghat_table, tf.Variable) or ghat_table.dtype != tf.float32:
            raise TypeError(
                "Expected `ghat_table` to be None or a float32 tf.Variable. Received: "
                f"ghat_table={ghat_table!r}"
            )
        self.ghat_table = ghat_table
        # What the graph reads at each draw (assigned by start_epoch).
        self._scale = tf.Variable(0.0, dtype=tf.float32, trainable=False)  # b / K~
        self._padded = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._epoch = tf.Variable(-1, dtype=tf.int64, trainable=False)
        self._epoch_draws = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._counts = tf.Variable([0, 0, 0], dtype=tf.int64, trainable=False)  # draws, overflows, stage 1
        self.k_tilde = None
        self.padded_size = None
        self.epoch_index = None

    def __repr__(self):
        return (
            f"ImportanceSampler(num_examples={self.num_examples}, "
            f"expected_batch_size={self.expected_batch_size:g}, "
            f"steps_per_epoch={self.steps_per_epoch}, padded_size={self.padded_size})"
        )

    @property
    def draw_count(self):
        return int(self._counts[0].numpy())

    @property
    def overflow_count(self):
        return int(self._counts[1].numpy())

    @property
    def stage1_count(self):
        return int(self._counts[2].numpy())

    def start_epoch(self, k_tilde, ghat=None, epoch_index=0, *, expected_size, population):
        """Sets the epoch's K~ (and ghat table), and sizes its padded batches.

        Args:
            k_tilde: the epoch's released K~ (> 0).
            ghat: None (`ghat_table` already holds the epoch's bounds) or an
                array [N] of per-record bounds, assigned to `ghat_table`.
                The table is read at every draw, so the train step's
                refreshes take effect.
            epoch_index: int >= 0, keys this epoch's random draws.
            expected_size: the stage-1 size (sum_i q_i) the padding is sized
                for, a number > 0. Compute it from released values (DPIS
                uses `importance_sampling.released_first_stage_size`), never
                from the private ghat table.
            population: the released record count (N~) the padding's
                Binomial is taken over, a number > 0; never the private N.
        """
        k_tilde = float(k_tilde)
        if not np.isfinite(k_tilde) or k_tilde <= 0:
            raise ValueError(f"Expected `k_tilde` > 0. Received: k_tilde={k_tilde}")
        if not _is_int(epoch_index) or epoch_index < 0:
            raise ValueError(f"Expected `epoch_index` >= 0. Received: epoch_index={epoch_index!r}")
        for name, value in (("expected_size", expected_size), ("population", population)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                np.isfinite(value) and value > 0
            ):
                raise ValueError(f"Expected `{name}` > 0. Received: {name}={value!r}")
        if ghat is not None:
            ghat = np.asarray(ghat, np.float32).reshape(-1)
            if ghat.shape[0] != self.num_examples:
                raise ValueError(
                    f"Expected one ghat per record ({self.num_examples}). Received: "
                    f"ghat with {ghat.shape[0]} entries"
                )
            self.ghat_table.assign(ghat)
        entries = int(tf.size(self.ghat_table))
        if entries != self.num_examples:
            raise ValueError(
                f"Expected one ghat per record ({self.num_examples}) in `ghat_table`. "
                f"Received: a table of {entries} entries"
            )
        trials = max(1, int(round(population)), int(np.ceil(expected_size)))
        self.padded_size = padded_batch_size(
            trials,
            min(1.0, max(float(expected_size), 1.0) / trials),
            overflow_probability=self._overflow_probability,
            multiple=self._multiple,
        )
        self.k_tilde = k_tilde
        self.epoch_index = int(epoch_index)
        self._scale.assign(np.float32(self.expected_batch_size / k_tilde))
        self._padded.assign(self.padded_size)
        self._epoch.assign(self.epoch_index)
        self._epoch_draws.assign(0)

    def expected_stage1_size(self):
        """sum_i q_i for the current ghat table (the mean stage-1 count).

        Private (it reads the ghat table): for tests and diagnostics only.
        """
        q = importance_sampling.first_stage_probabilities(
            self.ghat_table.numpy(), self.k_tilde, self.expected_batch_size
        )
        return float(np.sum(q, dtype=np.float64))

    def draw_tensors(self):
        """The next step's stage-1 draw, in the graph (advances the counts).

        Record i joins with probability q_i = min(1, b ghat_i / K~) (float32,
        as `importance_sampling.first_stage_probabilities`), by comparing
        q_i with a float64 uniform keyed by (seed, epoch, draw number) and
        its index i; its stage-2 uniform is keyed alike. Both are i.i.d.
        over records and read no other record's data: replacing a record
        leaves every other record's draws bit for bit the same, and removing
        one leaves the others' draws the same in law (a record's only
        identity is its index; tests/data/test_sampler_coupling.py).

        Returns:
            dict of tensors of length L (`padded_size`, or a multiple of it
            for a rare larger draw): "indices" (int64, 0 on padding), "mask"
            (float32, 1 for drawn records), "ghat" (float32, the bound each
            drawn record was sampled with; 1 on padding) and "uniform"
            (float32 U[0, 1) draws for stage 2, each drawn record's own; 0
            on padding).
        """
        number = self._epoch_draws.assign_add(1) - 1
        key = fold_key(self.key, self._epoch.read_value(), number)
        table = tf.reshape(self.ghat_table.read_value(), [-1])
        probabilities = tf.clip_by_value(table * self._scale.read_value(), 0.0, 1.0)
        coins = tf.random.stateless_uniform(
            [self.num_examples], seed=fold_key(key, 0), dtype=tf.float64, alg=ALGORITHM
        )
        chosen = tf.where(coins < tf.cast(probabilities, tf.float64))[:, 0]
        count = tf.size(chosen, out_type=tf.int64)
        unit = self._padded.read_value()
        length = tf.maximum(unit, (count + unit - 1) // unit * unit)
        draw = padded_draw(chosen, length)
        draw["ghat"] = tf.pad(tf.gather(table, chosen), [[0, length - count]], constant_values=1.0)
        # Each record's own stage-2 uniform (one per record, gathered), not
        # one per row: a row's position moves when another record joins or
        # leaves, a record's index does not.
        uniforms = tf.random.stateless_uniform(
            [self.num_examples], seed=fold_key(key, 1), dtype=tf.float32, alg=ALGORITHM
        )
        draw["uniform"] = tf.pad(tf.gather(uniforms, chosen), [[0, length - count]])
        self._counts.assign_add(tf.stack([1, tf.cast(count > unit, tf.int64), count]))
        return draw

    def draw(self):
        """One step's stage-1 draw, run eagerly (see `draw_tensors`).

        Returns:
            dict of NumPy arrays: "indices", "mask", "ghat", "uniform".
        """
        if self.k_tilde is None:
            raise ValueError("Call start_epoch(k_tilde, ...) before drawing batches.")
        return {name: value.numpy() for name, value in self.draw_tensors().items()}

    def epoch(self):
        """Yields `steps_per_epoch` draws (see `draw`)."""
        for _ in range(self.steps_per_epoch):
            yield self.draw()


def _as_tensors(sampler, arrays):
    leaves = tf.nest.flatten(arrays)
    if not leaves:
        raise ValueError(f"Expected `arrays` to hold at least one array. Received: arrays={arrays!r}")
    tensors = []
    for i, value in enumerate(leaves):
        if value is None:
            raise ValueError(f"Expected an array at leaf {i} of `arrays`. Received: None")
        tensor = tf.convert_to_tensor(value)
        if tensor.shape.rank is None or tensor.shape.rank == 0 or tensor.shape[0] != sampler.num_examples:
            raise ValueError(
                "Expected every array in `arrays` to have first dimension equal to the "
                f"sampler's num_examples ({sampler.num_examples}). Received: leaf {i} "
                f"with shape {tensor.shape}"
            )
        tensors.append(tensor)
    return tf.nest.pack_sequence_as(arrays, tensors)


def make_importance_dataset(sampler, arrays):
    """A `tf.data.Dataset` of DPIS stage-1 batches, one element per step.

    Each element is `(batch_arrays, step_info)`: `batch_arrays` has the
    structure of `arrays` gathered at the drawn indices; `step_info` holds
    "mask", "expected_batch_size" (b), "indices", "ghat", "uniform" (see
    `ImportanceSampler.draw`) and "num_examples" (N). The pipeline is
    synchronous: every draw happens when the train step asks for it, so it
    reads the ghat table as the previous step left it (prefetching would
    sample with stale bounds).

    Args:
        sampler: an `ImportanceSampler` (its `start_epoch` is called before
            each epoch is iterated). The draws happen in the graph
            (`ImportanceSampler.draw_tensors`): no Python runs in the
            pipeline.
        arrays: nested structure of arrays with first dimension N.

    Returns:
        A `tf.data.Dataset` with cardinality `sampler.steps_per_epoch`; each
        iteration draws a fresh epoch.
    """
    if not isinstance(sampler, ImportanceSampler):
        raise TypeError(
            "Expected `sampler` to be an `ImportanceSampler`. Received: "
            f"sampler={sampler!r} of type {type(sampler).__name__}"
        )
    structure = _as_tensors(sampler, arrays)
    expected = tf.constant(sampler.expected_batch_size, tf.float32)
    num_examples = tf.constant(float(sampler.num_examples), tf.float32)

    def gather(_):
        draw = sampler.draw_tensors()
        batch = tf.nest.map_structure(lambda t: tf.gather(t, draw["indices"]), structure)
        info = dict(draw, expected_batch_size=expected, num_examples=num_examples)
        return batch, info

    # Sequential: each draw reads the ghat table as the previous step left it.
    dataset = tf.data.Dataset.range(sampler.steps_per_epoch).map(gather)
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(sampler.steps_per_epoch))
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_optimization.inject_prefetch = False
    options.experimental_optimization.map_parallelization = False
    options.autotune.enabled = False
    return dataset.with_options(options)
