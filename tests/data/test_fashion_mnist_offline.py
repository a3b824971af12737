"""Fashion-MNIST offline: found in Keras's download cache, and where it is
nowhere on this machine and its download hosts cannot be reached, a clear
error at once that names every place looked in (`tfdp train --dataset
fashion_mnist` used to wait 224 s on tensorflow-datasets' download retries,
then raise a raw ConnectionError)."""

import socket

import numpy as np
import pytest

from tfdp.data import datasets, load_fashion_mnist
from tfdp.data.datasets import write_idx


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """No local copy anywhere, and no network."""
    for name in ("debian", "keras", "tfds"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(datasets, "DEBIAN_FASHION_MNIST_DIR", str(tmp_path / "debian"))
    monkeypatch.setattr(datasets, "keras_cache_dir", lambda: str(tmp_path / "keras"))
    monkeypatch.setattr(datasets, "TFDS_DATA_DIR", str(tmp_path / "tfds"))

    def offline(address, *args, **kwargs):
        raise OSError(f"[Errno -3] Temporary failure in name resolution: {address[0]}")

    monkeypatch.setattr(socket, "create_connection", offline)
    return tmp_path


def test_offline_without_a_copy_fails_at_once_naming_where_it_looked(nowhere, monkeypatch):
    tfds = pytest.importorskip("tensorflow_datasets")

    def no_download(*args, **kwargs):
        raise AssertionError("a download was tried: offline, it retries for minutes")

    monkeypatch.setattr(tfds, "load", no_download)
    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", no_download)
    with pytest.raises(FileNotFoundError) as caught:
        load_fashion_mnist()
    message = str(caught.value)
    for place in ("debian", "keras", "tfds"):
        assert str(nowhere / place) in message
    assert "cannot be downloaded" in message and "--data-dir" in message
    assert "dataset-fashion-mnist" in message


def test_keras_download_cache_is_read(nowhere):
    cache = nowhere / "keras"
    for split, n in (("train", 6), ("t10k", 4)):
        write_idx(str(cache / f"{split}-images-idx3-ubyte"), np.zeros((n, 28, 28), np.uint8))
        write_idx(str(cache / f"{split}-labels-idx1-ubyte"), np.arange(n, dtype=np.uint8))
    (x_train, _), (_, y_test) = load_fashion_mnist()
    assert x_train.shape == (6, 28, 28, 1) and y_test.tolist() == [0, 1, 2, 3]


def test_cli_says_so_in_one_line(nowhere, monkeypatch, capsys):
    pytest.importorskip("tensorflow_datasets")
    from tfdp import cli

    with pytest.raises(SystemExit) as caught:
        cli.main(["train", "--dataset", "fashion_mnist", "--epochs", "1", "--verbose", "0"])
    assert caught.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("tfdp train: error: Fashion-MNIST was not found")
    assert "Traceback" not in error
