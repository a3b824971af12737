"""`ArraySource` reads a memmap's rows from its file (os.preadv), not
through the mapping, so a file truncated under `fit` is an error instead of
SIGBUS (tests/faults/test_truncated_memmap.py). Here, on files left whole:
the rows read equal NumPy's indexing bit for bit, and the arrays whose rows
are not blocks of the file, or whose file is not the one mapped, are read
through the mapping as before.
"""

import copy
import gc
import os

import numpy as np
import pytest

from tfdp.data import ArraySource

N = 64
RNG = np.random.default_rng(0)


def saved(tmp_path, name, array):
    np.save(tmp_path / name, array)
    return np.load(tmp_path / name, mmap_mode="r")


def reads_like_numpy(source, indices):
    """Asserts `source` reads the rows `indices` (a batch, and one by one)
    as NumPy indexes its arrays, to the bit."""
    leaves = [np.asarray(leaf) for leaf in _leaves(source.arrays)]
    out = source.empty_batch(len(indices))
    source.read_batch(indices, out)
    for got, leaf in zip(out, leaves):
        want = leaf[indices]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    for index in (0, 5, len(source) - 1, -1, -len(source)):
        for got, leaf in zip(_leaves(source[index]), leaves):
            assert got.shape == leaf[index].shape and got.tobytes() == leaf[index].tobytes()


def _leaves(structure):
    if isinstance(structure, dict):
        return [leaf for key in sorted(structure) for leaf in _leaves(structure[key])]
    if isinstance(structure, (tuple, list)):
        return [leaf for part in structure for leaf in _leaves(part)]
    return [structure]


