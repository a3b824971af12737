"""Reads Poisson-sampled records from a source into padded batches.

The sampler's `(indices, mask)` pairs are drawn in TensorFlow
(`tfdp.data.sampling`); for each step a `tf.numpy_function` reads the
sampled records (and nothing else) from a source (`tfdp.data.sources`)
into one padded batch. tf.data runs several steps' reads at once
(`num_parallel_calls`) and keeps their order, and `make_dataset`
prefetches, so reading overlaps training. Padding rows are
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

import numpy as np
import tensorflow as tf

from tfdp.data import interrupts

__all__ = ["read_batches", "read_padded"]


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


def read_batches(pairs, source):
    """`(batch, mask)` elements read from `source` at the pairs' indices.

    Args:
        pairs: a `tf.data.Dataset` of `(indices, mask)` (int64 and float32
            1-D tensors of one length, real rows first), e.g. a sampler's
            draws (`tfdp.data.sampling.draws`).
        source: a `RecordSource` or `ArraySource`.

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
            lambda r, m: read_padded(source, r, m, stop),
            [rows, mask],
            [spec.dtype for spec in specs],
            stateful=False,
        )
        for tensor, spec in zip(flat, specs):
            tensor.set_shape(spec.shape)
        return tf.nest.pack_sequence_as(source.element_spec, flat), mask

    return pairs.map(read, num_parallel_calls=tf.data.AUTOTUNE)
