"""One-time conversion of a stream of examples into files `fit` can sample.

A tf.data pipeline, a PyDataset or a generator cannot be Poisson-sampled
(sampling needs random access). `write_records(dataset, path)` runs the
stream once and writes each array of the examples to its own `.npy` file
in the folder `path`; `read_records(path)` opens them memory-mapped as an
`ArraySource`, from which `fit` reads only each step's sampled rows. The
files are plain NumPy: `np.load(path + "/x.npy", mmap_mode="r")` works too.

Example:

```python
dataset = tf.data.Dataset.from_tensor_slices((images, labels)).map(decode)
tfdp.data.write_records(dataset, "/data/train")        # once
model.fit(tfdp.data.read_records("/data/train"), batch_size=256, epochs=10)
```
"""

import json
import os
import string

import numpy as np
import tensorflow as tf

from tfdp.data.sources import ArraySource, _as_example, _dtype_name, _leaf_names, _outline
from tfdp.record_values import record_values_shown

__all__ = ["write_records", "read_records"]

_INDEX = "records.json"
_PLAIN = frozenset(string.ascii_letters + string.digits + "_-")
_LONGEST_NAME = 200  # bytes; file systems allow 255


def _leaf_keys(structure):
    """Each leaf's path of keys, e.g. ("x", "a.b") for x={"a.b": ...}."""
    paths = []

    def walk(value, path):
        if isinstance(value, dict):
            for key in sorted(value):
                if not isinstance(key, str):
                    raise TypeError(
                        "Expected the dict keys of an example to be strings (records.json "
                        f"stores them as text). Received: key {key!r} in {'.'.join(path)}"
                    )
                walk(value[key], path + (key,))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, path + (str(i),))
        else:
            paths.append(path)

    for name, part in zip(("x", "y", "sample_weight"), structure):
        walk(part, (name,))
    return paths


def _escape(key):
    """`key` with every byte but letters, digits, "_" and "-" as %XX: a
    file-name part without ".", "/" or "..", one-to-one."""
    return "".join(
        char if char in _PLAIN else "".join(f"%{byte:02X}" for byte in char.encode("utf-8"))
        for char in key
    )


def _file_names(structure):
    """One file name per leaf, distinct even on a case-insensitive file system.

    The keys, escaped (`_escape`), joined by ".": {"a.b": ., "a": {"b": .}}
    gives "x.a%2Eb.npy" and "x.a.b.npy". A name that is too long, or equal
    to an earlier one but for case, gets "~" and the leaf's number instead
    ("~" is escaped everywhere else, so such a name is new).
    """
    names, taken = [], set()
    for number, keys in enumerate(_leaf_keys(structure)):
        name = ".".join(_escape(key) for key in keys)
        if len(name.encode("utf-8")) > _LONGEST_NAME or name.casefold() in taken:
            name = f"{name[:_LONGEST_NAME - 16]}~{number}"
        taken.add(name.casefold())
        names.append(name + ".npy")
    return names


def _numeric(array, number, where):
    """Refuses a leaf that has no fixed-size numeric dtype (None, a string)."""
    if array.dtype == object or array.dtype.kind in "USVMm":
        shown = f"dtype {_dtype_name(array.dtype)}" if array.dtype != object else (
            type(array.item()).__name__ if array.ndim == 0 else "dtype object")
        raise TypeError(
            f"Expected numeric arrays in every example: element {number} at {where} "
            "cannot be stored in a .npy file that is read back memory-mapped (decode or "
            f"drop it in the pipeline first). Received: {shown}"
        )


def _check_cast(leaf, dtype, number, where):
    """Refuses a value that the column's dtype (element 0's) cannot hold:
    an integer that would wrap or round, a float that would overflow to
    inf, a float or complex into an integer or real column."""
    if leaf.dtype == dtype or np.can_cast(leaf.dtype, dtype, "safe"):
        return
    kind, target = leaf.dtype.kind, dtype.kind
    if kind in "biu":
        stored = leaf.astype(dtype)
        bad = stored.astype(leaf.dtype) != leaf
    elif (kind, target) in (("f", "f"), ("f", "c"), ("c", "c")):
        with np.errstate(over="ignore"):
            stored = leaf.astype(dtype)
        bad = np.isfinite(stored) != np.isfinite(leaf)
    else:
        raise ValueError(
            f"Element {number} does not fit element 0's dtype at {where}: {leaf.dtype} "
            f"values cannot be stored in the {dtype} column element 0 set. Give element "
            f"0 the dtype every element has. Received: dtype {leaf.dtype}"
        )
    if np.any(bad):
        position = tuple(int(i) for i in np.argwhere(np.asarray(bad))[0])
        value, kept = leaf[position].item(), stored[position].item()
        what = (f"its {leaf.dtype} value {value!r} would be stored as {kept!r}" if record_values_shown() else
                f"its {leaf.dtype} value at index {position} would change (wrap, round or "
                f"overflow) when stored")
        raise ValueError(
            f"Element {number} does not fit element 0's dtype at {where}: {what} in the "
            f"{dtype} column element 0 set. Give element 0 a dtype that holds every value "
            f"(e.g. cast in the pipeline). Received: dtype {leaf.dtype}"
            + (f", value {value!r}" if record_values_shown() else f" ({_HOW_TO_SEE})")
        )


