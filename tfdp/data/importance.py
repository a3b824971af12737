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
import threading

import numpy as np
import tensorflow as tf

from tfdp.data.poisson import (
    DEFAULT_OVERFLOW_PROBABILITY,
    _check_num_examples,
    _is_int,
    _round_up,
    default_steps_per_epoch,
    padded_batch_size,
)
from tfdp.mechanisms import importance_sampling

__all__ = ["ImportanceSampler", "make_importance_dataset"]

# Step-info keys the sampler adds to every batch (besides "mask" and
# "expected_batch_size", which every tfdp batch has).
STEP_INFO_KEYS = ("indices", "ghat", "uniform", "num_examples")


def _entropy(seed):
    """Entropy words for numpy's SeedSequence (OS entropy when seed is None)."""
    if seed is None:
        return np.random.SeedSequence().entropy
    if _is_int(seed):
        if seed < 0:
            raise ValueError(f"Expected `seed` >= 0. Received: seed={seed}")
        return int(seed)
    words = np.asarray(seed)
    if words.ndim != 1 or words.size == 0 or words.dtype.kind not in "iu":
        raise TypeError(
            "Expected `seed` to be None, an int or a 1-D sequence of ints. "
            f"Received: seed={seed!r}"
        )
    return [int(w) for w in words.astype(np.int64).view(np.uint64)]


class ImportanceSampler:
    """Stage 1 of DPIS: draws records with probability b * ghat_i / K~.

    Call `start_epoch(k_tilde, ghat, ...)` at the start of each epoch (DPIS does,
    after it releases K~); then each `draw()` (or each element of `epoch()`)
    is one step's stage-1 set, padded with a mask, together with the ghat_i
    it used and one U[0, 1) number per row for stage 2.

    Args:
        num_examples: int, the number of records N (>= 1).
        expected_batch_size: number in [1, num_examples], b.
        steps_per_epoch: int >= 1, the draws per epoch (default
            round(N / b), as `PoissonSampler`).
        seed: None (OS entropy), an int, or a sequence of ints. Epoch e's
            draws come from a generator keyed by (seed, e), so a resumed run
            (later epoch index) never replays earlier draws.
        overflow_probability: float in (0, 1), passed to `padded_batch_size`.
        multiple: int >= 1, passed to `padded_batch_size`.

    Attributes:
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
        self._entropy = _entropy(seed)
        self._overflow_probability = overflow_probability
        self._multiple = multiple
        self._ghat_source = None
        self._rng = None
        self._lock = threading.Lock()
        self.k_tilde = None
        self.padded_size = None
        self.epoch_index = None
        self.overflow_count = 0
        self.draw_count = 0
        self.stage1_count = 0

    def __repr__(self):
        return (
            f"ImportanceSampler(num_examples={self.num_examples}, "
            f"expected_batch_size={self.expected_batch_size:g}, "
            f"steps_per_epoch={self.steps_per_epoch}, padded_size={self.padded_size})"
        )

    def _read_ghat(self):
        source = self._ghat_source
        ghat = source() if callable(source) else source
        ghat = np.asarray(ghat, np.float32).reshape(-1)
        if ghat.shape[0] != self.num_examples:
            raise ValueError(
                f"Expected one ghat per record ({self.num_examples}). Received: "
                f"ghat with {ghat.shape[0]} entries"
            )
        return ghat

    def start_epoch(self, k_tilde, ghat, epoch_index=0, *, expected_size, population):
        """Sets the epoch's K~ and ghat table, and sizes its padded batches.

        Args:
            k_tilde: the epoch's released K~ (> 0).
            ghat: array [N] of per-record bounds, or a zero-argument callable
                returning it (read at every draw, so the train step's
                refreshes take effect).
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
        trials = max(1, int(round(population)), int(np.ceil(expected_size)))
        with self._lock:
            self.k_tilde = k_tilde
            self._ghat_source = ghat
            self._read_ghat()  # checks its length now
            self.padded_size = padded_batch_size(
                trials,
                min(1.0, max(float(expected_size), 1.0) / trials),
                overflow_probability=self._overflow_probability,
                multiple=self._multiple,
            )
            self.epoch_index = int(epoch_index)
            sequence = np.random.SeedSequence(self._entropy, spawn_key=(self.epoch_index,))
            self._rng = np.random.default_rng(sequence)

    def expected_stage1_size(self):
        """sum_i q_i for the current ghat table (the mean stage-1 count).

        Private (it reads the ghat table): for tests and diagnostics only.
        """
        q = importance_sampling.first_stage_probabilities(
            self._read_ghat(), self.k_tilde, self.expected_batch_size
        )
        return float(np.sum(q, dtype=np.float64))

    def draw(self):
        """One step's stage-1 draw.

        Returns:
            dict of arrays of length L (`padded_size`, or a multiple of it for
            a rare larger draw): "indices" (int64, 0 on padding), "mask"
            (float32, 1 for drawn records), "ghat" (float32, the bound each
            drawn record was sampled with; 1 on padding) and "uniform"
            (float32 U[0, 1) draws for stage 2).
        """
        if self._rng is None:
            raise ValueError("Call start_epoch(k_tilde, ghat, ...) before drawing batches.")
        with self._lock:
            ghat = self._read_ghat()
            q = importance_sampling.first_stage_probabilities(
                ghat, self.k_tilde, self.expected_batch_size
            )
            chosen = np.flatnonzero(self._rng.random(self.num_examples) < q)
            count = len(chosen)
            length = self.padded_size
            if count > length:
                length = _round_up(count, self.padded_size)
                self.overflow_count += 1
            indices = np.zeros(length, np.int64)
            indices[:count] = chosen
            mask = np.zeros(length, np.float32)
            mask[:count] = 1.0
            bounds = np.ones(length, np.float32)
            bounds[:count] = ghat[chosen]
            uniform = self._rng.random(length, dtype=np.float32)
            self.draw_count += 1
            self.stage1_count += count
        return {"indices": indices, "mask": mask, "ghat": bounds, "uniform": uniform}

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
            each epoch is iterated).
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

    def generator():
        for draw in sampler.epoch():
            yield draw["indices"], draw["mask"], draw["ghat"], draw["uniform"]

    spec = tf.TensorSpec(shape=[None], dtype=tf.float32)
    dataset = tf.data.Dataset.from_generator(
        generator,
        output_signature=(tf.TensorSpec(shape=[None], dtype=tf.int64), spec, spec, spec),
    )

    def gather(indices, mask, ghat, uniform):
        batch = tf.nest.map_structure(lambda t: tf.gather(t, indices), structure)
        info = {
            "mask": mask,
            "expected_batch_size": expected,
            "indices": indices,
            "ghat": ghat,
            "uniform": uniform,
            "num_examples": num_examples,
        }
        return batch, info

    dataset = dataset.map(gather)
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(sampler.steps_per_epoch))
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_optimization.inject_prefetch = False
    options.experimental_optimization.map_parallelization = False
    options.autotune.enabled = False
    return dataset.with_options(options)
