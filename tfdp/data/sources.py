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

import mmap
import operator
import os
import random
import weakref

import numpy as np
import tensorflow as tf

from tfdp.data import interrupts
from tfdp.data.read_threads import ReadThreads
from tfdp.record_values import SHOW_ENV, record_values_shown

__all__ = [
    "RecordSource", "ArraySource", "is_memory_mapped", "as_source", "require_in_memory",
    "with_batch_check",
]

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


def _mapping_memmap(array):
    """The memmap that made the mapping behind `array` (a memmap or a view
    of one; its data starts at byte `offset` of its file), else None."""
    while isinstance(array, np.ndarray):
        if isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap):
            return array
        array = array.base
    return None


def _filename(memmap):
    """The name of `memmap`'s file as a string (NumPy keeps a Path as given), or None."""
    return None if memmap.filename is None else os.fspath(memmap.filename)


def _mapped_file(array):
    """`(mapping, bytes it needs, file name)` of the file behind a memmap
    (or a view of one), else None."""
    memmap = _mapping_memmap(array)
    if memmap is None:
        return None
    return memmap.base, memmap.offset + memmap.nbytes, _filename(memmap)


def _truncated(filename, size, needed):
    """The error for a mapped file now `size` bytes, of the `needed` it held."""
    return OSError(
        f"The file {filename!r} behind a memory-mapped training array is now "
        f"{size} bytes, shorter than the {needed} it held when it was opened: it "
        "was truncated or rewritten in place while it was being read, and "
        "reading the missing pages would kill the process (SIGBUS). Training "
        "stopped before reading it; restore the file, then resume (the steps "
        "that ran are in the privacy ledger, and in a PrivacyJournal if you "
        f"keep one). Received: a file of {size} bytes"
    )


def _address(array):
    return array.__array_interface__["data"][0]


class _FileRows:
    """The rows of a memory-mapped array read from its file by positioned
    reads (`os.preadv`) straight into a batch's memory, never through the
    mapping: in a file truncated under the read a row past its new end is a
    short read, an OSError naming the file, where touching the mapping
    there would kill the process (SIGBUS).

    Made by `_file_rows`. Row i is `row_bytes` bytes at `first + i * stride`
    of the file open as `fd`, closed once no source holds this (copies of a
    source share it).
    """

    def __init__(self, fd, filename, first, stride, array, needed):
        self.fd, self.filename, self.needed = fd, filename, needed
        self.first, self.stride = first, stride
        self.shape, self.dtype = array.shape[1:], array.dtype
        self.row_bytes = array[:1].nbytes
        self._close = weakref.finalize(self, os.close, fd)

    def read(self, indices, target):
        """Reads the rows `indices` (an int array, each in 0..N-1) into rows
        0.. of `target`, a C-contiguous array of this array's dtype. A run of
        consecutive indices is one read where rows are adjacent in the file."""
        buffer = memoryview(target.reshape(-1).view(np.uint8))
        size, listed = self.row_bytes, indices.tolist()
        if self.stride == size:
            ends = (np.flatnonzero(np.diff(indices) != 1) + 1).tolist() + [len(listed)]
        else:
            ends = range(1, len(listed) + 1)
        begin = 0
        try:
            for end in ends:
                wanted = buffer[begin * size : end * size]
                offset = self.first + listed[begin] * self.stride
                got = os.preadv(self.fd, [wanted], offset)
                while got < len(wanted):  # short: the file ends there (or a read was cut off)
                    more = os.preadv(self.fd, [wanted[got:]], offset + got)
                    if not more:
                        raise _truncated(self.filename, min(os.fstat(self.fd).st_size,
                                                            offset + got), self.needed)
                    got += more
                begin = end
        except OSError as error:
            if error.errno is None:  # _truncated's own
                raise
            raise OSError(error.errno, f"Reading a row of the memory-mapped training file "
                          f"{self.filename!r} failed: {error.strerror}") from error

    def row(self, index):
        """Row `index` (in 0..N-1) as a new array."""
        out = np.empty((1, *self.shape), self.dtype)
        self.read(np.array([index]), out)
        return out[0]


