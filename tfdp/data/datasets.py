"""Built-in datasets for `tfdp train` and the examples.

Each loader returns `((x_train, y_train), (x_test, y_test))` with float32
features scaled to [0, 1] and int64 labels. Nothing is downloaded by
scikit-learn's digits (it ships with scikit-learn); Fashion-MNIST is read from
IDX files (a directory you give, Debian's `dataset-fashion-mnist` package or
Keras's download cache) or, failing these, from tensorflow-datasets, which
downloads it once; offline, the error says where it looked.

Example:

```python
(x_train, y_train), (x_test, y_test) = load_dataset("digits")
x_train.shape   # (1437, 64)
```
"""

import gzip
import numbers
import os
import socket

import numpy as np

__all__ = ["load_digits", "load_fashion_mnist", "load_dataset", "read_idx", "write_idx"]

DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
# tensorflow-datasets' data folder; None: its own default ($TFDS_DATA_DIR or
# ~/tensorflow_datasets).
TFDS_DATA_DIR = None
# Where tensorflow-datasets downloads Fashion-MNIST from (its GCS mirror, then
# the dataset's own URL). Offline, it retries for minutes before it fails.
_DOWNLOAD_HOSTS = (("storage.googleapis.com", 443),
                   ("fashion-mnist.s3-website.eu-central-1.amazonaws.com", 80))
_PROBE_TIMEOUT_S = 5

_FASHION_MNIST_FILES = {
    "x_train": ("train-images-idx3-ubyte", 3),
    "y_train": ("train-labels-idx1-ubyte", 1),
    "x_test": ("t10k-images-idx3-ubyte", 3),
    "y_test": ("t10k-labels-idx1-ubyte", 1),
}

# IDX type codes (third byte of the magic number) -> numpy big-endian dtype.
_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def load_digits(test_fraction=0.2, seed=0, flatten=True):
    """scikit-learn's 8x8 handwritten digits, split into train and test.

    1797 images of the digits 0-9 (shipped with scikit-learn, no download).
    Pixel values 0..16 are scaled to [0, 1]. The split is stratified by label
    and deterministic for a given `seed`.

    Args:
        test_fraction: float in (0, 1), the fraction of records in the test
            split.
        seed: int, the seed of the split.
        flatten: bool. True gives features of shape (N, 64); False gives
            images of shape (N, 8, 8, 1).

    Returns:
        `((x_train, y_train), (x_test, y_test))`, float32 features in [0, 1]
        and int64 labels in 0..9.

    Example:

    >>> (x_train, y_train), (x_test, y_test) = load_digits()
    >>> x_train.shape, x_test.shape
    ((1437, 64), (360, 64))
    """
    if (
        not isinstance(test_fraction, numbers.Real)
        or isinstance(test_fraction, bool)
        or not 0.0 < test_fraction < 1.0
    ):
        raise ValueError(
            "Expected `test_fraction` in (0, 1). "
            f"Received: test_fraction={test_fraction!r}"
        )
    from sklearn import datasets as sk_datasets
    from sklearn.model_selection import train_test_split

    digits = sk_datasets.load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    if not flatten:
        x = x.reshape(-1, 8, 8, 1)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return (x_train, y_train), (x_test, y_test)


