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

Which k records: user u's records in a fixed order r_0 .. r_{n_u - 1} are
read cyclically from a random offset o: r_o, r_{o+1}, ... (indices mod n_u),
k of them. A user with n_u >= k records gives k distinct records, each record
equally likely to be used in a step that samples the user; a user with fewer
records repeats them (each appears floor(k / n_u) or ceil(k / n_u) times).
The offset is uniform over 0 .. n_u - 1 at every step, a function of the
run's secret key, the step and the user only (the same for every worker);
the rule never looks at other users' data, so it does not affect privacy,
only which of a person's records train.

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

import numpy as np
import tensorflow as tf

from tfdp.data.poisson import PoissonSampler
from tfdp.data.sampling import fold_key

__all__ = ["UserRecords", "UserSampler", "check_examples_per_user"]

# 1 / golden ratio: the fractional parts of u * PHI spread users' offsets apart.
_PHI = 0.6180339887498949
# fold_key tag of a step's offset stream (the Poisson walk uses small tags 0, 1, ...).
_OFFSET_TAG = 2**40


def check_examples_per_user(examples_per_user):
    """`examples_per_user` as an int >= 1, or a ValueError saying what to pass."""
    if isinstance(examples_per_user, bool) or not isinstance(
        examples_per_user, (int, np.integer)
    ) or examples_per_user < 1:
        raise ValueError(
            "Expected `examples_per_user` to be an int >= 1: the number of each sampled "
            "user's records a step uses (a typical choice is about the median number of "
            "records per user; see docs/guides/user-level.md). Received: "
            f"examples_per_user={examples_per_user!r}"
        )
    return int(examples_per_user)


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

    Raises:
        ValueError: for ids that are not one-dimensional, empty, floats
            (a NaN id would split one person), or of mixed types.

    Example:

    >>> users = UserRecords([7, 3, 7])
    >>> users.num_users, users.order.tolist(), users.starts.tolist()
    (2, [1, 0, 2], [0, 1])
    """

    def __init__(self, user_ids):
        try:
            ids = np.asarray(user_ids)
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
        if ids.dtype.kind not in "iuUSO":
            raise ValueError(
                "Expected `user_ids` to hold integers or strings (a float id can be NaN, "
                "and NaN != NaN would split one person into several). Received: dtype "
                f"{ids.dtype}"
            )
        try:
            unique, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        except TypeError as error:
            raise ValueError(
                "Expected `user_ids` of one type (all integers or all strings). "
                f"Received: ids that cannot be compared ({error})"
            ) from None
        self.num_records = int(ids.size)
        self.num_users = int(unique.size)
        self.counts = counts.astype(np.int64)
        self.order = np.argsort(inverse.reshape(-1), kind="stable").astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)

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
    user's record indices (the module docstring says which). It has the
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

    def user_rows(self, offset_key, users, user_mask):
        """The records of `users`: k per user, consecutive, with their mask.

        Args:
            offset_key: int64 [2], the step's "offset_key".
            users: int64 [..., L] user numbers (0 .. U - 1).
            user_mask: float32 [..., L], 1 for a drawn user, 0 for padding.

        Returns:
            (int64 [..., L k] record indices, float32 [..., L k] mask).
        """
        k = self.examples_per_user
        counts, starts, order = (tf.constant(a) for a in
                                 (self.users.counts, self.users.starts, self.users.order))
        users = tf.cast(users, tf.int64)
        count = tf.gather(counts, users)
        shift = tf.random.stateless_uniform([], seed=offset_key, dtype=tf.float64)
        spread = tf.math.floormod(tf.cast(users, tf.float64) * _PHI + shift, 1.0)
        offset = tf.minimum(tf.cast(tf.floor(spread * tf.cast(count, tf.float64)), tf.int64),
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
