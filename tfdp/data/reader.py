"""Reads Poisson-sampled records from a source into padded batches.

The sampler's `(indices, mask)` pairs are drawn in TensorFlow
(`tfdp.data.sampling`); for each step a `tf.numpy_function` reads the
sampled records (and nothing else) from a source (`tfdp.data.sources`)
into one padded batch. tf.data runs several steps' reads at once
(`num_parallel_calls`, `parallel_reads`) and keeps their order, and
`make_dataset` prefetches, so reading overlaps training. Padding rows are
record 0, as for in-memory arrays, read once (a `RecordSource` keeps it from
reading its spec). Each pipeline's reads can be stopped (at Ctrl-C, and when
`fit` ends: `tfdp.data.interrupts`).

Example:

```python
source = tfdp.data.RecordSource(records)
sampler = PoissonSampler(len(source), expected_batch_size=256)
dataset = make_dataset(sampler, source)   # ((x, y), mask) elements, via read_batches
```
"""

import os

import numpy as np
import tensorflow as tf

from tfdp.data import interrupts, read_failures

__all__ = ["read_batches", "read_padded"]

# Padded batches that parallel reads may hold ahead of training, in bytes.
# Each read keeps its batch until the step takes it, and tf.data's default
# parallelism is one read per core: batches of 2048 rows of 2,048 float32
# features (18 MB) from a memmap grew anonymous memory by 667 MiB with reads
# planned for 16 cores (`benchmarks/data_sources.py memory --read-cores 16`).
READ_AHEAD_BYTES = 64 * 2**20


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def parallel_reads(batch_bytes, cores=None):
    """How many steps' reads run at once: tf.data's default (one a core)
    unless that would hold more than `READ_AHEAD_BYTES` of batches, then as
    many as fit (at least 1). Reading a batch from a memmap takes far less
    than a step, so a few reads ahead keep training fed.

    Args:
        batch_bytes: the bytes of one padded batch, or None when unknown.
        cores: the cores reads may use (default: this process's).

    Example:

    >>> parallel_reads(2048 * 2048 * 4, cores=16)   # 16 MiB batches: 4 fit in 64 MiB
    4
    >>> parallel_reads(256 * 784 * 4, cores=16) == tf.data.AUTOTUNE
    True
    """
    cores = _cores() if cores is None else cores
    if batch_bytes is None or batch_bytes * cores <= READ_AHEAD_BYTES:
        return tf.data.AUTOTUNE
    return max(1, READ_AHEAD_BYTES // batch_bytes)


def _batch_bytes(length, specs):
    """The bytes of a batch of `length` rows of `specs`, or None if unknown."""
    row = 0
    for spec in specs:
        entries = spec.shape[1:].num_elements()
        if entries is None or length is None:
            return None
        row += entries * spec.dtype.size
    return length * row


def read_padded(source, indices, mask, stop=None):
    """One padded batch: the records at `indices` where `mask` is 1.

    Args:
        source: a `RecordSource` or `ArraySource`.
        indices: int64 array, the step's indices, real rows first.
        mask: float32 array of the same length, 1 for real rows then 0.
        stop: None or the pipeline's `threading.Event`
            (`tfdp.data.interrupts`): once set, no further record is read
            (`ReadsStopped` is raised).

    Returns:
        The flat list of arrays (one per leaf of `source.element_spec`),
        each with `len(indices)` rows.

    Example:

    >>> from tfdp.data import ArraySource
    >>> source = ArraySource(np.arange(10.0)[:, None], np.arange(10))
    >>> x, y = read_padded(source, np.array([4, 7, 0]), np.array([1, 1, 0], np.float32))
    >>> y
    array([4, 7, 0])
    """
    count = int(np.count_nonzero(mask))
    out = source.empty_batch(len(indices))
    interrupts.check(stop)
    if count:
        source.read_batch(np.asarray(indices[:count], np.int64), out, stop=stop)
    if count < len(indices):
        for array, row in zip(out, source.padding_row()):
            array[count:] = row
    return out


def read_batches(pairs, source, rows=None):
    """`(batch, mask)` elements read from `source` at the pairs' indices.

    Args:
        pairs: a `tf.data.Dataset` of `(indices, mask)` (int64 and float32
            1-D tensors of one length, real rows first), e.g. a sampler's
            draws (`tfdp.data.sampling.draws`).
        source: a `RecordSource` or `ArraySource`.
        rows: the usual length of a padded batch (a sampler's
            `padded_size`), which bounds the reads run at once
            (`parallel_reads`); default: the pairs' static length, if any.

    Returns:
        A `tf.data.Dataset` of `(batch, mask)` in the order of `pairs`,
        `batch` with the structure of `source.element_spec`.

    Example:

    >>> from tfdp.data import ArraySource
    >>> source = ArraySource(np.zeros((100, 3), np.float32), np.arange(100))
    >>> pairs = tf.data.Dataset.from_tensors((tf.constant([7, 0], tf.int64),
    ...                                       tf.constant([1.0, 0.0])))
    >>> (x, y), mask = next(iter(read_batches(pairs, source)))
    >>> y.numpy()
    array([7, 0])
    """
    specs = tf.nest.flatten(source.element_spec)
    stop = interrupts.stop_event()  # set at Ctrl-C and when `fit` ends

    def read(rows, mask):
        flat = tf.numpy_function(
            read_failures.remembering(lambda r, m: read_padded(source, r, m, stop)),
            [rows, mask],
            [spec.dtype for spec in specs],
            stateful=False,
        )
        for tensor, spec in zip(flat, specs):
            tensor.set_shape(spec.shape)
        return tf.nest.pack_sequence_as(source.element_spec, flat), mask

    rows = pairs.element_spec[0].shape[0] if rows is None else rows
    return pairs.map(read, num_parallel_calls=parallel_reads(_batch_bytes(rows, specs)))
