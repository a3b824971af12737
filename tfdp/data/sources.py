"""Random-access training data: record sources and memory-mapped arrays.

Poisson sampling reads arbitrary records, so training data on disk must
offer random access. A *source* here has `len(source)`, an `element_spec`
(one `tf.TensorSpec` per array, leading dimension None) and
`read_batch(indices, out)`, which reads the records at `indices` into
preallocated arrays. Two kinds:

- `RecordSource(records, transform=None)` wraps any object with `__len__`
  and `__getitem__(i)` (a class reading image files, `tfds.data_source`, a
  grain `MapDataset`); records are read one by one, in a thread pool.
- `ArraySource(x, y, sample_weight=None)` wraps arrays, usually NumPy
  memmaps (`np.load(path, mmap_mode="r")`); `fit(x, y)` builds one itself
  when an array is memory-mapped, so only the sampled rows are ever read.

Example:

```python
class Images:                       # any __len__ / __getitem__ object
    def __init__(self, paths, labels):
        self.paths, self.labels = paths, labels
    def __len__(self):
        return len(self.paths)
    def __getitem__(self, i):
        return np.load(self.paths[i]), self.labels[i]

source = tfdp.data.RecordSource(Images(paths, labels))
model.fit(source, batch_size=256, epochs=10)
```
"""

import concurrent.futures
import mmap
import os

import numpy as np
import tensorflow as tf

from tfdp.data import interrupts

__all__ = ["RecordSource", "ArraySource", "is_memory_mapped", "as_source", "require_in_memory"]

_NAMES = ("x", "y", "sample_weight")


def _default_threads():
    return min(32, (os.cpu_count() or 1) + 4)


def is_memory_mapped(array):
    """True if `array` is (a view of) a memory-mapped NumPy array.

    Example:

    >>> is_memory_mapped(np.zeros(3))
    False
    """
    while isinstance(array, np.ndarray):
        if isinstance(array, np.memmap):
            return True
        array = array.base
    return isinstance(array, mmap.mmap)


def _spec(value, where):
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind in "USV":
        raise TypeError(
            f"Expected numeric arrays in the training data. Received: {where} "
            f"with dtype {array.dtype}"
        )
    return tf.TensorSpec([None, *array.shape], tf.as_dtype(array.dtype))


def _leaf_names(structure):
    paths = []

    def walk(value, path):
        if isinstance(value, dict):
            for key in sorted(value):
                walk(value[key], f"{path}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]")
        else:
            paths.append(path)

    for name, part in zip(_NAMES, structure):
        walk(part, name)
    return paths


def _as_example(item, index):
    """`(x, y)` or `(x, y, sample_weight)` with list inputs made tuples
    (`index`: a record's index, or a string naming what `item` is)."""
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
        what = index if isinstance(index, str) else f"record {index} (after `transform`)"
        raise ValueError(
            f"Expected {what} to be a tuple (x, y) or "
            "(x, y, sample_weight); pass `transform` to map your records (e.g. a "
            f"tfds dict) to one. Received: {type(item).__name__}"
            + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else "")
        )

    def tuples(value):
        if isinstance(value, (list, tuple)):
            return tuple(tuples(v) for v in value)
        if isinstance(value, dict):
            return {k: tuples(v) for k, v in value.items()}
        return value

    return tuple(tuples(part) for part in item)


def _first_row(example):
    """Row 0 of every array of a batched example tuple (x, y[, w])."""
    example = _as_example(example, "the batch_transform of one record")
    return tf.nest.map_structure(lambda a: np.asarray(a)[0], example)