def _file_rows(array):
    """`array`'s rows as `_FileRows`, or None where they cannot be read from
    the file: `array` is not (a view of) a memmap of a named file, its
    mapping is copy-on-write (`mode="c"`: the array may differ from the
    file), its rows are not contiguous blocks of the file (every other
    column `x[:, ::2]`, a transposed view, Fortran order), `os.preadv` is
    missing (Windows), or the file now at its name is not the one mapped
    (not the mapping's size, or another first or last row). Those are read
    through the mapping.

    Example:

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "x.npy")
    >>> np.save(path, np.arange(12.0).reshape(4, 3))
    >>> x = np.load(path, mmap_mode="r")
    >>> _file_rows(x[1:]).row(0)
    array([3., 4., 5.])
    >>> _file_rows(x[:, :2]).row(3)   # the first columns: each row still a block
    array([ 9., 10.])
    >>> _file_rows(x.T) is None       # transposed: no row is a block of the file
    True
    """
    memmap = _mapping_memmap(array)
    if (memmap is None or memmap.mode == "c" or memmap.filename is None
            or not hasattr(os, "preadv") or array.ndim == 0
            or not (array.ndim == 1 or array[0].flags.c_contiguous)):
        return None
    try:
        fd = os.open(memmap.filename, os.O_RDONLY)
    except OSError:  # renamed or removed since it was mapped
        return None
    rows = _FileRows(fd, _filename(memmap), _address(array) - _address(memmap) + memmap.offset,
                     array.strides[0], array, memmap.offset + memmap.nbytes)
    size = memmap.base.size()  # the mapped file's (fstat of the mapping's own descriptor)
    if os.fstat(fd).st_size != size or any(
            os.pread(fd, rows.row_bytes, rows.first + i * rows.stride) != array[i : i + 1].tobytes()
            for i in (0, len(array) - 1)):
        rows._close()
        return None
    return rows


