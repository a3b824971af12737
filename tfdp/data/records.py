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

import numpy as np
import tensorflow as tf

from tfdp.data.sources import ArraySource, _as_example, _leaf_names

__all__ = ["write_records", "read_records"]

_INDEX = "records.json"


def _file_name(path):
    # "x[0]['a']" -> "x.0.a.npy"
    name = path.replace("[", ".").replace("]", "").replace("'", "")
    return name + ".npy"


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
            may be a tuple or dict of arrays. Every example must have the
            shapes and dtypes of the first.
        path: a folder to create (it must not hold records already).
        batched: True if each element is a batch of examples (first
            dimension the batch), as from `dataset.batch(...)`.

    Returns:
        int, the number of examples written.

    Raises:
        ValueError: for an empty dataset, an element that is not an example
            tuple, or one whose shape or dtype differs from the first
            (naming the element).

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
    writers, structure = None, None
    try:
        for number, element in enumerate(_examples(dataset)):
            example = _as_example(element, f"element {number}")
            leaves = [np.asarray(leaf) for leaf in tf.nest.flatten(example)]
            if writers is None:
                structure = example
                names = [_file_name(p) for p in _leaf_names(example)]
                firsts = [leaf[0] if batched else leaf for leaf in leaves]
                writers = [
                    _NpyWriter(os.path.join(path, name), row)
                    for name, row in zip(names, firsts)
                ]
            _check_element(example, structure, leaves, writers, number, batched)
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


def _check_element(example, structure, leaves, writers, number, batched):
    try:
        tf.nest.assert_same_structure(example, structure)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"Element {number} does not have the structure of element 0: {error}"
        ) from None
    lengths = set()
    for writer, leaf in zip(writers, leaves):
        shape = leaf.shape[1:] if batched else leaf.shape
        if batched:
            lengths.add(leaf.shape[0] if leaf.ndim else None)
        if shape != writer.row_shape or not np.can_cast(leaf.dtype, writer.dtype, "same_kind"):
            raise ValueError(
                f"Element {number} does not match element 0 at "
                f"{os.path.basename(writer.filename)[:-4]}: expected shape "
                f"{writer.row_shape} and dtype {writer.dtype}. Received: shape "
                f"{shape} and dtype {leaf.dtype}"
            )
    if len(lengths) > 1:
        raise ValueError(f"Element {number}: its arrays hold different numbers of rows: {lengths}")


def _to_json(structure):
    if isinstance(structure, tuple):
        return [_to_json(item) for item in structure]
    if isinstance(structure, dict):
        return {"dict": {key: _to_json(value) for key, value in structure.items()}}
    return structure


def _from_json(value, folder):
    if isinstance(value, list):
        return tuple(_from_json(item, folder) for item in value)
    if isinstance(value, dict):
        return {key: _from_json(item, folder) for key, item in value["dict"].items()}
    return np.load(os.path.join(folder, value), mmap_mode="r")


def read_records(path):
    """Opens records written by `write_records`, memory-mapped.

    Args:
        path: the folder `write_records` wrote.

    Returns:
        An `ArraySource` for `model.fit(source, batch_size=...)`; its
        `arrays` are the memory-mapped `(x, y[, sample_weight])`.

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
    with open(index_file, encoding="utf-8") as handle:
        index = json.load(handle)
    arrays = _from_json(index["files"], path)
    source = ArraySource(*arrays)
    if len(source) != index["count"]:
        raise ValueError(
            f"The records in {path!r} are incomplete: {_INDEX} lists {index['count']} "
            f"examples. Received: {len(source)} rows in the .npy files"
        )
    return source
