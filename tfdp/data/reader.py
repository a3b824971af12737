"""Reads Poisson-sampled records from a source into padded batches.

The sampler's `(indices, mask)` pairs come from Python; for each step a
`tf.numpy_function` reads the sampled records (and nothing else) from a
source (`tfdp.data.sources`) into one padded batch. tf.data runs several
steps' reads at once (`num_parallel_calls`) and keeps their order, and
`make_dataset` prefetches, so reading overlaps training. Padding rows are
record 0, as for in-memory arrays, read once (a `RecordSource` keeps it from
reading its spec).

Example:

```python
source = tfdp.data.RecordSource(records)
sampler = PoissonSampler(len(source), expected_batch_size=256)
dataset = read_batches(sampler.epoch, source)   # ((x, y), mask) elements
```
"""

import numpy as np
import tensorflow as tf

__all__ = ["read_batches", "read_padded"]


def read_padded(source, indices, mask):
    """One padded batch: the records at `indices` where `mask` is 1.

    Args:
        source: a `RecordSource` or `ArraySource`.
        indices: int64 array, the step's indices, real rows first.
        mask: float32 array of the same length, 1 for real rows then 0.

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
    if count:
        source.read_batch(np.asarray(indices[:count], np.int64), out)
    if count < len(indices):
        for array, row in zip(out, source.padding_row()):
            array[count:] = row
    return out


def index_batches(generator):
    """The `(indices, mask)` pairs of `generator` as a `tf.data.Dataset`.

    Args:
        generator: a callable returning an iterator of `(indices, mask)`
            (int64 and float32 1-D arrays of one length), e.g. a
            `PoissonSampler`'s `epoch`; each iteration calls it again.

    Returns:
        A `tf.data.Dataset` of (int64 [None], float32 [None]) pairs.

    Example:

    >>> draws = [(np.array([3, 0]), np.array([1.0, 0.0], np.float32))]
    >>> pairs = index_batches(lambda: iter(draws))
    >>> [(i.numpy().tolist(), m.numpy().tolist()) for i, m in pairs]
    [([3, 0], [1.0, 0.0])]
    """
    return tf.data.Dataset.from_generator(
        generator,
        output_signature=(
            tf.TensorSpec(shape=[None], dtype=tf.int64),
            tf.TensorSpec(shape=[None], dtype=tf.float32),
        ),
    )


def read_batches(generator, source):
    """`(batch, mask)` elements read from `source` at a generator's indices.

    Args:
        generator: a callable returning an iterator of `(indices, mask)`
            (int64 and float32 1-D arrays of one length, real rows first),
            e.g. a `PoissonSampler`'s `epoch`.
        source: a `RecordSource` or `ArraySource`.

    Returns:
        A `tf.data.Dataset` of `(batch, mask)` in the generator's order,
        `batch` with the structure of `source.element_spec`.

    Example:

    >>> from tfdp.data import ArraySource, PoissonSampler
    >>> source = ArraySource(np.zeros((100, 3), np.float32), np.arange(100))
    >>> sampler = PoissonSampler(100, 10, seed=0)
    >>> (x, y), mask = next(iter(read_batches(sampler.epoch, source)))
    >>> x.shape[0] == mask.shape[0]
    True
    """
    specs = tf.nest.flatten(source.element_spec)
    indices = index_batches(generator)

    def read(rows, mask):
        flat = tf.numpy_function(
            lambda r, m: read_padded(source, r, m),
            [rows, mask],
            [spec.dtype for spec in specs],
            stateful=False,
        )
        for tensor, spec in zip(flat, specs):
            tensor.set_shape(spec.shape)
        return tf.nest.pack_sequence_as(source.element_spec, flat), mask

    return indices.map(read, num_parallel_calls=tf.data.AUTOTUNE)