class _Source:
    """What the reader needs: `__len__`, `element_spec`, `read_batch`."""

    element_spec = None

    def _leaf_specs(self):
        return tf.nest.flatten(self.element_spec)

    def empty_batch(self, length):
        """Uninitialised arrays for `length` rows, one per leaf (flat)."""
        return [
            np.empty([length, *spec.shape[1:]], spec.dtype.as_numpy_dtype)
            for spec in self._leaf_specs()
        ]

    def read_batch(self, indices, out, stop=None):
        """Reads the records at `indices` into rows 0.. of the flat `out`;
        once `stop` (a `threading.Event`, or None) is set, raises
        `tfdp.data.interrupts.ReadsStopped` instead of reading a record."""
        raise NotImplementedError

    def padding_row(self):
        """Record 0 as a flat list of arrays (read once), for padding rows."""
        if getattr(self, "_padding", None) is None:
            self._padding = [np.asarray(leaf) for leaf in tf.nest.flatten(self[0])]
        return self._padding


class RecordSource(_Source):
    """Random-access records read on demand, for Poisson-sampled `fit`.

    `records` is any object with `__len__` and `__getitem__(i)` returning one
    example; `transform(item)` (optional) maps an item to `(x, y)` or
    `(x, y, sample_weight)` (x may be a tuple or dict of arrays). Shapes and
    dtypes come from the first record: a later record that differs is an
    error naming its index. `model.fit(source, batch_size=b)` reads only the
    records each step samples, `num_threads` at a time.

    `batch_transform(items)` (instead of `transform`) maps the list of a
    step's items to one example tuple of arrays with `len(items)` rows, so
    decoding costs one NumPy call a step instead of one Python call a record
    (what a 256-record step spends in Python is then mostly the reads). Its
    output is checked against record 0's shapes and dtypes once a batch; an
    error names the batch's first records.

    Args:
        records: object with `__len__` and `__getitem__`, e.g.
            `tfds.data_source("mnist", split="train")`.
        transform: None or a callable from an item to an example tuple.
        num_threads: int >= 1, records read at once (default cores + 4, at
            most 32).
        batch_transform: None or a callable from a list of items to an
            example tuple of batched arrays (not with `transform`).

    Example:

    >>> records = [(np.full(3, i, np.float32), i % 2) for i in range(10)]
    >>> source = RecordSource(records)
    >>> len(source), source.element_spec[0].shape
    (10, TensorShape([None, 3]))
    >>> tfds_like = [{"image": np.zeros((2, 2), np.uint8), "label": 1}] * 4
    >>> source = RecordSource(tfds_like, transform=lambda r: (r["image"], r["label"]))
    >>> rows = [np.full(3, i, np.uint8).tobytes() for i in range(10)]
    >>> decode = lambda items: (np.frombuffer(b"".join(items), np.uint8).reshape(-1, 3),
    ...                         np.zeros(len(items), np.int64))
    >>> RecordSource(rows, batch_transform=decode)[4][0]
    array([4, 4, 4], dtype=uint8)
    """

    def __init__(self, records, transform=None, num_threads=None, batch_transform=None):
        if not (hasattr(records, "__len__") and hasattr(records, "__getitem__")):
            raise TypeError(
                "Expected `records` to support len() and [i] (random access, which "
                "Poisson sampling needs). Received: records of type "
                f"{type(records).__name__}"
            )
        for name, value in (("transform", transform), ("batch_transform", batch_transform)):
            if value is not None and not callable(value):
                raise TypeError(f"Expected `{name}` to be callable or None. Received: {name}={value!r}")
        if transform is not None and batch_transform is not None:
            raise ValueError(
                "Pass `transform` (one item at a time) or `batch_transform` (a step's "
                "items at once), not both. Received: both"
            )
        num_threads = _default_threads() if num_threads is None else num_threads
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"Expected `num_threads` to be an int >= 1. Received: num_threads={num_threads!r}")
        self.records = records
        self.transform = transform
        self.batch_transform = batch_transform
        self.num_threads = num_threads
        self._length = len(records)
        if self._length < 1:
            raise ValueError(f"Expected `records` to hold at least one record. Received: len(records)={self._length}")
        first = self._example(0)
        self._paths = _leaf_names(first)
        self.element_spec = tf.nest.map_structure(
            lambda v: _spec(v, "record 0"), first
        )
        self._padding = [np.asarray(leaf) for leaf in tf.nest.flatten(first)]
        self._flat = len(self._paths) == len(first)
        self._rows = [(a.shape, a.dtype) for a in self._padding]
        self._pool = None

    def __len__(self):
        return self._length

    def __repr__(self):
        return f"RecordSource({type(self.records).__name__}, num_records={self._length})"

    def _reading_failed(self, error, index):
        """`error` (a missing file, a corrupt record) saying which record."""
        return type(error)(
            f"Reading record {index} of {type(self.records).__name__} failed: {error}"
        )

    def _read_item(self, index):
        try:
            return self.records[int(index)]
        except Exception as error:
            raise self._reading_failed(error, index) from error

    def _example(self, index):
        item = self._read_item(index)
        try:
            if self.transform is not None:
                item = self.transform(item)
            elif self.batch_transform is not None:
                item = _first_row(self.batch_transform([item]))
        except Exception as error:
            raise self._reading_failed(error, index) from error
        return _as_example(item, index)

    def __getitem__(self, index):
        """Record `index` as a tuple of NumPy arrays, checked against record 0."""
        return tf.nest.pack_sequence_as(self.element_spec, self._leaves(index))

    def _leaves(self, index, item=None):
        """The checked flat arrays of record `index` (`item`: already read)."""
        if item is None:
            example = self._example(index)
        else:
            try:
                item = item if self.transform is None else self.transform(item)
            except Exception as error:
                raise type(error)(f"Transforming record {index} failed: {error}") from error
            example = _as_example(item, index)
        if self._flat and len(example) == len(self._paths) and not any(
            isinstance(part, (tuple, list, dict)) for part in example
        ):
            leaves = example  # the common (x, y[, w]) of arrays, without tf.nest
        else:
            try:
                tf.nest.assert_same_structure(example, self.element_spec)
                leaves = tf.nest.flatten(example)
            except (ValueError, TypeError) as error:
                raise ValueError(
                    f"Record {index} does not have the structure of record 0: {error}"
                ) from None
        arrays = []
        for path, leaf, (shape, dtype) in zip(self._paths, leaves, self._rows):
            array = np.asarray(leaf)
            if array.shape != shape or array.dtype != dtype:
                raise ValueError(
                    f"Record {index} does not match record 0 at {path}: expected shape "
                    f"{shape} and dtype {dtype}. Received: shape {array.shape} and "
                    f"dtype {array.dtype}"
                )
            arrays.append(array)
        return arrays

    def _pool_map(self, function, indices, stop=None):
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.num_threads, thread_name_prefix="tfdp-records"
            )

        def unless_stopped(index):  # a stopped pipeline reads no further record
            interrupts.check(stop)
            return function(index)

        return self._pool.map(unless_stopped, indices)

    def read_batch(self, indices, out, stop=None):
        # A batch read where the records offer one (tfds and grain sources:
        # `__getitems__`, parallel inside), else one read per record in threads.
        if self.batch_transform is not None:
            return self._read_batch_transformed(indices, out, stop)
        if hasattr(self.records, "__getitems__"):
            interrupts.check(stop)
            items = self.records.__getitems__([int(i) for i in indices])
            rows = (self._leaves(i, item) for i, item in zip(indices, items))
        else:
            rows = self._pool_map(self._leaves, indices, stop)
        for row, leaves in enumerate(rows):
            for target, leaf in zip(out, leaves):
                target[row] = leaf

    def _read_batch_transformed(self, indices, out, stop=None):
        """The items at `indices`, decoded by one `batch_transform` call."""
        if hasattr(self.records, "__getitems__"):
            interrupts.check(stop)
            items = list(self.records.__getitems__([int(i) for i in indices]))
        else:
            items = list(self._pool_map(self._read_item, indices, stop))
        shown = ", ".join(str(int(i)) for i in indices[:5]) + (", ..." if len(indices) > 5 else "")
        where = f"records [{shown}]"
        try:
            example = self.batch_transform(items)
        except Exception as error:
            raise type(error)(f"batch_transform of {where} failed: {error}") from error
        example = _as_example(example, f"the batch_transform of {where}")
        try:
            tf.nest.assert_same_structure(example, self.element_spec)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"The batch_transform of {where} does not have record 0's structure: {error}"
            ) from None
        leaves = tf.nest.flatten(example)
        for path, leaf, (shape, dtype), target in zip(self._paths, leaves, self._rows, out):
            array = np.asarray(leaf)
            if array.shape != (len(indices), *shape) or array.dtype != dtype:
                raise ValueError(
                    f"The batch_transform of {where} does not match record 0 at {path}: "
                    f"expected shape {(len(indices), *shape)} and dtype {dtype}. "
                    f"Received: shape {array.shape} and dtype {array.dtype}"
                )
            target[: len(indices)] = array