_HOW_TO_SEE = "the value is withheld: set TFDP_SHOW_STEP_ERRORS=1 to see it, on data that is not private"


class _NpyWriter:
    """Appends rows to a .npy file and writes its final length at close."""

    def __init__(self, filename, row):
        self.filename = filename
        self.dtype = row.dtype
        self.row_shape = row.shape
        self.count = 0
        self.file = open(filename, "wb")
        self.header_size = self._write_header()

    def _write_header(self):
        self.file.seek(0)
        header = {
            "descr": np.lib.format.dtype_to_descr(self.dtype),
            "fortran_order": False,
            "shape": (self.count, *self.row_shape),
        }
        # NumPy pads the header so that the first dimension can grow in place.
        np.lib.format.write_array_header_1_0(self.file, header)
        return self.file.tell()

    def write(self, rows):
        self.file.write(np.ascontiguousarray(rows, self.dtype).tobytes())
        self.count += len(rows)

    def close(self):
        end = self.file.tell()
        if self._write_header() != self.header_size:
            raise RuntimeError(f"The .npy header of {self.filename} changed size.")
        self.file.seek(end)
        self.file.close()


def _examples(dataset):
    if isinstance(dataset, tf.data.Dataset):
        return dataset.as_numpy_iterator()
    return iter(dataset)


def write_records(dataset, path, batched=False):
    """Writes every example of `dataset` to `.npy` files in the folder `path`.

    Args:
        dataset: a `tf.data.Dataset` or any iterable (a generator, a
            PyDataset) of examples `(x, y)` or `(x, y, sample_weight)`; `x`
            may be a tuple or dict (string keys) of numeric arrays. Every
            example must have the shapes of the first, and values its dtypes
            hold: a later int64 label is stored in element 0's int32 column
            only if it fits, a float64 in a float32 one rounded to the
            nearest float32 but never overflowing to inf.
        path: a folder to create (it must not hold records already).
        batched: True if each element is a batch of examples (first
            dimension the batch), as from `dataset.batch(...)`.

    Each array goes to its own file, named by its keys ("x.npy", "y.npy",
    "x.image.npy" for x={"image": ...}); a character of a key other than a
    letter, digit, "_" or "-" is written as %XX, so two keys never share a
    file and a key with "/" or ".." names a file in `path`.

    Returns:
        int, the number of examples written.

    Raises:
        ValueError: for an empty dataset, an element that is not an example
            tuple, one whose structure or shape differs from the first, a
            value its column's dtype cannot hold, or a scalar with
            `batched=True` (naming the element and the array).
        TypeError: for an array that is not numeric (None, strings,
            objects), naming the element and the array.

    Example:

    >>> import tempfile
    >>> folder = tempfile.mkdtemp() + "/train"
    >>> ds = tf.data.Dataset.from_tensor_slices((np.zeros((5, 2), np.float32), np.arange(5)))
    >>> write_records(ds, folder)
    5
    """
    if os.path.exists(os.path.join(path, _INDEX)):
        raise ValueError(f"Records already exist in this folder. Received: path={path!r}")
    os.makedirs(path, exist_ok=True)
    writers, structure, wheres = None, None, None
    try:
        for number, element in enumerate(_examples(dataset)):
            example = _as_example(element, f"element {number}")
            leaves = [np.asarray(leaf) for leaf in tf.nest.flatten(example)]
            if writers is None:
                structure, wheres = example, _leaf_names(example)
                names = _file_names(example)
                _check_leaves(leaves, wheres, number, batched)
                firsts = [leaf[0] if batched else leaf for leaf in leaves]
                writers = [
                    _NpyWriter(os.path.join(path, name), row)
                    for name, row in zip(names, firsts)
                ]
            _check_element(example, structure, leaves, writers, wheres, number, batched)
            for writer, leaf in zip(writers, leaves):
                writer.write(leaf if batched else leaf[None])
    finally:
        for writer in writers or []:
            writer.close()
    if writers is None:
        raise ValueError(f"Expected at least one example in `dataset`. Received: an empty dataset")
    files = tf.nest.pack_sequence_as(
        structure, [os.path.basename(w.filename) for w in writers]
    )
    index = {"count": writers[0].count, "files": _to_json(files)}
    with open(os.path.join(path, _INDEX), "w", encoding="utf-8") as handle:
        json.dump(index, handle, indent=1)
    return writers[0].count


def _check_leaves(leaves, wheres, number, batched):
    """Numeric leaves, each a batch (not a scalar) if `batched`."""
    for leaf, where in zip(leaves, wheres):
        _numeric(leaf, number, where)
        if batched and leaf.ndim == 0:
            received = f"{where}={leaf.item()!r}" if record_values_shown() else f"a {leaf.dtype} scalar"
            raise ValueError(
                "With batched=True every array of an element is a batch of examples "
                f"(first dimension the batch), but element {number} at {where} is a "
                "scalar. Pass batched=False for elements that are single examples. "
                f"Received: {received}"
            )