def _spec(value, where):
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind in "USV":
        raise TypeError(
            f"Expected numeric arrays in the training data. Received: {where} "
            f"with dtype {_dtype_name(array.dtype)}"
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


def _shown(indices):
    """"[4, 9, 11]", or the first five indices and "...": records in a message."""
    head = ", ".join(str(int(i)) for i in indices[:5])
    return f"[{head}{', ...' if len(indices) > 5 else ''}]"


def _name(function):
    return getattr(function, "__name__", None) or repr(function)


def _failed(error, what):
    """The error to raise, outside the handler, for `error` raised while
    `what` ("Reading record 3 of list"): it names the record's position and
    `error`'s type, not its text, which can quote the record (Python's own
    `float("patient-4711")` does) and would reach `fit`'s error through the
    input pipeline (`tfdp.models.step_errors` shows the messages of tfdp's
    own reads there, `tfdp.data.read_failures`). With
    `TFDP_SHOW_STEP_ERRORS=1` it adds the text and keeps `error` as its
    `__cause__`, with its traceback.

    Of `error`'s class when that class can be made from the message alone
    and shows it (OSError, ValueError, KeyError), else a RuntimeError: a
    UnicodeDecodeError or JSONDecodeError needs other arguments, and
    rebuilding one from a message alone would fail with a TypeError that
    hides both the message and the record. While values are withheld only
    Python's own classes are rebuilt: a class of the user's own words its
    text with its `__str__`, which can add the record (review 10, I3).
    """
    shown = record_values_shown()
    message = (f"{what} failed: {error}" if shown else
               f"{what} failed ({type(error).__name__}). Its message is withheld because it "
               f"can quote the record's values: set {SHOW_ENV}=1 to see it, on data that is "
               "not private.")
    wrapped = None
    if shown or type(error).__module__ == "builtins":
        try:
            wrapped = type(error)(message)
        except Exception:  # any constructor that needs more than a message
            wrapped = None
    if wrapped is None or message not in str(wrapped):
        wrapped = RuntimeError(message)
    wrapped.__cause__ = error if shown else None
    return wrapped


def _named(what, function, *args):
    """`function(*args)`; its error, if any, re-raised as `_failed(error, what)`
    (raised outside the handler: nothing chains the original unless shown)."""
    try:
        return function(*args)
    except Exception as error:  # pylint: disable=broad-except
        failure = _failed(error, what)
    raise failure


def _outline(structure, reference=None, first="record 0"):
    """`structure`'s nesting with each leaf shown as ".": no values. A
    dict's keys are shown only where `reference` (record 0's structure, or
    None: `structure` is record 0's) has them too, the others counted (as
    not in `first`): a key can be data (a JSON record keyed by a person's id).

    Example:

    >>> _outline(({"a": 1, "SECRET-ID-4711": 2}, 3), reference=({"a": 0}, 0))
    "({'a': ., 1 key not in record 0}, .)"
    """
    if isinstance(structure, dict):
        known = reference if reference is not None else structure
        known = known if isinstance(known, dict) else {}
        parts = [f"{key!r}: {_outline(value, None if reference is None else known[key], first)}"
                 for key, value in structure.items() if key in known]
        others = sum(1 for key in structure if key not in known)
        if others:
            parts.append(f"{others} key{'s' if others > 1 else ''} not in {first}")
        return "{" + ", ".join(parts) + "}"
    if isinstance(structure, (list, tuple)):
        if reference is None:
            references = [None] * len(structure)
        elif isinstance(reference, (list, tuple)) and len(reference) == len(structure):
            references = list(reference)
        else:
            references = [{}] * len(structure)  # no key below is known from record 0
        return "(" + ", ".join(_outline(value, ref, first)
                               for value, ref in zip(structure, references)) + ")"
    return "."


def _dtype_name(dtype):
    """`dtype` for a message: "text" for a string dtype, whose NumPy name
    (`<U14`) gives the text's length, else its name."""
    dtype = np.dtype(dtype)
    return "text" if dtype.kind in "USV" else str(dtype)


def _batch_leaves(example, count, what):
    """The flat arrays of a batch_transform's output for `count` items.

    Each must be an array with `count` rows: a scalar, or a Python list
    (read as a tuple of several inputs, one per element), is refused naming
    its place in the example.
    """
    leaves = []
    for path, leaf in zip(_leaf_names(example), tf.nest.flatten(example)):
        array = np.asarray(leaf)
        if array.ndim == 0 or len(array) != count:
            problem = (f"{path} is a scalar" if array.ndim == 0 else
                       f"{path} has {len(array)} rows for {count} item{'s' if count > 1 else ''}")
            raise ValueError(
                f"Expected {what} to return one array per input, label and weight, each "
                f"with one row per item: {problem}. Return arrays of len(items) rows (a "
                "Python list is read as several inputs: np.asarray or np.stack it). "
                f"Received: {path} of type {type(leaf).__name__}"
            )
        leaves.append(array)
    return leaves


# A batch array of this many bytes or more gets its own anonymous mapping.
_OWN_MAPPING_BYTES = 1 << 20


def _batch_array(shape, dtype):
    """An array of `shape` (zeros): from malloc when small, else backed by
    its own private anonymous mapping, returned to the system as soon as
    the batch is released. Reads run on tf.data's threads, and malloc keeps
    large blocks freed by each thread in that thread's arena: 2048 x 2048
    float32 batches from a memmap held 100 to 200 MB that no batch used
    (benchmarks/data_sources.py memory). Fresh pages cost a read about
    6 ms more for such a batch (14 ms against 8 on 2 cores), far below a
    step's time.

    Example:

    >>> _batch_array([512, 1024], np.float32).shape
    (512, 1024)
    """
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size < _OWN_MAPPING_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):  # Windows
        return np.empty(shape, dtype)
    private = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(private, dtype).reshape(shape)


