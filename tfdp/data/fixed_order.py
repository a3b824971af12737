"""A `tf.data` pipeline read in the same order every epoch (for DP-BandMF).

DP-BandMF's accounting in a fixed order (`tfdp.accounting.bandmf`) needs
each record to appear in exactly one batch of every epoch of P batches, at
the same position each time, so that two of its participations are P >= b
steps apart. A `tf.data.Dataset` qualifies when all of these hold, and
`FixedOrderData` refuses by name what breaks them:

- it is finite with a known cardinality (P batches): not `repeat()` (the
  epoch would be several passes, and `repeat(k)` puts a record k times in
  one), not an unknown cardinality (`filter`, `flat_map`, `from_generator`:
  assert it with `tf.data.experimental.assert_cardinality(P)` if you know
  it);
- its elements are batches `(x, y)` or `(x, y, sample_weight)` of one fixed
  size B: `batch(B, drop_remainder=True)`, so the static batch dimension is
  known (the noise is added to a sum over B records and divided by B);
- its order is the same in every pass: no shuffle that reshuffles each
  iteration (`shuffle` or tf.data's global shuffle with
  `reshuffle_each_iteration=True`, the default, or any other transformation
  named like a shuffle), unless a `cache()` after it freezes the first
  pass's order; no `shuffle_and_repeat`, no `Dataset.random`, no
  `sample_from_datasets`, no parallel `map`, `interleave` or `batch` with
  `deterministic=False`. `shuffle(n, reshuffle_each_iteration=False)`
  shuffles once (give it a `seed` to keep the order across processes: a
  resumed run must see the same order);
- P >= `bands` (checked by the optimizer).

Each record must be one element of the un-batched pipeline: tfdp cannot see
a record you put in twice (the same data concatenated twice counts as two
records).

The pipeline's own structure is checked before training. The order itself
is also checked while training: tfdp fingerprints each of the P batches of
the first pass, features, labels and sample weights (`batch_fingerprint`),
and stops with an error, before that batch is trained on, when a later pass
(or a resumed run) brings a batch that differs in any of them at the same
position. That catches what a structural check cannot: a generator or a
`py_function` that yields in another order, a shuffle seeded differently
after a resume, a reorder hidden behind constant labels. What is trained on
is therefore the first pass's sequence of batches, bit for bit, in every
pass; a reorder that leaves every batch identical changes nothing the model
sees. The price: a pipeline whose content changes between passes (random
augmentation in a `map`) is stopped too; augment in the model instead.

Example:

>>> import numpy as np, tensorflow as tf
>>> x, y = np.zeros((96, 4), "float32"), np.arange(96) % 3
>>> ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)
>>> data = FixedOrderData(ds, planned_steps=6)
>>> data.steps_per_epoch, data.batch_size, len(data)
(3, 32, 96)
>>> FixedOrderData(ds.repeat(), planned_steps=6)
Traceback (most recent call last):
...
ValueError: ...infinite (repeat())...Received: cardinality=infinite
"""

import hashlib
import re

import numpy as np
import tensorflow as tf

from tfdp.data import read_failures

# Python classes of tf.data's transformations, by name (tensorflow/python/
# data/ops). Private names, read only to refuse what breaks the order; the
# fingerprint check while training does not depend on them.
_REPEAT = ("_RepeatDataset",)
_SHUFFLE = ("_ShuffleDataset", "ShuffleDataset", "_GlobalShuffleDataset")
_SHUFFLE_AND_REPEAT = ("_ShuffleAndRepeatDataset",)
_RANDOM = ("_RandomDataset", "RandomDataset", "RandomDatasetV2", "_DirectedInterleaveDataset")
_CACHE = ("CacheDataset", "_CacheDataset", "_MemoryCacheDataset")