# Sorted as a Poisson draw: runs of consecutive rows (one read each), gaps,
# the first and last rows.
INDICES = np.array([0, 1, 2, 7, 9, 10, 30, 31, N // 2 - 1])

CASES = {
    "float32": lambda p: (saved(p, "x.npy", RNG.normal(size=(N, 7)).astype(np.float32)),
                          np.arange(N)),
    "int64 labels too": lambda p: (saved(p, "x.npy", RNG.normal(size=(N, 3))),
                                   saved(p, "y.npy", RNG.integers(-9, 9, N))),
    "uint8 images, int16 weights": lambda p: (
        saved(p, "x.npy", RNG.integers(0, 256, (N, 3, 5), dtype=np.uint8)),
        saved(p, "y.npy", RNG.integers(0, 3, N).astype(np.int32)),
        saved(p, "w.npy", RNG.integers(1, 9, N).astype(np.int16))),
    "bool, float16, complex64 in a dict": lambda p: (
        {"mask": saved(p, "m.npy", RNG.random((N, 4)) < 0.5),
         "half": saved(p, "h.npy", RNG.normal(size=(N, 2)).astype(np.float16)),
         "wave": saved(p, "c.npy", (RNG.normal(size=(N, 2)) + 1j).astype(np.complex64))},
        np.arange(N)),
    "views: rows from 100, every other row, reversed, first columns": lambda p: (
        (saved(p, "a.npy", RNG.normal(size=(N + 100, 6)).astype(np.float32))[100:],
         saved(p, "b.npy", RNG.normal(size=(2 * N, 3)))[::2],
         saved(p, "c.npy", RNG.normal(size=(N, 5)).astype(np.float32))[::-1],
         saved(p, "d.npy", RNG.normal(size=(N, 9)).astype(np.float32))[:, 2:5]),
        saved(p, "y.npy", RNG.integers(0, 5, 2 * N))[N:]),
    "a raw memmap at an offset, reshaped": lambda p: (
        np.memmap(_raw(p, RNG.normal(size=N * 12 + 5).astype(np.float32)), np.float32, "r",
                  offset=20, shape=(N * 12,)).reshape(N, 3, 4),
        np.arange(N)),
}


def _raw(tmp_path, array):
    array.tofile(tmp_path / "raw")
    return tmp_path / "raw"


@pytest.mark.parametrize("case", CASES)
def test_rows_read_from_the_file_equal_numpy_indexing_bit_for_bit(tmp_path, case):
    arrays = CASES[case](tmp_path)
    source = ArraySource(*arrays)
    for leaf, rows in zip(_leaves(source.arrays), source._file_rows):
        assert (rows is not None) == isinstance(leaf, np.memmap), case  # read from the file
    reads_like_numpy(source, INDICES)
    reads_like_numpy(source, np.arange(len(source)))  # one run: a single read per leaf


def test_rows_that_are_not_blocks_of_the_file_are_read_through_the_mapping(tmp_path):
    """Every other column, a transposed memmap, Fortran order, and a
    copy-on-write mapping (whose array may differ from its file: a write
    to it is read back, as NumPy's indexing reads it) keep the old reads."""
    square = saved(tmp_path, "s.npy", RNG.normal(size=(N, N)).astype(np.float32))
    fortran = np.memmap(_raw(tmp_path, RNG.normal(size=N * 3)), np.float64, "r", shape=(N, 3),
                        order="F")
    private = np.load(tmp_path / "s.npy", mmap_mode="c")
    private[5] = 42.0
    for x in (square[:, ::2], square.T, fortran, private):
        source = ArraySource(x, np.arange(N))
        assert source._file_rows[0] is None
        reads_like_numpy(source, INDICES)
    assert source[5][0][0] == 42.0


def test_a_file_replaced_or_removed_at_its_name_is_read_through_its_mapping(tmp_path):
    """The descriptor opened by name must be the mapped file's: another file
    of the same size renamed over it, or none, keeps the mapping's reads
    (of the mapped, old file). Control: a file left alone is read from it."""
    x = saved(tmp_path, "x.npy", np.arange(N * 4, dtype=np.float32).reshape(N, 4))
    assert ArraySource(x, np.arange(N))._file_rows[0] is not None  # the control
    np.save(tmp_path / "other.npy", -np.asarray(x))
    os.replace(tmp_path / "other.npy", tmp_path / "x.npy")
    source = ArraySource(x, np.arange(N))
    assert source._file_rows[0] is None
    reads_like_numpy(source, INDICES)
    os.remove(tmp_path / "x.npy")
    assert ArraySource(x, np.arange(N))._file_rows[0] is None


def test_a_shared_writable_memmap_is_read_with_its_writes(tmp_path):
    """A mode="r+" memmap written after the source was made: the file
    (the page cache the mapping shares) holds the write."""
    np.save(tmp_path / "x.npy", np.zeros((N, 3), np.float32))
    x = np.load(tmp_path / "x.npy", mmap_mode="r+")
    source = ArraySource(x, np.arange(N))
    x[7] = 3.5
    assert source._file_rows[0] is not None
    reads_like_numpy(source, INDICES)
    assert (source[7][0] == 3.5).all()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux's /proc/self/fd")
def test_copies_share_the_open_file_which_closes_with_the_last(tmp_path):
    x = saved(tmp_path, "x.npy", RNG.normal(size=(N, 4)).astype(np.float32))
    source = ArraySource(x, np.arange(N))
    fd = source._file_rows[0].fd

    def is_open():
        try:
            return os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / "x.npy")
        except FileNotFoundError:
            return False

    duplicate = copy.copy(source)
    del source
    gc.collect()
    assert is_open()
    reads_like_numpy(duplicate, INDICES)
    del duplicate
    gc.collect()
    assert not is_open()


def test_a_failed_read_names_the_file(tmp_path):
    """A read error (here EBADF: a descriptor that is not open) is an
    OSError naming the file and keeping the errno, not a bare one."""
    x = saved(tmp_path, "x.npy", RNG.normal(size=(N, 4)).astype(np.float32))
    source = ArraySource(x, np.arange(N))
    source._file_rows[0].fd = -1
    with pytest.raises(OSError, match=f"memory-mapped training file {str(tmp_path / 'x.npy')!r}"
                       ) as error:
        source.read_batch(INDICES, source.empty_batch(len(INDICES)))
    assert error.value.errno is not None


def test_an_index_out_of_range_is_an_index_error(tmp_path):
    source = ArraySource(saved(tmp_path, "x.npy", np.zeros((N, 2))), np.arange(N))
    for index in (N, -N - 1):
        with pytest.raises(IndexError, match=f"index {index} is out of bounds"):
            source[index]
    with pytest.raises(IndexError):
        source.read_batch(np.array([3, N]), source.empty_batch(2))
