"""User-level sampling: Poisson over people, a fixed number of records each.

With user-level DP the unit of privacy is a person (a user id), not a record.
Each step samples users independently with probability q = b / U (U users,
b the expected users per step), and takes `examples_per_user` = k records
of each sampled user; the train step sums a user's k per-record gradients
(each weighted 1/k: the gradient of the user's mean loss), clips that sum as
one unit and adds noise once (`tfdp.models.user_level`). Whatever a person's
records hold and however many they have, their contribution to a step is
bounded by the clipping norm, so the DP-SGD accountant at (U, q, steps,
sigma) bounds adding or removing one person with all their records.

Which users and which k records: every user has a code of their own, a
function of their id alone (`UserRecords.codes`: the integer itself, or a
96-bit hash of a string's UTF-8 bytes), and every random number a step
draws for a user is `tfdp.data.sampling.unit_uniforms` of that code under a
key derived from the run's secret key and the step. User u is sampled when
their inclusion uniform is below q; a sampled user's records, in a fixed
order r_0 .. r_{n_u - 1}, are read cyclically from an offset
o = floor(v n_u) of their offset uniform v: r_o, r_{o+1}, ... (indices mod
n_u), k of them. A user with n_u >= k records gives k distinct records, each
record equally likely to be used in a step that samples the user; a user
with fewer records repeats them (each appears floor(k / n_u) or
ceil(k / n_u) times).

So whether a user is sampled, and which of their records train, is a
function of the run's key, the step, the user's id and the user's own
records only: nothing about the other users (not their number, not where
the user's id sorts among theirs) enters it. Adding or removing one person
leaves every other person's draws bit for bit the same under the same key
(tests/data/test_sampler_coupling.py), which is what lets the accountant
treat the person's presence as the only difference. The draws are the same
on every worker; the rows only list the sampled users in sorted id order.

The draw's rows are the sampled users' k records each, consecutive (user j's
rows are j k .. j k + k - 1), real users first, then padding users (mask 0).

Example:

>>> users = UserRecords(["ann", "bob", "ann", "cy", "ann"])
>>> users.num_users, users.counts.tolist()
(3, [3, 1, 1])
>>> sampler = UserSampler(users, examples_per_user=2, expected_users=3, seed=0)
>>> draw = sampler.draw(sampler.key, step=0)   # q = 1: every user
>>> draw["indices"].numpy()[:6].reshape(3, 2).tolist()[1]   # bob's one record, twice
[1, 1]
"""

import hashlib

import numpy as np
import tensorflow as tf

from tfdp.data.poisson import PoissonSampler
from tfdp.data.sampling import fold_key, unit_uniforms

__all__ = ["UserRecords", "UserSampler", "check_examples_per_user", "user_codes"]

# fold_key tags of a step's per-user streams (the Poisson walk uses small tags 0, 1, ...).
_OFFSET_TAG = 2**40
_INCLUSION_TAG = 2**40 + 1
# The first word of a user's code says what kind of id the other three encode.
_INT_CODE, _STR_CODE, _BYTES_CODE = 1, 2, 3
_LOW32 = 0xFFFFFFFF


def check_examples_per_user(examples_per_user, users=None):
    """`examples_per_user` as an int >= 1, or a ValueError saying what to pass.

    With `users` (a `UserRecords`) it must also be at most the largest
    user's record count: a step holds k rows of every sampled user, and a
    larger k adds no record of anyone, only repeats (and memory: k = 10**9
    asked the input pipeline for 10**9 rows a user).

    Example:

    >>> check_examples_per_user(2, UserRecords([7, 3, 7]))
    2
    >>> check_examples_per_user(10**9, UserRecords([7, 3, 7]))
    Traceback (most recent call last):
    ...
    ValueError: Expected `examples_per_user` <= 2, ...
    """
    if isinstance(examples_per_user, bool) or not isinstance(
        examples_per_user, (int, np.integer)
    ) or examples_per_user < 1:
        raise ValueError(
            "Expected `examples_per_user` to be an int >= 1: the number of each sampled "
            "user's records a step uses (a typical choice is about the median number of "
            "records per user; see docs/guides/user-level.md). Received: "
            f"examples_per_user={examples_per_user!r}"
        )
    if users is not None and examples_per_user > users.counts.max():
        largest = int(users.counts.max())
        raise ValueError(
            f"Expected `examples_per_user` <= {largest}, the largest number of records one "
            f"user has: a step reads examples_per_user rows of every sampled user, so a "
            f"larger value adds no record, only repeats of each user's records (and rows "
            f"the step must hold: {int(examples_per_user)} per sampled user). A typical "
            f"choice is about the median, {int(np.median(users.counts))} here. Training "
            f"was not started. Received: examples_per_user={examples_per_user!r}"
        )
    return int(examples_per_user)