class FixedOrderData:
    """A checked `tf.data` pipeline for `fit` with a DP-BandMF optimizer.

    Args:
        dataset: a `tf.data.Dataset` of batches `(x, y)` or `(x, y,
            sample_weight)` that qualifies (see the module docstring).
        planned_steps: the steps the `fit` call plans (epochs x P), for the
            strategy's coefficients.

    Attributes:
        dataset: the pipeline.
        steps_per_epoch: P, its number of batches.
        batch_size: B, the fixed batch size.
        planned_steps: as given.

    Raises:
        TypeError: if `dataset` is not a `tf.data.Dataset` of tuples.
        ValueError: naming what breaks the fixed order (see above).
    """

    def __init__(self, dataset, planned_steps):
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                f"Expected a tf.data.Dataset. Received: x of type {type(dataset).__name__}"
            )
        spec = dataset.element_spec
        if not isinstance(spec, tuple) or len(spec) not in (2, 3):
            raise TypeError(
                "Expected the dataset's elements to be batches (x, y) or (x, y, "
                f"sample_weight). Received: element_spec={spec}"
            )
        self.dataset = dataset
        self.batch_size = _static_batch_size(spec)
        self.steps_per_epoch = _finite_cardinality(dataset)
        _check_pipeline(dataset)
        self.planned_steps = int(planned_steps)
        self._first_pass = None

    def __len__(self):
        """The number of records in one pass: P x B."""
        return self.steps_per_epoch * self.batch_size

    def sample_batch(self):
        """Zeros shaped like one record (a batch of 1), to build the model on.

        Nothing is read from the pipeline.
        """
        def zeros(spec):
            return tf.zeros([1] + spec.shape.as_list()[1:], spec.dtype)

        return tuple(tf.nest.map_structure(zeros, self.dataset.element_spec))

    def first_pass(self):
        """Reads the pipeline once: (each batch's `batch_fingerprint`, a
        SHA-256 hex digest of every batch's tensors in order).

        Under several workers each worker reads its own copy of the pipeline;
        `DPBandMF` compares the digests of all workers before the first step
        (a pipeline shuffled with another seed on one worker would put a
        record in two places of an epoch). Computed once per `FixedOrderData`.

        Example:

        >>> import numpy as np, tensorflow as tf
        >>> ds = tf.data.Dataset.from_tensor_slices((np.zeros((4, 1)), np.arange(4)))
        >>> ds = ds.batch(2, drop_remainder=True)
        >>> fingerprints, digest = FixedOrderData(ds, planned_steps=2).first_pass()
        >>> fingerprints.shape, len(digest)
        ((2,), 64)
        """
        if self._first_pass is None:
            fingerprints, digest = [], hashlib.sha256()
            for arrays in self.dataset:
                fingerprints.append(int(batch_fingerprint(arrays)))
                for tensor in tf.nest.flatten(arrays):
                    digest.update(tf.io.serialize_tensor(tensor).numpy())
            self._first_pass = (np.asarray(fingerprints, np.int64), digest.hexdigest())
        return self._first_pass

    def stream(self, position, order_check):
        """The training elements from stream position `position` on.

        Element i is the pipeline's batch at position (position + i) mod P,
        read pass after pass, checked against `order_check`, as
        `(arrays, step_info)` with an all-ones mask and the fixed batch size
        (DPOptimizer's element form).

        Args:
            position: the stream step the first element trains (an int >= 0).
            order_check: an `OrderCheck` for these P positions.

        Returns:
            An infinite `tf.data.Dataset`; `fit` runs P steps per epoch.
        """
        steps = self.steps_per_epoch
        batch = self.batch_size
        stream = self.dataset.repeat().skip(position % steps).enumerate(start=position)

        def to_element(index, arrays):
            checked = order_check.check(index % steps, arrays)
            with tf.control_dependencies([checked]):
                mask = tf.ones([batch], tf.float32)
            step_info = {"mask": mask, "expected_batch_size": tf.constant(float(batch))}
            return tuple(arrays), step_info

        return stream.map(to_element).prefetch(tf.data.AUTOTUNE)


