"""write_records / read_records refuse what they cannot store or read back
exactly (issue 35, items 2, 3 and 7; issue 34, item 7): each refusal names the
element, the leaf or the file, and nothing written is silently altered."""

import json
import re

import numpy as np
import pytest

from tfdp.data import read_records, write_records


def examples(count=4, label=np.int32(1)):
    return [(np.full(3, i, np.float32), label) for i in range(count)]


@pytest.mark.parametrize("leaf, shown", [
    (None, "NoneType"), ("cat", "dtype text"), (b"raw", "dtype text"), ({"a"}, "set"),
])
def test_a_leaf_that_is_not_numeric_is_refused_when_written(tmp_path, leaf, shown):
    """The old code wrote pointer bytes for None (dtype object) and reported
    success; a string column was refused only when read back."""
    with pytest.raises(TypeError, match=rf"numeric.*element 0 at y.*Received: {re.escape(shown)}$"):
        write_records([(np.zeros(3, np.float32), leaf)] * 3, tmp_path / "r")
    later = [(np.zeros(3, np.float32), 1)] * 3 + [(np.zeros(3, np.float32), leaf)]
    with pytest.raises((TypeError, ValueError), match=r"[Ee]lement 3 .*y"):
        write_records(later, tmp_path / "later")


@pytest.mark.parametrize("first, later, shown", [
    (np.int32(1), np.int64(2**40 + 5), r"int64 value 1099511627781 would be stored as 5 in the int32"),
    (np.float32(1.0), np.float64(1e300), r"float64 value 1e\+300 would be stored as inf in the float32"),
    (np.uint8(1), np.int64(-1), r"int64 value -1 would be stored as 255 in the uint8"),
    (np.int64(1), np.float64(0.5), r"float64 values cannot be stored in the int64"),
])
def test_a_value_that_the_first_elements_dtype_cannot_hold_is_refused(tmp_path, first, later, shown,
                                                                      monkeypatch):
    """The old code stored 2**40 + 5 as 5 in an int32 column and 1e300 as inf
    in a float32 one. The value is named only with TFDP_SHOW_STEP_ERRORS=1
    (review 9, H10: an element is a private record)."""
    data = [(np.zeros(3, np.float32), first)] * 3 + [(np.zeros(3, np.float32), later)]
    with pytest.raises(ValueError, match=rf"Element 3 .* at y") as raised:
        write_records(data, tmp_path / "r")
    assert str(later.item()) not in str(raised.value)
    monkeypatch.setenv("TFDP_SHOW_STEP_ERRORS", "1")
    with pytest.raises(ValueError, match=rf"Element 3 .* at y.*{shown}"):
        write_records(data, tmp_path / "shown")


def test_values_the_first_dtype_holds_exactly_are_stored(tmp_path):
    """Control: an int64 that fits an int32 column, and a float64 rounded to
    the nearest float32 (no overflow), are written and read back."""
    data = [(np.zeros(3, np.float32), np.int32(1)), (np.full(3, 0.1, np.float64), np.int64(7)),
            (np.zeros(3, np.float32), 2)]
    assert write_records(data, tmp_path / "r") == 3
    x, y = read_records(tmp_path / "r").arrays
    assert y.dtype == np.int32 and y.tolist() == [1, 7, 2]
    assert x.dtype == np.float32 and x[1, 0] == np.float32(0.1)


def test_keys_that_spell_the_same_path_get_their_own_files(tmp_path):
    """`{"a.b": zeros, "a": {"b": ones}}` both went to x.a.b.npy (both read
    back as zeros); a key with "/" or ".." named a path outside the folder."""
    x = {"a.b": np.zeros(2, np.float32), "a": {"b": np.ones(2, np.float32)},
         "../up": np.full(2, 2.0, np.float32), "c/d": np.full(2, 3.0, np.float32),
         "..": np.full(2, 4.0, np.float32)}
    folder = tmp_path / "r"
    assert write_records([(x, 1)] * 3, folder) == 3
    read = read_records(folder).arrays[0]
    np.testing.assert_array_equal(read["a.b"], np.zeros((3, 2)))
    np.testing.assert_array_equal(read["a"]["b"], np.ones((3, 2)))
    np.testing.assert_array_equal(read["../up"], np.full((3, 2), 2.0))
    np.testing.assert_array_equal(read["c/d"], np.full((3, 2), 3.0))
    np.testing.assert_array_equal(read[".."], np.full((3, 2), 4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # nothing written outside
    assert all(p.is_file() for p in folder.iterdir())
    assert len(list(folder.iterdir())) == 7  # five x files, y, the index


def test_an_index_that_names_a_file_outside_the_folder_is_refused(tmp_path):
    write_records(examples(), tmp_path / "r")
    index = json.loads((tmp_path / "r" / "records.json").read_text())
    index["files"][0] = "../elsewhere.npy"
    (tmp_path / "r" / "records.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"records.json.*'../elsewhere.npy'"):
        read_records(tmp_path / "r")


# -- damaged record folders ----------------------------------------------------


def test_a_truncated_npy_file_is_named(tmp_path):
    """The old error: "mmap length is greater than file size", no file name."""
    write_records(examples(100), tmp_path / "r")
    path = tmp_path / "r" / "x.npy"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ValueError, match=r"x\.npy.*truncated|x\.npy.*shorter"):
        read_records(tmp_path / "r")


@pytest.mark.parametrize("text", ['{"count": 4, "fil', '{"count": 4}', '[1, 2]', '{"count": "4", "files": ["x.npy", "y.npy"]}'])
def test_a_corrupt_index_is_named(tmp_path, text):
    """The old errors: a bare JSONDecodeError, or KeyError: 'files'."""
    write_records(examples(), tmp_path / "r")
    (tmp_path / "r" / "records.json").write_text(text)
    with pytest.raises(ValueError, match=r"records\.json.*(corrupt|not)"):
        read_records(tmp_path / "r")


def test_incomplete_files_are_refused(tmp_path):
    """A .npy file holding fewer rows than the index lists (a conversion that
    stopped before its last flush) is refused, naming the counts."""
    write_records(examples(5), tmp_path / "r")
    np.save(tmp_path / "r" / "y.npy", np.ones(3, np.int32))
    with pytest.raises(ValueError, match=r"incomplete: records.json lists 5 examples.*y\.npy.*3"):
        read_records(tmp_path / "r")


def test_a_batched_element_with_a_scalar_leaf_is_named(tmp_path):
    """The old error: IndexError "too many indices for array"."""
    batches = [(np.zeros((4, 3), np.float32), np.int64(1))]
    with pytest.raises(ValueError, match=r"batched=True.*element 0 at y.*scalar"):
        write_records(batches, tmp_path / "r", batched=True)