class _Source:
    """What the reader needs: `__len__`, `element_spec`, `read_batch`."""

    element_spec = None

    def _leaf_specs(self):
        return tf.nest.flatten(self.element_spec)

    def empty_batch(self, length):
        """Arrays for `length` rows, one per leaf (flat); a large one is its
        own anonymous mapping (`_batch_array`)."""
        return [_batch_array([length, *spec.shape[1:]], spec.dtype.as_numpy_dtype)
                for spec in self._leaf_specs()]

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
    error names the batch's first records. It must compute each row from its
    own item alone: a transform that combines rows (a batch mean, a
    normalisation by batch statistics) lets one record change every example
    of its batch, beyond what clipping bounds. Row i of
    `batch_transform(items)` must equal `batch_transform([items[i]])` bit for
    bit; this is checked for two records when the source is made and for one
    row drawn at random in every batch, and a difference is an error naming
    the transform.

    A `__getitems__` batch read (tfds and grain sources) must return one item
    per index: a read that returns more or fewer is an error naming the
    source and the records. An error raised while reading record i names it
    and keeps the original as its `__cause__`.

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
        self._random = random.Random()
        if batch_transform is not None and self._length > 1:
            # A transform that combines rows shows it on two records already.
            indices = np.arange(2)
            items = [self._read_item(i) for i in indices]
            leaves = self._transformed(items, indices)
            for row in indices:
                self._check_row(items, indices, leaves, row)

    def __len__(self):
        return self._length

    def __repr__(self):
        return f"RecordSource({type(self.records).__name__}, num_records={self._length})"

    def _read_item(self, index):
        return _named(f"Reading record {index} of {type(self.records).__name__}",
                      operator.getitem, self.records, int(index))

    def _read_items(self, indices, stop=None):
        """The items at `indices`: one batch read if the records offer one
        (tfds and grain sources: `__getitems__`, parallel inside), else one
        read per record in threads; none once `stop` is set."""
        if not hasattr(self.records, "__getitems__"):
            return list(self._pool_map(self._read_item, indices, stop))
        interrupts.check(stop)
        name = f"{type(self.records).__name__}.__getitems__"
        items = _named(f"Reading records {_shown(indices)} with {name}",
                       lambda: list(self.records.__getitems__([int(i) for i in indices])))
        if len(items) != len(indices):
            raise ValueError(
                f"{name} returned {len(items)} items for the {len(indices)} records "
                f"{_shown(indices)}: a batch read must return one item per index, in "
                f"order. Received: {len(items)} items"
            )
        return items

    def _example(self, index):
        return _as_example(self._transformed_one(self._read_item(index), index), index)

    def _transformed_one(self, item, index):
        """`item` (record `index`) through `transform` or `batch_transform`."""
        what = f"Reading record {index} of {type(self.records).__name__}"
        if self.transform is not None:
            return _named(what, self.transform, item)
        if self.batch_transform is None:
            return item
        name = _name(self.batch_transform)
        example = _named(what, self.batch_transform, [item])
        try:  # tfdp's own checks: their messages hold no value
            example = _as_example(example, f"the batch_transform {name} of one record")
            leaves = _batch_leaves(example, 1, f"the batch_transform {name} of record {index}")
        except ValueError as error:
            raise ValueError(f"{what} failed: {error}") from None
        return tf.nest.pack_sequence_as(example, [leaf[0] for leaf in leaves])

    def __getitem__(self, index):
        """Record `index` as a tuple of NumPy arrays, checked against record 0."""
        return tf.nest.pack_sequence_as(self.element_spec, self._leaves(index))

    def _leaves(self, index, item=None):
        """The checked flat arrays of record `index` (`item`: already read)."""
        if item is None:
            example = self._example(index)
        else:
            if self.transform is not None:
                item = _named(f"Transforming record {index}", self.transform, item)
            example = _as_example(item, index)
        if self._flat and len(example) == len(self._paths) and not any(
            isinstance(part, (tuple, list, dict)) for part in example
        ):
            leaves = example  # the common (x, y[, w]) of arrays, without tf.nest
        else:
            try:
                tf.nest.assert_same_structure(example, self.element_spec)
                leaves = tf.nest.flatten(example)
            except (ValueError, TypeError):
                raise ValueError(
                    f"Record {index} does not have the structure of record 0: it is "
                    f"{_outline(example, self.element_spec)}, record 0 is "
                    f"{_outline(self.element_spec)}"
                ) from None
        arrays = []
        for path, leaf, (shape, dtype) in zip(self._paths, leaves, self._rows):
            array = np.asarray(leaf)
            if array.shape != shape or array.dtype != dtype:
                raise ValueError(
                    f"Record {index} does not match record 0 at {path}: expected shape "
                    f"{shape} and dtype {dtype}. Received: shape {array.shape} and "
                    f"dtype {_dtype_name(array.dtype)}"
                )
            arrays.append(array)
        return arrays

    def _pool_map(self, function, indices, stop=None):
        if self._pool is None:
            # Daemon threads: a read that never returns cannot keep Python
            # from exiting (a ThreadPoolExecutor's workers are joined at exit).
            self._pool = ReadThreads(self.num_threads, name="tfdp-records")

        def unless_stopped(index):  # a stopped pipeline reads no further record
            interrupts.check(stop)
            return function(index)

        return self._pool.map(unless_stopped, indices)

    def read_batch(self, indices, out, stop=None):
        if self.batch_transform is not None:
            return self._read_batch_transformed(indices, out, stop)
        if hasattr(self.records, "__getitems__"):
            items = self._read_items(indices, stop)
            rows = (self._leaves(i, item) for i, item in zip(indices, items))
        else:
            rows = self._pool_map(self._leaves, indices, stop)
        for row, leaves in enumerate(rows):
            for target, leaf in zip(out, leaves):
                target[row] = leaf

    def _transformed(self, items, indices):
        """`batch_transform(items)` as flat arrays checked against record 0."""
        name = _name(self.batch_transform)
        where = f"records {_shown(indices)}"
        example = _named(f"batch_transform of {where}", self.batch_transform, items)
        example = _as_example(example, f"the batch_transform of {where}")
        try:
            tf.nest.assert_same_structure(example, self.element_spec)
        except (ValueError, TypeError):
            raise ValueError(
                f"The batch_transform of {where} does not have record 0's structure: it is "
                f"{_outline(example, self.element_spec)}, record 0 is "
                f"{_outline(self.element_spec)}"
            ) from None
        leaves = _batch_leaves(example, len(items), f"the batch_transform {name} of {where}")
        for path, leaf, (shape, dtype) in zip(self._paths, leaves, self._rows):
            if leaf.shape != (len(items), *shape) or leaf.dtype != dtype:
                raise ValueError(
                    f"The batch_transform of {where} does not match record 0 at {path}: "
                    f"expected shape {(len(items), *shape)} and dtype {dtype}. "
                    f"Received: shape {leaf.shape} and dtype {_dtype_name(leaf.dtype)}"
                )
        return leaves

    def _check_row(self, items, indices, leaves, row):
        """Refuses a batch_transform whose row `row` of `leaves` (its output
        for `items`) differs from its output for `items[row]` alone."""
        single = self._transformed([items[row]], indices[row : row + 1])
        for path, batch, alone in zip(self._paths, leaves, single):
            if not np.array_equal(batch[row], alone[0], equal_nan=batch.dtype.kind in "fc"):
                name = _name(self.batch_transform)
                raise ValueError(
                    f"The batch_transform {name} mixes examples: row {row} of {name}(items) "
                    f"for records {_shown(indices)} differs from {name}([items[{row}]]) at "
                    f"{path}. Each row must be computed from its own item alone (bit for "
                    "bit as for that item alone): a transform that combines rows, such as "
                    "a normalisation by batch statistics, lets one record change every "
                    "example of its batch, beyond the clipping bound. Compute such "
                    "statistics on public data, or per item. Received: "
                    f"batch_transform={name}"
                )

    def _read_batch_transformed(self, indices, out, stop=None):
        """The items at `indices`, decoded by one `batch_transform` call, of
        which one row, drawn at random, is checked against its item alone."""
        items = self._read_items(indices, stop)
        leaves = self._transformed(items, indices)
        self._check_row(items, indices, leaves, self._random.randrange(len(items)))
        for target, leaf in zip(out, leaves):
            target[: len(indices)] = leaf