ORDER_CHANGED = (
    "The tf.data pipeline's order changed: a batch (its features, labels or sample "
    "weights) differs from the first pass's at the same position of the epoch. "
    "DP-BandMF's fixed-order accounting needs every record at the same position "
    "each epoch (and after a resume); this batch was not trained on. Remove any "
    "reshuffling (shuffle(..., reshuffle_each_iteration=False, seed=...)) and any "
    "generator that yields in another order; put random augmentation in the model, "
    "not the pipeline; or, to train on a different pipeline, compile with a new "
    "DPBandMF(..., fresh_noise_history=True)."
)
# The pipeline's assertion (`OrderCheck.check`; TensorFlow writes ' as \'):
# a position, no value.
read_failures.value_free(r"assertion failed: \[" + re.escape(ORDER_CHANGED).replace("'", r"\\?'")
                         + r"\] \[Received: batch position\] \[\d+\]")


class OrderCheck:
    """Fingerprints of the batches (`batch_fingerprint`) at each of P
    positions: the first pass records them, every later pass (or a resumed
    run) must match.

    Args:
        steps_per_epoch: P.
        fingerprints: optional int64 array [P] (from a saved noise state).
        recorded: how many leading positions `fingerprints` holds.
    """

    def __init__(self, steps_per_epoch, fingerprints=None, recorded=0):
        values = np.zeros(steps_per_epoch, np.int64) if fingerprints is None else fingerprints
        self.fingerprints = tf.Variable(np.asarray(values, np.int64), trainable=False)
        self.recorded = tf.Variable(int(recorded), dtype=tf.int64, trainable=False)

    def state(self):
        """(fingerprints as an int64 array, recorded positions)."""
        return self.fingerprints.numpy(), int(self.recorded.numpy())

    def check(self, position, arrays):
        """Records or checks the fingerprint of the batch `arrays` (features,
        labels and sample weights) at `position`.

        Returns an op that raises InvalidArgumentError on a mismatch.
        """
        value = batch_fingerprint(arrays)

        def record():
            with tf.control_dependencies([self.fingerprints.scatter_update(
                    tf.IndexedSlices(value[None], position[None]))]):
                return self.recorded.assign(position + 1).op

        def compare():
            return tf.debugging.Assert(
                tf.equal(self.fingerprints[position], value),
                [ORDER_CHANGED, "Received: batch position", position],
            )

        return tf.cond(position < self.recorded, compare, lambda: tf.group(record()))

    def adopt(self, fingerprints):
        """Takes a whole pass's fingerprints (`FixedOrderData.first_pass`) as
        the order every later pass must keep.

        Raises:
            ValueError: if they differ from the positions recorded so far
                (the pipeline's order changed since they were recorded).
        """
        fingerprints = np.asarray(fingerprints, np.int64)
        known, recorded = self.state()
        changed = np.flatnonzero(known[:recorded] != fingerprints[:recorded])
        if changed.size:
            raise ValueError(f"{ORDER_CHANGED} Received: batch position {int(changed[0])}")
        self.fingerprints.assign(fingerprints)
        self.recorded.assign(len(fingerprints))


def batch_fingerprint(arrays):
    """An int64 fingerprint of a whole batch: every tensor of `(x, y)` or
    `(x, y, sample_weight)` (dicts, ragged and sparse components included),
    its shape and values in order (the dtypes are the pipeline's, fixed).

    Example:

    >>> x = tf.constant([[1.0], [2.0]])
    >>> same_labels = tf.constant([0, 0])
    >>> int(batch_fingerprint((x, same_labels))) == int(batch_fingerprint((x[::-1], same_labels)))
    False
    """
    parts = []  # each tensor's shape and values, hashed in place (no serialized copy)
    for tensor in tf.nest.flatten(arrays, expand_composites=True):
        parts.append(tf.fingerprint(tf.reshape(tf.cast(tf.shape(tensor), tf.int64), [1, -1])))
        parts.append(tf.fingerprint(tf.reshape(tensor, [1, -1])))
    digest = tf.fingerprint(tf.concat(parts, 1))
    return tf.bitcast(digest[0], tf.int64)