def read_idx(path):
    """Reads one IDX file (gzipped or not) into a numpy array.

    Args:
        path: path of the file. Gzip compression is detected from the
            content, not the name.

    Returns:
        np.ndarray with the file's dimensions and (native-endian) dtype.

    Raises:
        ValueError: the file is not a valid IDX file (bad magic number,
            unknown type code, or a size that does not match its header).

    Example (Fashion-MNIST's `t10k-labels-idx1-ubyte.gz` reads as 10,000
    labels; this one, written by `write_idx`, holds three):

    >>> import os, tempfile
    >>> import numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "labels-idx1-ubyte")
    >>> write_idx(path, np.array([7, 2, 1], np.uint8))
    >>> read_idx(path)
    array([7, 2, 1], dtype=uint8)
    """
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"Could not decompress the IDX file {path!r}: {e}") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(
            f"Expected an IDX file at {path!r} (magic number 0x0000TTDD with a "
            f"known type code TT). Received magic bytes: {raw[:4].hex() or 'none'}"
        )
    dtype = _IDX_DTYPES[raw[2]]
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(
            f"The IDX file {path!r} is truncated: its header declares {ndim} "
            f"dimensions but the file has only {len(raw)} bytes."
        )
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"The IDX file {path!r} has {len(raw) - header} data bytes; its "
            f"header (shape {shape}, dtype {dtype}) requires {expected}."
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path, array):
    """Writes `array` as one (uncompressed) IDX file, as `read_idx` reads it.

    Args:
        path: path of the file to write.
        array: an array of dtype uint8, int8, int16, int32, float32 or
            float64, with 1 to 255 dimensions.

    Raises:
        ValueError: for another dtype or number of dimensions.

    Example:

    >>> import os, tempfile
    >>> import numpy as np
    >>> path = os.path.join(tempfile.mkdtemp(), "images-idx3-ubyte")
    >>> write_idx(path, np.zeros((2, 28, 28), np.uint8))
    >>> read_idx(path).shape
    (2, 28, 28)
    """
    array = np.asarray(array)
    codes = {dtype.newbyteorder("=").str[1:]: code for code, dtype in _IDX_DTYPES.items()}
    code = codes.get(array.dtype.str[1:])
    if code is None or not 1 <= array.ndim <= 255:
        raise ValueError(
            "Expected an array of dtype uint8, int8, int16, int32, float32 or float64 with "
            f"1 to 255 dimensions. Received: array of dtype {array.dtype} and shape {array.shape}"
        )
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    with open(path, "wb") as f:
        f.write(header + array.astype(_IDX_DTYPES[code]).tobytes())


def _find_idx_file(directory, stem):
    for name in (stem + ".gz", stem):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def _has_fashion_mnist(directory):
    return all(
        _find_idx_file(directory, stem) is not None
        for stem, _ in _FASHION_MNIST_FILES.values()
    )


def _read_fashion_mnist_dir(directory):
    arrays = {}
    missing = []
    for key, (stem, ndim) in _FASHION_MNIST_FILES.items():
        path = _find_idx_file(directory, stem)
        if path is None:
            missing.append(f"{stem}[.gz]")
            continue
        arrays[key] = (path, ndim)
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST IDX files not found in data_dir={directory!r}. "
            f"Looked for: {', '.join(missing)} (gzipped or not)."
        )
    loaded = {}
    for key, (path, ndim) in arrays.items():
        array = read_idx(path)
        if array.ndim != ndim:
            raise ValueError(
                f"Expected {ndim} dimension(s) in {path!r}. "
                f"Received: shape={array.shape}"
            )
        loaded[key] = array
    for split in ("train", "test"):
        x, y = loaded[f"x_{split}"], loaded[f"y_{split}"]
        if len(x) != len(y):
            raise ValueError(
                f"Fashion-MNIST {split} images and labels disagree in {directory!r}: "
                f"{len(x)} images, {len(y)} labels."
            )
    return tuple(
        (
            _scale_images(loaded[f"x_{split}"]),
            loaded[f"y_{split}"].astype(np.int64),
        )
        for split in ("train", "test")
    )


def _scale_images(images):
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[..., np.newaxis]
    return images.astype(np.float32) / np.float32(255.0)


def keras_cache_dir():
    """Where `keras.datasets.fashion_mnist.load_data()` keeps its IDX files."""
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "datasets", "fashion-mnist")


def _can_download():
    """Whether a download host answers within seconds (it does not offline)."""
    for host, port in _DOWNLOAD_HOSTS:
        try:
            socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S).close()
            return True
        except OSError:
            continue
    return False


def _load_fashion_mnist_tfds():
    looked = f"{DEBIAN_FASHION_MNIST_DIR!r} (Debian) and {keras_cache_dir()!r} (Keras's cache)"
    fixes = (
        "install the Debian package `dataset-fashion-mnist`, or pass the folder of its "
        "four IDX files as `data_dir` (`tfdp train --data-dir`)"
    )
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(
            f"Fashion-MNIST was not found as IDX files (no `data_dir` given and none in "
            f"{looked}) and tensorflow-datasets is not installed. Install it with "
            f"`pip install -e \".[examples]\"` in the tfdp repository, or {fixes}."
        ) from e
    builder = tfds.builder("fashion_mnist", data_dir=TFDS_DATA_DIR)
    if not builder.is_prepared():
        if not _can_download():
            hosts = ", ".join(host for host, _ in _DOWNLOAD_HOSTS)
            raise FileNotFoundError(
                f"Fashion-MNIST was not found on this machine and cannot be downloaded: "
                f"no IDX files in {looked} (no `data_dir` given), tensorflow-datasets has "
                f"not prepared it in {builder.data_dir!r}, and its download hosts ({hosts}) "
                f"did not answer within {_PROBE_TIMEOUT_S} s. Connect to the network once, "
                f"or {fixes}."
            )
        builder.download_and_prepare()
    splits = tfds.as_numpy(builder.as_dataset(batch_size=-1, as_supervised=True))
    return tuple(
        (_scale_images(splits[split][0]), np.asarray(splits[split][1]).astype(np.int64))
        for split in ("train", "test")
    )


