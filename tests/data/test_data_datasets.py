"""Built-in datasets: digits, Fashion-MNIST (IDX files), and the dispatcher."""

import gzip
import os
import struct
import sys

import numpy as np
import pytest

from tfdp.data import datasets, load_dataset, load_digits, load_fashion_mnist

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"

# digits --------------------------------------------------------------------------


def test_digits_shapes_types_range():
    (x_train, y_train), (x_test, y_test) = load_digits()
    assert x_train.shape == (1437, 64) and x_test.shape == (360, 64)
    assert y_train.shape == (1437,) and y_test.shape == (360,)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    for x in (x_train, x_test):
        assert x.min() >= 0.0 and x.max() <= 1.0
    assert x_train.max() == 1.0
    assert set(np.unique(y_train)) == set(range(10))


def test_digits_images():
    (x_train, _), (x_test, _) = load_digits(flatten=False)
    assert x_train.shape == (1437, 8, 8, 1) and x_test.shape == (360, 8, 8, 1)


def test_digits_split_is_stratified():
    (_, y_train), (_, y_test) = load_digits(test_fraction=0.25)
    y_all = np.concatenate([y_train, y_test])
    expected = np.bincount(y_all) * 0.25
    assert np.all(np.abs(np.bincount(y_test) - expected) <= 1.0)


def test_digits_deterministic():
    (a, ya), (ta, _) = load_digits(seed=3)
    (b, yb), (tb, _) = load_digits(seed=3)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ya, yb)
    np.testing.assert_array_equal(ta, tb)
    (c, _), _ = load_digits(seed=4)
    assert not np.array_equal(a, c)


def rows_with_labels(x, y):
    """Rows (features then label), sorted: a multiset that can be compared."""
    table = np.concatenate([x.reshape(len(x), -1), y[:, None].astype(x.dtype)], axis=1)
    return table[np.lexsort(table.T[::-1])]


def test_digits_train_and_test_split_the_whole_dataset():
    """Train and test are disjoint and together make the whole dataset: as
    multisets of (image, label) rows they add up to scikit-learn's 1797 exactly."""
    from sklearn import datasets as sklearn_datasets  # pylint: disable=import-outside-toplevel

    full = sklearn_datasets.load_digits()
    everything = rows_with_labels((full.data / 16.0).astype(np.float32), full.target)
    (x_train, y_train), (x_test, y_test) = load_digits(seed=3)
    split = rows_with_labels(np.concatenate([x_train, x_test]), np.concatenate([y_train, y_test]))
    np.testing.assert_array_equal(split, everything)
    # Negative control: a split that repeats one training record in test is caught.
    leaky = rows_with_labels(np.concatenate([x_train, x_test[:-1], x_train[:1]]),
                             np.concatenate([y_train, y_test[:-1], y_train[:1]]))
    assert not np.array_equal(leaky, everything)


@pytest.mark.parametrize("fraction", [0, 1, -0.1, 1.5, "0.2", True])
def test_digits_bad_fraction(fraction):
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits(test_fraction=fraction)


# IDX files -----------------------------------------------------------------------


def idx_bytes(array, magic=None):
    array = np.asarray(array, dtype=np.uint8)
    if magic is None:
        magic = 0x0800 | array.ndim
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def write_fashion_files(directory, gz, n_train=12, n_test=5, skip=()):
    rng = np.random.default_rng(0)
    content = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test),
    }
    for name, array in content.items():
        if name in skip:
            continue
        data = idx_bytes(array)
        path = os.path.join(directory, name + (".gz" if gz else ""))
        with open(path, "wb") as f:
            f.write(gzip.compress(data) if gz else data)
    return content


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_from_data_dir(tmp_path, gz):
    content = write_fashion_files(str(tmp_path), gz)
    (x_train, y_train), (x_test, y_test) = load_fashion_mnist(data_dir=tmp_path)
    assert x_train.shape == (12, 28, 28, 1) and x_test.shape == (5, 28, 28, 1)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    np.testing.assert_allclose(
        x_train[..., 0], content["train-images-idx3-ubyte"] / 255.0, rtol=1e-6
    )
    np.testing.assert_array_equal(y_test, content["t10k-labels-idx1-ubyte"])


