"""tfdp.data.datasets' docstring examples run on a fresh machine: they write
the small IDX files they read (`write_idx`), as README's test command needs
(before, two examples read Fashion-MNIST from Debian's package, which only
.ci/run installs, and failed elsewhere)."""

import builtins

import numpy as np
import pytest

from tests.test_docstring_examples import run_examples
from tfdp.data import datasets

SYSTEM_DATA = "/usr/share/datasets"


def test_the_examples_run_without_system_data_or_tfds(tmp_path, monkeypatch):
    real_open = builtins.open

    def open_without_system_data(path, *args, **kwargs):
        if str(path).startswith(SYSTEM_DATA):
            raise FileNotFoundError(f"{path} (a fresh machine has no {SYSTEM_DATA})")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_without_system_data)
    monkeypatch.setattr(datasets, "DEBIAN_FASHION_MNIST_DIR", str(tmp_path / "absent"))
    monkeypatch.setitem(__import__("sys").modules, "tensorflow_datasets", None)
    run_examples(datasets)


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "float32", "float64"])
def test_write_idx_round_trips(tmp_path, dtype):
    array = (np.arange(24).reshape(2, 3, 4) - 5).astype(dtype)
    if dtype == "uint8":
        array = np.arange(24, dtype=dtype).reshape(2, 3, 4)
    path = tmp_path / "a-idx3"
    datasets.write_idx(path, array)
    loaded = datasets.read_idx(str(path))
    assert loaded.dtype == array.dtype and loaded.shape == array.shape
    np.testing.assert_array_equal(loaded, array)


def test_write_idx_refuses_what_idx_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match=r"Received: array of dtype int64"):
        datasets.write_idx(tmp_path / "x", np.zeros(3, np.int64))
