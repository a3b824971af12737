"""User-level DP in `DPModel.fit`: checks before the first step, and the step.

`fit(x, y, user_ids=ids, examples_per_user=k)` makes a person, not a record,
the unit of privacy (docs/guides/user-level.md). Each step samples users
(`tfdp.data.users.UserSampler`), reads k records of each, weighs every
record's loss by 1/k (so a user's summed gradient is the gradient of their
mean loss over those k records), joins each user's k per-record gradients
into one (`PerExampleGradients.grouped(k)`, which keeps the factored form and
the rounding-safe norm bounds of linear layers) and clips and noises those
per-user gradients exactly as DP-SGD does per-record ones.

Example:

>>> import keras, numpy as np, tfdp
>>> model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, seed=0),
...               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
>>> x, y = np.ones((60, 3), "float32"), np.zeros(60, "int64")
>>> owners = np.arange(60) // 6                    # 10 people, 6 records each
>>> _ = model.fit(x, y, user_ids=owners, examples_per_user=4, batch_size=5, verbose=0)
>>> model.privacy.relation
'add_or_remove_user'
"""

import tensorflow as tf

from tfdp.data.users import UserRecords, check_examples_per_user

__all__ = ["check_user_level", "check_user_level_optimizer", "per_user_gradients"]


def check_user_level(model, user_ids, examples_per_user, num_records, validation_split):
    """Validates fit's user-level arguments; returns a `UserRecords` or None.

    Args:
        model: the compiled DP model.
        user_ids: None (record-level DP) or one id per training record.
        examples_per_user: k, required with `user_ids`.
        num_records: the number of training records N.
        validation_split: fit's value (refused with `user_ids`: a split by
            record would put one person on both sides).

    Raises:
        ValueError: naming the argument and what to pass instead.
    """
    if user_ids is None:
        if examples_per_user is not None:
            raise ValueError(
                "examples_per_user is the number of records a step uses of each sampled "
                "user: pass user_ids too (one id per record). Received: "
                f"examples_per_user={examples_per_user!r} and user_ids=None"
            )
        if model.privacy.relation == "add_or_remove_user":
            carried = [c.label for c in model.privacy.carried.values()
                       if c.relation == "add_or_remove_user"]
            held = (f" (its weights carry the training of {', '.join(carried)}: train fresh "
                    "layers instead of the ones it trained)") if carried else ""
            raise ValueError(
                f"This model's privacy ledger holds user-level steps{held}: a record-level fit "
                "cannot continue it (the two guarantees do not compose into either). "
                "Pass the same user_ids and examples_per_user, or train a fresh model. "
                "Received: user_ids=None"
            )
        return None
    if examples_per_user is None:
        raise ValueError(
            "With user_ids, pass examples_per_user=k: the number of each sampled user's "
            "records a step uses (about the median records per user is a good start). "
            "Received: examples_per_user=None"
        )
    check_examples_per_user(examples_per_user)
    check_user_level_optimizer(model.optimizer, "user_ids")
    if validation_split:
        raise ValueError(
            "validation_split splits records, so one person's records would land on both "
            "sides: hold out whole users yourself and pass validation_data. Received: "
            f"validation_split={validation_split} with user_ids"
        )
    users = UserRecords(user_ids)
    if users.num_records != num_records:
        raise ValueError(
            f"Expected one user id per training record ({num_records}). Received: "
            f"user_ids with {users.num_records} entries"
        )
    check_examples_per_user(examples_per_user, users)  # what a step can hold
    if model.privacy.steps and model.privacy.relation != "add_or_remove_user":
        raise ValueError(
            f"This model already ran {model.privacy.steps} record-level private steps: a "
            "user-level fit cannot continue its ledger (a record-level guarantee does not "
            "protect a person with several records). Train a fresh model with user_ids "
            "from the start. Received: user_ids after record-level training"
        )
    return users


def check_user_level_optimizer(optimizer, received):
    """Raises unless `optimizer` can train user-level (`user_level_unsupported`).

    Args:
        optimizer: a tfdp optimizer.
        received: what the caller was given, for the message ("user_ids",
            "examples_per_user=3").

    Example:

    >>> import tfdp
    >>> check_user_level_optimizer(tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0), "user_ids")
    """
    reason = getattr(optimizer, "user_level_unsupported", None)
    if reason:
        name = type(optimizer).__name__
        raise ValueError(
            f"{name} cannot train with user_ids (user-level DP): {reason} Train "
            f"user-level with DPSGD or DPOptimizer. Received: {received} with optimizer={name}"
        )


def per_user_gradients(per_example, step_info, examples_per_user):
    """Per-user gradients from per-record ones, and the step's user mask.

    Args:
        per_example: `PerExampleGradients` of a user draw's rows (each user's
            k rows consecutive, losses already weighted 1/k).
        step_info: the step's dict; its "mask" has one entry per row.
        examples_per_user: k.

    Returns:
        (`per_example.grouped(k)`, `step_info` with "mask" one entry per user).

    Example:

    >>> from tfdp.per_example.grads import MaterializedGrads, PerExampleGradients
    >>> v = tf.Variable([0.0, 0.0])
    >>> rows = PerExampleGradients([v], [MaterializedGrads([v], [tf.eye(2)])])
    >>> users, info = per_user_gradients(rows, {"mask": tf.ones([2])}, 2)
    >>> users.materialize()[0].numpy(), info["mask"].numpy()
    (array([[1., 1.]], dtype=float32), array([1.], dtype=float32))
    """
    k = int(examples_per_user)
    user_mask = tf.reshape(tf.cast(step_info["mask"], tf.float32), [-1, k])[:, 0]
    return per_example.grouped(k), dict(step_info, mask=user_mask)