def _refuse_nul(value, position):
    """Refuses a string id holding a NUL character: NumPy's string arrays drop
    trailing NULs, so 'bob' and 'bob\\x00' would become one person (one
    person's id chosen to merge with another's)."""
    if ("\x00" if isinstance(value, str) else b"\x00") in value:
        raise ValueError(
            "Expected `user_ids` without NUL characters: NumPy drops trailing NULs from "
            "strings, which would merge two people's ids into one. Received: "
            f"an id with a NUL character at position {position}"
        )


def _object_ids(ids):
    """An object array of ids as an int64, uint64 or str array; every element
    must be an int (not bool) or a str, all of one kind."""
    kinds = []
    for position, value in enumerate(ids):
        if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
            kinds.append(int)
        elif isinstance(value, str):
            _refuse_nul(value, position)
            kinds.append(str)
        else:
            raise ValueError(
                "Expected every entry of `user_ids` to be an int or a str (a float can be "
                "NaN or -0.0, bytes and str spell one id two ways: either could split one "
                "person into several). Received: "
                f"an id of type {type(value).__name__} at position {position}"
            )
    if int in kinds and str in kinds:
        first_int, first_str = kinds.index(int), kinds.index(str)
        raise ValueError(
            "Expected `user_ids` of one kind, all ints or all strs (7 and '7' would be "
            f"two people, or one). Received: an int at position "
            f"{first_int} and a str at position {first_str}"
        )
    if kinds[0] is str:
        return np.asarray([str(value) for value in ids], dtype=str)
    values = [int(value) for value in ids]
    low, high = min(values), max(values)
    if low < -(2**63) or high >= 2**64 or (low < 0 and high >= 2**63):
        raise ValueError(
            "Expected integer `user_ids` that fit one NumPy integer type (int64, or uint64 "
            "when none is negative). Received: ids from below -2**63 or above 2**64 - 1, or "
            "negative ids with ids of 2**63 or more"
        )
    return np.asarray(values, dtype=np.uint64 if high >= 2**63 else np.int64)


def _checked_ids(user_ids):
    """`user_ids` as a 1-D NumPy array of integers or strings (kinds i, u, U
    or S), or a ValueError that names the entry that is neither."""
    if isinstance(user_ids, tf.Tensor):
        user_ids = user_ids.numpy()
        if user_ids.dtype == object:  # a tf.string tensor: one bytes array
            for position, value in enumerate(user_ids.reshape(-1)):
                _refuse_nul(value, position)
            user_ids = user_ids.astype(bytes)
    try:
        if isinstance(user_ids, np.ndarray) and user_ids.dtype != object:
            ids = user_ids
        else:  # lists, tensors, object arrays: look at every entry
            ids = np.asarray(user_ids, dtype=object)
    except Exception as error:  # ragged or odd objects
        raise ValueError(
            f"Expected `user_ids` to be a 1-D array of integers or strings. Received: "
            f"{type(user_ids).__name__} that NumPy cannot read as an array ({error})"
        ) from None
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(
            "Expected `user_ids` to be a non-empty 1-D array, one id per record. "
            f"Received: shape {ids.shape}"
        )
    if ids.dtype == object:
        ids = _object_ids(ids)
    if ids.dtype.kind not in "iuUS":
        raise ValueError(
            "Expected `user_ids` to hold integers or strings (a float id can be NaN, "
            "and NaN != NaN would split one person into several). Received: dtype "
            f"{ids.dtype}"
        )
    return ids