class ArraySource(_Source):
    """Arrays (usually memmaps) read row by row, for Poisson-sampled `fit`.

    `fit(x, y)` makes one when an array is memory-mapped; `read_records`
    returns one. Each step reads only its sampled rows.

    Reading a page of a mapped file past its end kills the process (SIGBUS)
    without a message, so a file truncated or rewritten in place under
    `fit` must never be read through its mapping. Before every read (of a
    batch, or of one row) it checks that the file behind each memmap still
    holds the bytes it held when the memmap was opened, and stops with an
    OSError naming a file that shrank. The rows of a memmap whose rows are
    blocks of its file (a memmap, or a view of one such as `x[100:]`,
    `x[::2]` or `x[:, :10]`) are then read from the file itself by
    positioned reads (`os.preadv`), not through the mapping, so a
    truncation after the check is a short read, the same OSError, never
    SIGBUS. Where the rows are not blocks of the file (every other column
    `x[:, ::2]`, a transposed view, Fortran order), the mapping is
    copy-on-write (`mode="c"`), the file now at its name is another, or on
    Windows (no `os.preadv`), the rows are read through the mapping: a
    truncation in the microseconds between the check and the read is then
    not caught.

    Args:
        x: array, or tuple/dict of arrays, first dimension N.
        y: array with first dimension N.
        sample_weight: None or array with first dimension N.

    Example:

    >>> x = np.zeros((100, 4), np.float32)
    >>> source = ArraySource(x, np.arange(100))
    >>> len(source), source.element_spec[1].dtype
    (100, tf.int64)
    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "x.npy")
    >>> np.save(path, np.arange(8.0).reshape(4, 2))
    >>> source = ArraySource(np.load(path, mmap_mode="r"), np.arange(4))
    >>> out = source.empty_batch(2)
    >>> source.read_batch(np.array([3, 1]), out)     # read from the file, not the mapping
    >>> out[0]
    array([[6., 7.],
           [2., 3.]])
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
        self._files = [f for f in map(_mapped_file, leaves) if f is not None]
        self._check_files()
        self._file_rows = [_file_rows(leaf) for leaf in leaves]  # None: read as arrays
        self.element_spec = tf.nest.pack_sequence_as(
            self.arrays,
            [_spec(leaf[0], path) for path, leaf in zip(self._paths, leaves)],
        )

    def __len__(self):
        return self._length

    def __repr__(self):
        return f"ArraySource(num_records={self._length})"

    def __getitem__(self, index):
        """Record `index` as arrays of its own (a memmap's row read from its file)."""
        self._check_files()
        index = int(index)
        if not -self._length <= index < self._length:
            raise IndexError(f"index {index} is out of bounds for axis 0 with size {self._length}")
        index %= self._length
        rows = [np.asarray(leaf[index]) if rows is None else rows.row(index)
                for leaf, rows in zip(tf.nest.flatten(self.arrays), self._file_rows)]
        return tf.nest.pack_sequence_as(self.arrays, rows)

    def _check_files(self):
        """Refuses to read a memmap whose file is now shorter than its mapping."""
        for mapping, needed, filename in self._files:
            size = mapping.size()  # fstat of the mapped file itself, even if renamed
            if size < needed:
                raise _truncated(filename, size, needed)

    def read_batch(self, indices, out, stop=None):
        interrupts.check(stop)
        self._check_files()
        count = len(indices)
        in_range = count and 0 <= indices.min() and indices.max() < self._length
        for target, leaf, rows in zip(out, tf.nest.flatten(self.arrays), self._file_rows):
            if in_range and rows is not None and target.dtype == rows.dtype and (
                    target.flags.c_contiguous):
                rows.read(indices, target[:count])
            elif in_range and isinstance(leaf, np.ndarray):
                # straight into the batch: no temporary copy of the rows (a
                # large block malloc would keep in this read thread's arena)
                np.take(leaf, indices, axis=0, out=target[:count], mode="clip")
            else:
                target[:count] = leaf[indices]


class _Checked(_Source):
    """`source` read as usual, then `check(arrays, indices)` on each batch."""

    def __init__(self, source, check):
        self.source, self.check = source, check
        self.element_spec = source.element_spec

    def __len__(self):
        return len(self.source)

    def __getitem__(self, index):
        return self.source[index]

    def __repr__(self):
        return repr(self.source)

    def padding_row(self):
        return self.source.padding_row()

    def read_batch(self, indices, out, stop=None):
        self.source.read_batch(indices, out, stop)
        self.check([array[: len(indices)] for array in out], indices)


def with_batch_check(source, check):
    """`source`, with `check(arrays, indices)` called on every batch it reads.

    Args:
        source: a `RecordSource` or `ArraySource`.
        check: a callable taking the flat list of arrays read (one per leaf
            of `source.element_spec`, one row per index) and the indices;
            it raises to stop training before the batch is used.

    Returns:
        A source that `make_dataset` reads like `source`.

    Example:

    >>> def no_negative_labels(arrays, indices):
    ...     if (arrays[1] < 0).any():
    ...         raise ValueError("negative label")
    >>> source = with_batch_check(ArraySource(np.zeros((4, 2)), np.arange(4)), no_negative_labels)
    >>> out = source.empty_batch(2)
    >>> source.read_batch(np.array([1, 3]), out)
    >>> out[1]
    array([1, 3])
    """
    return _Checked(source, check)


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
        given = data.source if isinstance(data, _Checked) else data  # fit's label check
        raise ValueError(
            f"{who} {why}, so it needs the training data in memory (NumPy arrays or "
            "tensors); it does not take a RecordSource or memory-mapped arrays. "
            f"Received: {type(given).__name__}"
        )