def load_fashion_mnist(data_dir=None):
    """Fashion-MNIST: 28x28 grey images of 10 clothing classes.

    Looked for, in order: the IDX files in `data_dir` if given
    (`train-images-idx3-ubyte[.gz]`, `train-labels-idx1-ubyte[.gz]`,
    `t10k-images-idx3-ubyte[.gz]`, `t10k-labels-idx1-ubyte[.gz]`); the same
    files in Debian's `/usr/share/datasets/fashion-mnist`
    (package `dataset-fashion-mnist`); Keras's download cache
    (`~/.keras/datasets/fashion-mnist`); tensorflow-datasets (its prepared
    copy, else a download).

    Args:
        data_dir: optional directory holding the four IDX files.

    Returns:
        `((x_train, y_train), (x_test, y_test))`: float32 images in [0, 1] of
        shape (60000, 28, 28, 1) and (10000, 28, 28, 1), int64 labels in 0..9.

    Raises:
        FileNotFoundError: `data_dir` is given but lacks some of the files.
        FileNotFoundError: no copy was found and the download hosts do not
            answer (offline); the message names every place looked in.
        ImportError: no IDX files were found and tensorflow-datasets is not
            installed.

    Example (the real files give 60,000 and 10,000 images; these, written
    by `write_idx`, hold 6 and 4):

    >>> import os, tempfile
    >>> import numpy as np
    >>> folder = tempfile.mkdtemp()
    >>> for split, n in (("train", 6), ("t10k", 4)):
    ...     write_idx(os.path.join(folder, f"{split}-images-idx3-ubyte"), np.zeros((n, 28, 28), np.uint8))
    ...     write_idx(os.path.join(folder, f"{split}-labels-idx1-ubyte"), np.arange(n, dtype=np.uint8))
    >>> (x_train, y_train), (x_test, y_test) = load_fashion_mnist(data_dir=folder)
    >>> x_train.shape, y_test.tolist()
    ((6, 28, 28, 1), [0, 1, 2, 3])
    """
    if data_dir is not None:
        data_dir = os.fspath(data_dir)
        if not os.path.isdir(data_dir):
            raise FileNotFoundError(
                f"Expected `data_dir` to be a directory holding the Fashion-MNIST "
                f"IDX files. Received: data_dir={data_dir!r} (not a directory)"
            )
        return _read_fashion_mnist_dir(data_dir)
    for directory in (DEBIAN_FASHION_MNIST_DIR, keras_cache_dir()):
        if _has_fashion_mnist(directory):
            return _read_fashion_mnist_dir(directory)
    return _load_fashion_mnist_tfds()


_LOADERS = {
    "digits": lambda data_dir: load_digits(),
    "fashion_mnist": lambda data_dir: load_fashion_mnist(data_dir=data_dir),
}


def load_dataset(name, data_dir=None):
    """Loads a built-in dataset by name.

    Args:
        name: "digits" or "fashion_mnist" ("fashion-mnist" is accepted too).
        data_dir: optional directory of IDX files, used by "fashion_mnist"
            (ignored by "digits", which ships with scikit-learn).

    Returns:
        `((x_train, y_train), (x_test, y_test))` as the named loader returns.

    Example:

    >>> (x_train, y_train), _ = load_dataset("digits")
    >>> x_train.dtype, y_train.dtype
    (dtype('float32'), dtype('int64'))
    """
    if not isinstance(name, str):
        raise TypeError(
            "Expected `name` to be a string, one of "
            f"{sorted(_LOADERS)}. Received: name={name!r}"
        )
    key = name.strip().lower().replace("-", "_")
    if key not in _LOADERS:
        raise ValueError(
            f"Unknown dataset. Expected `name` to be one of {sorted(_LOADERS)}. "
            f"Received: name={name!r}"
        )
    return _LOADERS[key](data_dir)