def user_codes(unique_ids):
    """Each id's code: uint32 [U, 4], a function of the id alone.

    Word 0 says the id's kind; words 1-3 hold an integer exactly (96-bit
    two's complement: the same integer gives the same code in any integer
    dtype) or the first 96 bits of the BLAKE2b hash of a string's UTF-8
    bytes (a bytes id's own bytes), so distinct ids have distinct codes
    (for strings, but for a 2^-96 chance a pair).

    Example:

    >>> user_codes(np.array([-1, 5])).tolist()
    [[1, 4294967295, 4294967295, 4294967295], [1, 0, 0, 5]]
    >>> bool((user_codes(np.array([5], np.uint8)) == user_codes(np.array([5]))).all())
    True
    """
    if unique_ids.dtype.kind in "iu":
        values = unique_ids.astype(np.uint64 if unique_ids.dtype.kind == "u" else np.int64)
        words = values.view(np.uint64)
        sign = np.where(values < 0, _LOW32, 0).astype(np.uint64)
        columns = [np.full(words.shape, _INT_CODE, np.uint64), sign, words >> np.uint64(32),
                   words & np.uint64(_LOW32)]
        return np.stack(columns, axis=-1).astype(np.uint32)
    kind = _STR_CODE if unique_ids.dtype.kind == "U" else _BYTES_CODE
    codes = np.empty((unique_ids.size, 4), np.uint32)
    codes[:, 0] = kind
    for row, value in enumerate(unique_ids.tolist()):
        data = value.encode("utf-8", "surrogatepass") if kind == _STR_CODE else value
        codes[row, 1:] = np.frombuffer(hashlib.blake2b(data, digest_size=12).digest(), "<u4")
    return codes


class UserRecords:
    """Which records belong to which user, from one id per record.

    Args:
        user_ids: array-like of N ids (integers or strings; one per record,
            in record order). The ids are the people; any number of records
            may share one.

    Attributes:
        num_records: N.
        num_users: U, the number of distinct ids.
        counts: int64 [U], each user's number of records.
        starts: int64 [U], where each user's records begin in `order`.
        order: int64 [N], record indices grouped by user (users in sorted id
            order, each user's records in their original order).
        codes: uint32 [U, 4], each user's code (`user_codes`): what keys
            the user's random draws, a function of their id alone.

    Raises:
        ValueError: for ids that are not one-dimensional or empty; that are
            floats (a NaN id would split one person) or booleans; for an
            entry of a list or object array that is not an int or a str
            (named, with its position); for ints mixed with strs.

    Example:

    >>> users = UserRecords([7, 3, 7])
    >>> users.num_users, users.order.tolist(), users.starts.tolist()
    (2, [1, 0, 2], [0, 1])
    """

    def __init__(self, user_ids):
        ids = _checked_ids(user_ids)
        unique, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        self.num_records = int(ids.size)
        self.num_users = int(unique.size)
        self.counts = counts.astype(np.int64)
        self.order = np.argsort(inverse.reshape(-1), kind="stable").astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        self.codes = user_codes(unique)

    def __repr__(self):
        return (
            f"UserRecords(num_users={self.num_users}, num_records={self.num_records}, "
            f"records per user: min {self.counts.min()}, median "
            f"{int(np.median(self.counts))}, max {self.counts.max()})"
        )