class ArraySource(_Source):
    """Arrays (usually memmaps) read row by row, for Poisson-sampled `fit`.

    `fit(x, y)` makes one when an array is memory-mapped; `read_records`
    returns one. Each step reads only its sampled rows.

    Args:
        x: array, or tuple/dict of arrays, first dimension N.
        y: array with first dimension N.
        sample_weight: None or array with first dimension N.

    Example:

    >>> x = np.zeros((100, 4), np.float32)
    >>> source = ArraySource(x, np.arange(100))
    >>> len(source), source.element_spec[1].dtype
    (100, tf.int64)
    """

    def __init__(self, x, y, sample_weight=None):
        arrays = (x, y) if sample_weight is None else (x, y, sample_weight)
        self.arrays = _as_example(arrays, "arrays")
        self._paths = _leaf_names(self.arrays)
        leaves = tf.nest.flatten(self.arrays)
        lengths = {path: len(leaf) for path, leaf in zip(self._paths, leaves)}
        if len(set(lengths.values())) != 1:
            raise ValueError(
                f"Expected every array to have the same first dimension. Received: {lengths}"
            )
        self._length = next(iter(lengths.values()))
        if self._length < 1:
            raise ValueError("Expected at least one example. Received: 0 rows")
        self.element_spec = tf.nest.pack_sequence_as(
            self.arrays,
            [_spec(leaf[0], path) for path, leaf in zip(self._paths, leaves)],
        )

    def __len__(self):
        return self._length

    def __repr__(self):
        return f"ArraySource(num_records={self._length})"

    def __getitem__(self, index):
        return tf.nest.map_structure(lambda a: np.asarray(a[int(index)]), self.arrays)

    def read_batch(self, indices, out, stop=None):
        interrupts.check(stop)
        count = len(indices)
        for target, leaf in zip(out, tf.nest.flatten(self.arrays)):
            target[:count] = leaf[indices]


def as_source(data):
    """`data` as a source if it is one or holds a memmap, else None.

    Example:

    >>> as_source((np.zeros((3, 2)), np.zeros(3))) is None
    True
    """
    if isinstance(data, _Source):
        return data
    if isinstance(data, (tuple, list)) and len(data) in (2, 3):
        leaves = tf.nest.flatten(data)
        if any(is_memory_mapped(leaf) for leaf in leaves):
            return ArraySource(*data)
    return None


def require_in_memory(data, who, why):
    """Raises ValueError if `data` is a source or memory-mapped.

    For a mechanism that reads every training record (`who` is its name,
    `why` says what for), which would load data on disk whole.
    """
    if as_source(data) is not None:
        raise ValueError(
            f"{who} {why}, so it needs the training data in memory (NumPy arrays or "
            "tensors); it does not take a RecordSource or memory-mapped arrays. "
            f"Received: {type(data).__name__}"
        )