def test_fashion_mnist_missing_files_listed(tmp_path):
    write_fashion_files(str(tmp_path), gz=True, skip=("t10k-labels-idx1-ubyte",))
    with pytest.raises(FileNotFoundError, match=r"t10k-labels-idx1-ubyte\[\.gz\]"):
        load_fashion_mnist(data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="data_dir"):
        load_fashion_mnist(data_dir=tmp_path / "nope")


def test_bad_magic_number_raises(tmp_path):
    path = tmp_path / "bad-idx3-ubyte"
    path.write_bytes(idx_bytes(np.zeros((2, 28, 28)), magic=0x12340803))
    with pytest.raises(ValueError, match="magic"):
        datasets.read_idx(str(path))
    path.write_bytes(b"<html>not found</html>")
    with pytest.raises(ValueError, match="magic"):
        datasets.read_idx(str(path))
    # A bad file inside a data_dir is refused too.
    write_fashion_files(str(tmp_path), gz=False)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x99\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="magic"):
        load_fashion_mnist(data_dir=tmp_path)


def test_truncated_and_mismatched_idx_raise(tmp_path):
    path = tmp_path / "short-idx1-ubyte"
    path.write_bytes(idx_bytes(np.arange(10))[:-1])
    with pytest.raises(ValueError, match="requires 10"):
        datasets.read_idx(str(path))
    write_fashion_files(str(tmp_path), gz=False)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.arange(3)))
    with pytest.raises(ValueError, match="12 images, 3 labels"):
        load_fashion_mnist(data_dir=tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros((12, 1))))
    with pytest.raises(ValueError, match="dimension"):
        load_fashion_mnist(data_dir=tmp_path)


def test_fashion_mnist_debian(installed):
    for name in ("train-images-idx3", "train-labels-idx1", "t10k-images-idx3", "t10k-labels-idx1"):
        installed(os.path.join(DEBIAN_DIR, f"{name}-ubyte.gz"), "apt-get install dataset-fashion-mnist")
    (x_train, y_train), (x_test, y_test) = load_fashion_mnist()
    assert x_train.shape == (60000, 28, 28, 1) and x_test.shape == (10000, 28, 28, 1)
    assert y_train.shape == (60000,) and y_test.shape == (10000,)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert x_train.min() == 0.0 and x_train.max() == 1.0
    assert set(np.unique(y_train)) == set(range(10))
    assert set(np.unique(y_test)) == set(range(10))
    assert np.all(np.bincount(y_train) == 6000)


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_missing_install_fails_under_ci_and_skips_otherwise(tmp_path, monkeypatch, ci, installed):
    monkeypatch.setenv("CI", ci)
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome, match="apt-get install dataset-fashion-mnist"):
        installed(str(tmp_path / "absent"), "apt-get install dataset-fashion-mnist")
    installed(str(tmp_path), "nothing")  # present: neither


def test_fashion_mnist_without_files_or_tfds(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "DEBIAN_FASHION_MNIST_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[examples\]"` in the tfdp repository') as info:
        load_fashion_mnist()
    assert "dataset-fashion-mnist" in str(info.value)


def test_fashion_mnist_prefers_debian_over_tfds(tmp_path, monkeypatch):
    write_fashion_files(str(tmp_path), gz=True)
    monkeypatch.setattr(datasets, "DEBIAN_FASHION_MNIST_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    (x_train, _), _ = load_fashion_mnist()
    assert x_train.shape == (12, 28, 28, 1)


# load_dataset --------------------------------------------------------------------


def test_load_dataset_dispatch(tmp_path):
    (x, _), _ = load_dataset("digits")
    assert x.shape == (1437, 64)
    write_fashion_files(str(tmp_path), gz=True)
    for name in ("fashion_mnist", "fashion-mnist"):
        (x, _), _ = load_dataset(name, data_dir=tmp_path)
        assert x.shape == (12, 28, 28, 1)


def test_load_dataset_unknown_name():
    with pytest.raises(ValueError, match=r"\['digits', 'fashion_mnist'\].*name='mnist'"):
        load_dataset("mnist")
    with pytest.raises(TypeError, match="name"):
        load_dataset(None)
