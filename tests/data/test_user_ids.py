"""`user_ids` that could split one person into several are refused (issue 43, item 5).

A person split into several ids is protected as several people: their
statement would be per person while they are a group. Every route that can
split one person's ids is refused, naming the entry: object arrays and lists
whose entries are not ints or strs (a float NaN is never equal to itself,
-0.0 and 0.0 sort apart, bytes and str spell one id two ways, True is 1),
and ints mixed with strs. Integers are one person whatever their NumPy type.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.data.users import UserRecords


@pytest.mark.parametrize("ids, kind, position", [
    (np.array([1, float("nan"), 1, float("nan")], dtype=object), "float", 1),
    (np.array([float("nan")] * 6, dtype=object), "float", 0),
    ([7, 7, 7.0], "float", 2),
    (np.array([-0.0, 0.0, 1], dtype=object), "float", 0),
    (np.array([1, True, 1], dtype=object), "bool", 1),
    (np.array(["ann", b"ann"], dtype=object), "bytes", 1),
    ([3, None], "NoneType", 1),
    (np.array([2, np.float32(2)], dtype=object), "float32", 1),
])
def test_entries_that_are_not_ints_or_strs_are_refused(ids, kind, position):
    with pytest.raises(ValueError, match="user_ids") as error:
        UserRecords(ids)
    assert f"type {kind} at position {position}" in str(error.value)


@pytest.mark.parametrize("ids", [
    ["SECRET-ID-4711", 7],                   # one kind
    ["ann", "SECRET-ID-4711\x00"],          # a NUL
    ["ann", b"SECRET-ID-4711"],              # bytes
    [-4711, 2**64 - 1],                      # no one integer type
])
def test_a_refused_id_is_named_by_position_not_by_value(ids):
    """Review 10, I1: an id is a person's; the refusals quoted it."""
    with pytest.raises(ValueError, match="user_ids") as error:
        UserRecords(np.array(ids, dtype=object) if isinstance(ids[1], bytes) else ids)
    assert "4711" not in str(error.value)


@pytest.mark.parametrize("ids", [
    [7, "7", 7],
    np.array([7, "7"], dtype=object),
    ["ann", 5],
])
def test_ints_mixed_with_strs_are_refused(ids):
    with pytest.raises(ValueError, match="one kind") as error:
        UserRecords(ids)
    assert "position" in str(error.value)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.bool_])
def test_float_and_bool_arrays_are_refused(dtype):
    with pytest.raises(ValueError, match="dtype"):
        UserRecords(np.array([0, 1, 0], dtype=dtype))


def test_one_integer_is_one_person_whatever_its_type():
    mixed = np.array([5, np.int64(5), np.uint8(5), np.int32(-2), -2], dtype=object)
    users = UserRecords(mixed)
    assert users.num_users == 2 and users.counts.tolist() == [2, 3]
    same = UserRecords(np.array([-2, -2, 5, 5, 5], np.int16))
    assert np.array_equal(users.codes, same.codes)
    big = UserRecords(np.array([2**64 - 1, 2**64 - 1, 0], np.uint64))
    assert big.num_users == 2
    assert np.array_equal(UserRecords([2**64 - 1, 0]).codes, big.codes)
    with pytest.raises(ValueError, match="fit one NumPy integer type"):
        UserRecords([-1, 2**64 - 1])


def test_strings_and_tensors_are_accepted():
    users = UserRecords(["ann", np.str_("ann"), "bob"])
    assert users.num_users == 2 and users.counts.tolist() == [2, 1]
    tensor = UserRecords(tf.constant(["ann", "ann", "bob"]))
    assert tensor.num_users == 2 and tensor.counts.tolist() == [2, 1]
    assert UserRecords(tf.constant([3, 3, 4])).num_users == 2
    # Distinct ids have distinct codes (what keys each person's draws).
    many = UserRecords([f"user-{i}" for i in range(5000)])
    assert np.unique(many.codes, axis=0).shape[0] == 5000


@pytest.mark.parametrize("make", [list, lambda ids: np.asarray(ids, dtype=object),
                                  lambda ids: tf.constant(ids)],
                         ids=["list", "object array", "tf.string"])
def test_ids_with_a_nul_character_are_refused(make):
    """NumPy's string arrays drop trailing NULs: 'bob' and 'bob\\x00' became
    one person (found by review). A NumPy str array has dropped them before
    tfdp sees it; lists, object arrays and tf.string tensors are checked."""
    with pytest.raises(ValueError, match="NUL characters.*position 1"):
        UserRecords(make(["bob", "bob\x00"]))