def _check_element(example, structure, leaves, writers, wheres, number, batched):
    try:
        tf.nest.assert_same_structure(example, structure)
    except (ValueError, TypeError) as error:
        detail = f": {error}" if record_values_shown() else ""
        raise ValueError(
            f"Element {number} does not have the structure of element 0: it is "
            f"{_outline(example, structure, 'element 0')}, element 0 is {_outline(structure)}"
            f"{detail}"
        ) from None
    _check_leaves(leaves, wheres, number, batched)
    lengths = set()
    for writer, leaf, where in zip(writers, leaves, wheres):
        shape = leaf.shape[1:] if batched else leaf.shape
        if batched:
            lengths.add(leaf.shape[0])
        if shape != writer.row_shape:
            raise ValueError(
                f"Element {number} does not match element 0 at {where}: expected shape "
                f"{writer.row_shape} and dtype {writer.dtype}. Received: shape "
                f"{shape} and dtype {leaf.dtype}"
            )
        _check_cast(leaf, writer.dtype, number, where)
    if len(lengths) > 1:
        raise ValueError(f"Element {number}: its arrays hold different numbers of rows: {lengths}")


def _to_json(structure):
    if isinstance(structure, tuple):
        return [_to_json(item) for item in structure]
    if isinstance(structure, dict):
        return {"dict": {key: _to_json(value) for key, value in structure.items()}}
    return structure


def _corrupt(index_file, what):
    return ValueError(
        f"The records index {index_file!r} is corrupt: {what}. Write the records again "
        "with tfdp.data.write_records."
    )


def _from_json(value, folder, index_file):
    """The structure of memmaps that `value` (an index's "files") names."""
    if isinstance(value, list):
        return tuple(_from_json(item, folder, index_file) for item in value)
    if isinstance(value, dict):
        if set(value) != {"dict"} or not isinstance(value["dict"], dict):
            raise _corrupt(index_file, f"expected {{\"dict\": {{...}}}}. Received: {value!r:.80}")
        return {key: _from_json(item, folder, index_file) for key, item in value["dict"].items()}
    if not (
        isinstance(value, str) and value.endswith(".npy")
        and os.path.basename(value) == value and value not in (".npy", "..npy")
        and "/" not in value and os.sep not in value
    ):
        raise _corrupt(index_file, f"expected the name of a .npy file in its folder. Received: {value!r}")
    filename = os.path.join(folder, value)
    try:
        return np.load(filename, mmap_mode="r")
    except (ValueError, OSError, EOFError) as error:
        size = os.path.getsize(filename) if os.path.exists(filename) else None
        raise ValueError(
            f"Cannot read {filename!r} of the records in {folder!r} ({size} bytes): the "
            f"file is missing, truncated or not a .npy file ({error}). Write the records "
            "again with tfdp.data.write_records."
        ) from error


def read_records(path):
    """Opens records written by `write_records`, memory-mapped.

    Args:
        path: the folder `write_records` wrote.

    Returns:
        An `ArraySource` for `model.fit(source, batch_size=...)`; its
        `arrays` are the memory-mapped `(x, y[, sample_weight])`.

    Raises:
        FileNotFoundError: `path` holds no records.json (no records, or a
            conversion that did not finish).
        ValueError: a corrupt records.json, or a .npy file that is missing,
            truncated or holds fewer rows than records.json lists (naming
            the file).

    Example:

    >>> import tempfile
    >>> folder = tempfile.mkdtemp() + "/train"
    >>> write_records([(np.zeros(2, np.float32), 1)] * 5, folder)
    5
    >>> source = read_records(folder)
    >>> len(source), source.arrays[1].dtype
    (5, dtype('int64'))
    """
    index_file = os.path.join(path, _INDEX)
    if not os.path.exists(index_file):
        raise FileNotFoundError(
            f"No records in this folder (no {_INDEX}; write them with "
            f"tfdp.data.write_records). Received: path={path!r}"
        )
    try:
        with open(index_file, encoding="utf-8") as handle:
            index = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _corrupt(index_file, f"it is not JSON ({error})") from error
    if not (isinstance(index, dict) and isinstance(index.get("files"), list)
            and len(index["files"]) in (2, 3)):
        raise _corrupt(index_file, f'expected an object with "count" and "files". Received: {index!r:.80}')
    count = index.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise _corrupt(index_file, f'expected "count" to be an int >= 1. Received: count={count!r}')
    arrays = _from_json(index["files"], path, index_file)
    for name, array in zip(tf.nest.flatten(index["files"]), tf.nest.flatten(arrays)):
        if array.ndim == 0 or len(array) != count:
            raise ValueError(
                f"The records in {path!r} are incomplete: {_INDEX} lists {count} "
                f"examples. Received: {name} with {len(array) if array.ndim else 0} rows"
            )
    return ArraySource(*arrays)
