"""Data a user declares public: checked arrays, and refused if it holds
training records.

SA-DPSGD's energy set and AdaDP's public noise shape steer every step without
noise, so they may read only public data (docs/mechanisms/sadpsgd.md, adadp.md).
Both take a public (x, y) pair through `public_arrays` and refuse one that
shares examples with the training data (`check_disjoint_from_training_data`).

Example:

>>> import numpy as np
>>> x, y, num = public_arrays((np.zeros((3, 2)), np.arange(3)), "public_data")
>>> num
3
>>> check_disjoint_from_training_data(row_hashes(x), np.ones((5, 2)), "public_data", "it steers")
"""

import numpy as np
import tensorflow as tf


def public_arrays(data, name):
    """(x, y, number of examples) from a public pair `data`, checked.

    Args:
        data: a pair (x, y) of arrays (x may be a nest of arrays).
        name: the argument's name, for errors ("public_energy_data").

    Raises:
        ValueError: not a pair, a tf.data.Dataset, empty, rows that do not
            match, non-numeric or non-finite values.
    """
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise ValueError(
            f"Expected `{name}` to be a pair (x, y) of public arrays. "
            f"Received: {name} of type {type(data).__name__}"
            + (f" with {len(data)} items" if isinstance(data, (tuple, list)) else "")
        )
    x, y = data
    if isinstance(x, tf.data.Dataset) or isinstance(y, tf.data.Dataset):
        raise ValueError(
            f"Expected `{name}` to hold arrays, not a tf.data.Dataset. "
            f"Received: {name}=(Dataset, ...)"
        )
    x = tf.nest.map_structure(np.asarray, x)
    y = np.asarray(y)
    leaves = tf.nest.flatten(x)
    num = len(leaves[0]) if leaves and leaves[0].ndim else 0
    if num == 0:
        raise ValueError(f"Received empty `{name}`: x has 0 examples.")
    for part, arr in [("x", a) for a in leaves] + [("y", y)]:
        if arr.ndim == 0 or len(arr) != num:
            raise ValueError(
                f"Expected every array of `{name}` to have {num} rows. "
                f"Received: {part} of shape {arr.shape}"
            )
        if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
            raise ValueError(
                f"Expected numeric `{name}`. Received: {part} of dtype {arr.dtype}"
            )
        if np.issubdtype(arr.dtype, np.floating) and not np.all(np.isfinite(arr)):
            raise ValueError(
                f"Expected finite `{name}` (a NaN or Inf makes what it steers NaN). "
                f"Received: {part} with non-finite values"
            )
    return x, y, num


def row_hashes(x, chunk=4096):
    """One hash per example of x (all inputs together), on float32 values."""
    leaves = [np.asarray(leaf) for leaf in tf.nest.flatten(x)]
    num = len(leaves[0])
    columns = []
    for leaf in leaves:
        hashes = []
        for start in range(0, num, chunk):
            block = np.ascontiguousarray(leaf[start : start + chunk], dtype=np.float32)
            hashes.extend(hash(row.tobytes()) for row in block.reshape(len(block), -1))
        columns.append(hashes)
    return list(zip(*columns))


def check_disjoint_from_training_data(public_hashes, train_x, name, why):
    """Raises ValueError if a public example (by `row_hashes`) is in `train_x`.

    Identical inputs in both sets are taken as the public set reading
    training records. Cost: one hash per training example, once per `fit`.

    It catches EXACT duplicates only (inputs equal as float32 bytes): a
    training record that was rescaled, cropped, augmented, re-encoded or
    shifted by one rounding step passes, and so does a different record of
    the same person. Passing the check does not make a set public; that is
    the user's declaration.

    Args:
        public_hashes: `row_hashes` of the public inputs.
        train_x: the training inputs.
        name: the public argument's name, for the error.
        why: what the public set does without noise ("The energy set steers
            every accept decision"), for the error.
    """
    train = set(row_hashes(train_x))
    shared = sum(h in train for h in public_hashes)
    if shared:
        raise ValueError(
            f"{shared} of the {len(public_hashes)} examples of `{name}` also appear "
            f"in the training data. {why} without noise, so reading training "
            "records there would be an unaccounted release. Pass a public set "
            f"disjoint from the training data (drop those {shared} examples). "
            f"Received: {shared} shared examples"
        )