def _static_batch_size(spec):
    sizes = set()
    for tensor_spec in tf.nest.flatten(spec):
        shape = tensor_spec.shape
        sizes.add(shape[0] if shape.rank else "scalar")
    if sizes == {None} or None in sizes:
        raise ValueError(
            "DP-BandMF needs batches of one fixed size (the noise is calibrated to a "
            "sum over a known number of records): a batch size that varies, here the "
            "last, smaller batch. Use dataset.batch(batch_size, drop_remainder=True). "
            f"Received: element_spec={spec}"
        )
    if "scalar" in sizes or len(sizes) != 1:
        raise ValueError(
            "Expected a batched dataset whose components share one batch dimension "
            "(dataset.batch(batch_size, drop_remainder=True)). Received: element_spec="
            f"{spec}"
        )
    return int(sizes.pop())


def _finite_cardinality(dataset):
    cardinality = int(dataset.cardinality().numpy())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "DP-BandMF reads a finite pipeline once per epoch, but this one is infinite "
            "(repeat()): each record must appear once per epoch. Remove repeat(); fit's "
            "`epochs` repeats the data. Received: cardinality=infinite"
        )
    if cardinality == tf.data.UNKNOWN_CARDINALITY:
        raise ValueError(
            "DP-BandMF needs the number of batches per epoch (the accounting counts "
            "epochs), but this pipeline's cardinality is unknown (filter, flat_map, "
            "from_generator, ...). If you know it, assert it: dataset.apply("
            "tf.data.experimental.assert_cardinality(num_batches)). Received: "
            "cardinality=unknown"
        )
    if cardinality == 0:
        raise ValueError("Received an empty tf.data pipeline (cardinality 0).")
    return cardinality


def _inputs(dataset):
    try:
        return list(dataset._inputs())  # pylint: disable=protected-access
    except (AttributeError, NotImplementedError, TypeError):
        return []


def _is_shuffle(name):
    """A shuffle by tf.data's name for it, or any transformation named like one
    (a shuffle tfdp does not know yet is treated as one that reshuffles)."""
    return name in _SHUFFLE or ("shuffle" in name.lower() and name not in _SHUFFLE_AND_REPEAT)


def _check_pipeline(dataset):
    """Walks the pipeline from its output, refusing what breaks the order."""
    if dataset.options().deterministic is False:
        raise ValueError(
            "DP-BandMF needs the same order every epoch, but this pipeline's options "
            "allow a nondeterministic order. Received: options().deterministic=False"
        )
    pending = [(dataset, False)]  # (node, whether a cache() lies downstream of it)
    while pending:
        node, behind_cache = pending.pop()
        name = type(node).__name__
        if name in _REPEAT:
            raise ValueError(
                "DP-BandMF reads each record once per epoch, but the pipeline repeats "
                "(repeat()): a record would appear several times in an epoch. Remove "
                f"repeat(); fit's `epochs` repeats the data. Received: {name}"
            )
        if name in _SHUFFLE_AND_REPEAT:
            raise ValueError(
                "DP-BandMF needs the same order every epoch, but the pipeline uses "
                "shuffle_and_repeat. Shuffle once: shuffle(n, reshuffle_each_iteration="
                f"False, seed=...). Received: {name}"
            )
        if _is_shuffle(name) and getattr(node, "_reshuffle_each_iteration", True) and not behind_cache:
            raise ValueError(
                "DP-BandMF needs each record at the same position every epoch, but the "
                "pipeline reshuffles each epoch (shuffle(..., reshuffle_each_iteration="
                "True), the default): a record could come back after fewer steps than "
                "`bands`, where its correlated noise overlaps. Shuffle once: "
                "shuffle(n, reshuffle_each_iteration=False, seed=...), or cache() after "
                f"the shuffle. Received: {name}"
            )
        if name in _RANDOM or "random" in name.lower():
            raise ValueError(
                "DP-BandMF needs the same order every epoch, but the pipeline draws its "
                f"elements at random. Received: {name}"
            )
        if str(getattr(node, "_deterministic", "default")).lower() == "false":
            raise ValueError(
                "DP-BandMF needs the same order every epoch, but a parallel step of the "
                "pipeline may reorder elements (deterministic=False). Received: "
                f"{name} with deterministic=False"
            )
        behind = behind_cache or name in _CACHE
        pending.extend((child, behind) for child in _inputs(node))