class UserSampler(PoissonSampler):
    """Poisson sampling of users, `examples_per_user` records each.

    A `PoissonSampler` over the U users (q = `expected_users` / U, padded to
    `padded_size` users) whose draw lists, for each drawn user, k of that
    user's record indices. Which users and which records are functions of
    the key, the step and each user's own id and records (the module
    docstring), not of the user's place among the others. It has the
    sampler interface of `tfdp.data.sampling`: `draw(key, step)` returns
    "indices" and "mask" with `padded_size * k` rows (a user's k rows
    consecutive), plus the users ("users", "user_mask") and the step's
    "offset_key", from which `user_rows` gives the same rows for any subset
    of the drawn users (a worker's shard).

    Args:
        users: a `UserRecords`.
        examples_per_user: k, an int >= 1.
        expected_users: b, the expected number of users a step, in [1, U].
        steps_per_epoch, seed, overflow_probability, multiple, fixed_shape:
            as for `PoissonSampler` (over users).

    Example:

    >>> sampler = UserSampler(UserRecords(np.arange(100) % 10), 4, expected_users=5, seed=0)
    >>> sampler.num_examples, sampler.padded_size
    (10, 16)
    >>> draw = sampler.draw(sampler.key, 0)
    >>> draw["indices"].shape, draw["mask"].shape
    (TensorShape([64]), TensorShape([64]))
    """

    def __init__(self, users, examples_per_user, expected_users, steps_per_epoch=None,
                 seed=None, **padding):
        if not isinstance(users, UserRecords):
            raise TypeError(
                f"Expected `users` to be a UserRecords. Received: {type(users).__name__}"
            )
        super().__init__(users.num_users, expected_users, steps_per_epoch, seed, **padding)
        self.users = users
        self.examples_per_user = check_examples_per_user(examples_per_user)

    def __repr__(self):
        return (
            f"UserSampler(num_users={self.num_examples}, "
            f"expected_users={self.expected_batch_size}, "
            f"examples_per_user={self.examples_per_user}, "
            f"steps_per_epoch={self.steps_per_epoch}, padded_size={self.padded_size})"
        )

    @property
    def num_records(self):
        """N, the records the draws index (`num_examples` is U, the users)."""
        return self.users.num_records

    def sample_indices(self, key, step):
        """Step `step`'s users: each with probability q, by their own code.

        User u is drawn when the first of `unit_uniforms(fold_key(key,
        step, tag), codes[u])` is below q: a function of the key, the step
        and u's id only (the module docstring). Costs O(U) a step.

        Returns:
            int64 tensor: the sorted user numbers (0 .. U - 1) drawn.
        """
        if self.sampling_probability >= 1.0:
            return tf.range(self.num_examples, dtype=tf.int64)
        uniforms = unit_uniforms(fold_key(key, step, _INCLUSION_TAG), tf.constant(self.users.codes))
        return tf.where(uniforms[:, 0] < self.sampling_probability)[:, 0]

    def user_rows(self, offset_key, users, user_mask):
        """The records of `users`: k per user, consecutive, with their mask.

        User u's offset is floor(v n_u), v the first of
        `unit_uniforms(offset_key, codes[u])`: a function of the step's key
        and of u's id and record count only.

        Args:
            offset_key: int64 [2], the step's "offset_key".
            users: int64 [..., L] user numbers (0 .. U - 1).
            user_mask: float32 [..., L], 1 for a drawn user, 0 for padding.

        Returns:
            (int64 [..., L k] record indices, float32 [..., L k] mask).
        """
        k = self.examples_per_user
        counts, starts, order, codes = (tf.constant(a) for a in (
            self.users.counts, self.users.starts, self.users.order, self.users.codes))
        users = tf.cast(users, tf.int64)
        count = tf.gather(counts, users)
        uniform = unit_uniforms(offset_key, tf.gather(codes, users))[..., 0]
        offset = tf.minimum(tf.cast(tf.floor(uniform * tf.cast(count, tf.float64)), tf.int64),
                            count - 1)
        position = (offset[..., None] + tf.range(k, dtype=tf.int64)) % count[..., None]
        rows = tf.gather(order, tf.gather(starts, users)[..., None] + position)
        flat = tf.concat([tf.shape(users, out_type=tf.int64)[:-1], [-1]], 0)
        return tf.reshape(rows, flat), tf.repeat(tf.cast(user_mask, tf.float32), k, axis=-1)

    def draw_in_graph(self, key, step):
        """Step `step`'s draw of users, expanded to their records (see class doc)."""
        users = self.pad(self.sample_indices(key, step))
        offset_key = fold_key(key, step, _OFFSET_TAG)
        rows, mask = self.user_rows(offset_key, users["indices"], users["mask"])
        return {"indices": rows, "mask": mask, "users": users["indices"],
                "user_mask": users["mask"], "offset_key": offset_key}

    def traced_draw(self):
        """Traced once per sampler: the users' records are this sampler's own."""
        return self._trace_own_draw()
