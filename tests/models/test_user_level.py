"""User-level DP: fit(user_ids=..., examples_per_user=k).

A step samples users (q = batch_size / U), takes k records of each, clips each
user's gradient of their mean loss as one unit and adds noise once. The
tests check the update against a reference that computes each user's
gradient one user at a time, the bound under crafted users (one person's
records replaced or removed), the sampling of users and of their records,
the accounting and the refusals.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.accounting import compute_epsilon
from tfdp.data.users import UserRecords, UserSampler

CLIP = 0.5
LR = 1.0


class NoiselessDPSGD(tfdp.optimizers.DPSGD):
    """DPSGD without noise: the update is -lr * clipped sum / b, exactly."""

    def noise_stddev(self):
        return 0.0


def make_model(seed=0, noiseless=True, **compile_kwargs):
    keras.utils.set_random_seed(seed)
    model = tfdp.DPSequential([
        keras.Input((3, 4)), keras.layers.Dense(5, activation="tanh"),
        keras.layers.Flatten(), keras.layers.Dense(3),
    ])
    cls = NoiselessDPSGD if noiseless else tfdp.optimizers.DPSGD
    model.compile(
        optimizer=cls(LR, l2_norm_clip=CLIP, noise_multiplier=1.0, seed=1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_kwargs,
    )
    return model


def weights(model):
    return [v.numpy().copy() for v in model.trainable_variables]


def data(counts, seed=0, scale=1.0):
    """Records of users with `counts[u]` records each, ids u, shuffled."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.arange(len(counts)), counts)
    order = rng.permutation(len(ids))
    x = (scale * rng.normal(size=(len(ids), 3, 4))).astype("float32")
    y = rng.integers(0, 3, size=len(ids))
    return x, y, ids[order]


def reference_update(model, x, y, ids, k, batch_size):
    """-lr / b * sum over users of clip(gradient of the mean loss of k
    records): every user is drawn (q = 1) and has k, k/2 or 1 records (so
    the k records cycled from any offset weigh each record equally)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    for user in np.unique(ids):
        rows = np.flatnonzero(ids == user)
        assert k % len(rows) == 0
        with tf.GradientTape() as tape:
            value = loss(y[rows], model(x[rows]))  # the mean over the user's records
        grads = tape.gradient(value, model.trainable_variables)
        norm = np.sqrt(sum(np.sum(np.square(g.numpy().astype(np.float64))) for g in grads))
        factor = min(1.0, CLIP / norm)
        total = [t + factor * g.numpy() for t, g in zip(total, grads)]
    return [-LR * t / batch_size for t in total]


REFERENCE_COUNTS = [4, 2, 1, 4, 4, 1, 2]


@pytest.fixture(scope="module")
def record_level_update():
    """The negative control's record-level update of the reference data
    (the same for every parametrization: one fit, shared)."""
    x, y, _ = data(REFERENCE_COUNTS, scale=3.0)
    record_level = make_model()
    before = weights(record_level)
    record_level.fit(x, y, batch_size=len(x), steps_per_epoch=1, verbose=0)
    return [a - b for a, b in zip(weights(record_level), before)]


@pytest.mark.xdist_group("user_level_record_level_update")  # one worker: the fixture once
@pytest.mark.parametrize("physical_batch_size, jit", [(None, False), (2, False), (3, True)])
def test_update_equals_clipped_per_user_reference(physical_batch_size, jit, record_level_update):
    counts = REFERENCE_COUNTS
    x, y, ids = data(counts, scale=3.0)
    model = make_model(jit_compile=jit)
    before = weights(model)
    expected = reference_update(model, x, y, ids, 4, batch_size=len(counts))
    model.fit(x, y, user_ids=ids, examples_per_user=4, batch_size=len(counts), epochs=1,
              steps_per_epoch=1, physical_batch_size=physical_batch_size, verbose=0)
    for b, a, e in zip(before, weights(model), expected):
        np.testing.assert_allclose(a - b, e, rtol=2e-4, atol=2e-7)
    # Negative control: the record-level update of the same data (from the
    # same initial weights: make_model seeds them) differs.
    moved = record_level_update
    assert max(np.max(np.abs(m - e)) for m, e in zip(moved, expected)) > 1e-3


def user_sum(model, x, y, ids, users, k=4):
    """The clipped sum of one noiseless user-level step over all users."""
    before = weights(model)
    model.fit(x, y, user_ids=ids, examples_per_user=k, batch_size=users, steps_per_epoch=1,
              verbose=0)
    change = np.concatenate([(a - b).ravel() for a, b in zip(weights(model), before)])
    return -change * users / LR


def crafted_users(kind, rng):
    """All of one person's records, crafted: huge, cancelling, or many."""
    if kind == "huge":
        return (1e6 * rng.normal(size=(3, 3, 4))).astype("float32"), np.array([0, 1, 2])
    if kind == "cancelling":  # the same inputs, labels pulling opposite ways, at 1e4
        x = np.repeat(1e4 * rng.normal(size=(1, 3, 4)), 4, 0).astype("float32")
        return x, np.array([0, 1, 0, 2])
    return (30 * rng.normal(size=(1000, 3, 4))).astype("float32"), rng.integers(0, 3, 1000)


@pytest.fixture(scope="module")
def from_the_start():
    """`make_model()` at its initial weights, for each call: one model and
    one traced step serve every noiseless sum below (the step is plain SGD
    without state, so a sum from the reset weights is a fresh model's)."""
    model = make_model()
    initial = model.get_weights()

    def reset():
        model.set_weights(initial)
        return model

    return reset


@pytest.fixture(scope="module")
def base_sum(from_the_start):
    """The clipped sum of the five users without the crafted person."""
    x, y, ids = data([4, 2, 1, 4, 3])
    return user_sum(from_the_start(), x, y, ids, users=5)


@pytest.mark.xdist_group("user_level_sums")  # one worker: the shared model once
@pytest.mark.parametrize("kind", ["huge", "cancelling", "many"])
def test_removing_or_replacing_one_person_moves_the_sum_by_at_most_the_bound(kind, from_the_start,
                                                                             base_sum):
    rng = np.random.default_rng(3)
    x, y, ids = data([4, 2, 1, 4, 3])
    px, py = crafted_users(kind, rng)
    with_person = (np.concatenate([x, px]), np.concatenate([y, py]),
                   np.concatenate([ids, np.full(len(px), 99)]))
    base = base_sum
    added = user_sum(from_the_start(), *with_person, users=6)
    assert np.linalg.norm(added - base) <= CLIP * (1 + 1e-5)
    assert np.linalg.norm(added - base) > 0.5 * CLIP  # the person is clipped, not absent
    # Replacing person 0's records by the crafted ones: at most 2C.
    keep = ids != 0
    replaced = (np.concatenate([x[keep], px]), np.concatenate([y[keep], py]),
                np.concatenate([ids[keep], np.zeros(len(px), int)]))
    moved = np.linalg.norm(user_sum(from_the_start(), *replaced, users=5) - base)
    assert moved <= 2 * CLIP * (1 + 1e-5)


def test_a_person_with_one_record_and_one_with_a_thousand_are_clipped_alike():
    rng = np.random.default_rng(4)
    x = (3 * rng.normal(size=(1001, 3, 4))).astype("float32")
    y = np.argmin(make_model()(x).numpy(), axis=1)  # the least likely class: a large gradient
    one, many = (x[:1], y[:1]), (x[1:], y[1:])
    # k = 1 for the person with one record: examples_per_user may not exceed the
    # largest user's record count (it would only repeat the record)
    norms = [np.linalg.norm(user_sum(make_model(), px, py, np.zeros(len(px), int), users=1,
                                     k=min(4, len(px))))
             for px, py in (one, many)]
    np.testing.assert_allclose(norms, CLIP, rtol=1e-5)
    # Negative control: record-level clipping lets the thousand records add up.
    model = make_model()
    before = weights(model)
    model.fit(*many, batch_size=1000, steps_per_epoch=1, verbose=0)
    change = np.concatenate([(a - b).ravel() for a, b in zip(weights(model), before)])
    assert np.linalg.norm(change) * 1000 / LR > 100 * CLIP


def test_the_sensitivity_search_passes_with_users_and_a_mutation_fails_it(monkeypatch):
    x, y, _ = data([3] * 4)
    model = make_model(noiseless=False)
    result = tfdp.auditing.sensitivity_search(model, x, y, records=3, search_steps=8,
                                              examples_per_user=3)
    assert result.worst_ratio <= 1 + 1e-5, result.summary()
    assert result.worst_ratio > 0.9  # a crafted user reaches the bound
    # Mutation: clip each user's records one by one (per record, not per user).
    from tfdp.models import user_level

    monkeypatch.setattr(user_level, "per_user_gradients",
                        lambda per_example, info, k: (per_example, info))
    with pytest.raises(tfdp.auditing.SensitivityExceeded):
        tfdp.auditing.sensitivity_search(model, x, y, records=3, search_steps=8,
                                         examples_per_user=3).check()


def test_user_sampler_draws_users_with_q_and_k_of_their_records_evenly():
    counts = np.array([1, 3, 8, 20])
    ids = np.repeat(np.arange(4), counts)
    sampler = UserSampler(UserRecords(ids), 4, expected_users=2, seed=0)
    drawn_users = np.zeros(4)
    uses = np.zeros(len(ids))
    steps = 2000
    for step in range(steps):
        draw = sampler.draw(sampler.key, step)
        users = draw["users"].numpy()[draw["user_mask"].numpy() > 0]
        drawn_users[users] += 1
        rows = draw["indices"].numpy().reshape(-1, 4)[: len(users)]
        for user, records in zip(users, rows):
            assert set(ids[records]) == {user}
            assert len(set(records)) == min(4, counts[user])  # distinct when it has 4
            np.add.at(uses, records, 1)
    rate = drawn_users / steps
    np.testing.assert_allclose(rate, 0.5, atol=4 * np.sqrt(0.25 / steps))
    for user in range(4):  # every record of a user used equally often
        share = uses[ids == user] / (drawn_users[user] * 4)
        np.testing.assert_allclose(share, 1 / counts[user], atol=0.05 + 4 / np.sqrt(steps))
    assert np.count_nonzero(uses[ids == 3]) == 20  # a fixed offset would use 4 of them


def test_epsilon_is_per_person_and_equals_dpsgd_at_users():
    x, y, ids = data([5] * 40)
    model = make_model(noiseless=False)
    model.fit(x, y, user_ids=ids, examples_per_user=5, batch_size=8, epochs=2, verbose=0)
    steps = model.privacy.steps
    assert steps == 2 * 5  # epochs of U / b steps: users, not records
    expected = compute_epsilon(1.0, 8 / 40, steps, 1e-5)
    assert model.privacy.epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
    assert model.privacy.epsilon(1e-5) != pytest.approx(compute_epsilon(1.0, 8 / 200, steps, 1e-5))
    statement = model.privacy.statement(1e-5)
    assert "at the user level" in statement and "one person" in statement
    assert "record level" not in statement
    assert "number of people U (treated as public" in statement
    assert "a person with k records gets" not in statement  # the record-level caveat
    restored = tfdp.accounting.PrivacyLedger.from_json(model.privacy.to_json())
    assert restored.relation == "add_or_remove_user"


def test_user_level_on_a_record_source_trains_as_on_arrays():
    x, y, ids = data([4, 2, 1, 4, 3, 2])
    source = tfdp.data.RecordSource([(x[i], y[i]) for i in range(len(x))])
    trained = []
    for inputs in ((x, y), (source,)):
        model = make_model(noiseless=False)
        model.fit(*inputs, user_ids=ids, examples_per_user=4, batch_size=3, epochs=2,
                  physical_batch_size=2, verbose=0)
        trained.append(weights(model))
    for a, b in zip(*trained):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


PER_RECORD_MECHANISMS = {
    "DPIS": lambda: tfdp.optimizers.DPIS(0.5, l2_norm_clip=1.0, target_epsilon=4.0, epochs=3,
                                         sigma_n=5.0, seed=1),
    "AdaDP": lambda: tfdp.optimizers.AdaDP(0.01, l2_norm_clip=0.7, noise_multiplier=1.3, seed=1),
    "SADPSGD": lambda: tfdp.optimizers.SADPSGD(
        0.5, l2_norm_clip=0.3, noise_multiplier=1.0, public_energy_data=None, seed=7),
    "DPBandMF": lambda: tfdp.optimizers.DPBandMF(
        keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.0, bands=2),
}


@pytest.mark.parametrize("optimizer", sorted(PER_RECORD_MECHANISMS))
def test_mechanisms_analysed_per_record_refuse_user_ids(optimizer):
    model = make_model()
    model.compile(optimizer=PER_RECORD_MECHANISMS[optimizer](),
                  loss="sparse_categorical_crossentropy")
    x, y, ids = data([2] * 6)
    with pytest.raises(ValueError, match=f"{optimizer} cannot train with user_ids"):
        model.fit(x, y, user_ids=ids, examples_per_user=2, batch_size=2, verbose=0)
    assert model.privacy.steps == 0


def test_the_sensitivity_search_refuses_users_for_a_mechanism_analysed_per_record():
    model = make_model()
    model.compile(optimizer=PER_RECORD_MECHANISMS["SADPSGD"](),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y, _ = data([2] * 4)
    with pytest.raises(ValueError, match="SADPSGD cannot train with user_ids.*examples_per_user=3"):
        tfdp.auditing.sensitivity_search(model, x, y, records=3, examples_per_user=3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(user_ids="ids"), "examples_per_user=None"),
    (dict(examples_per_user=2), "pass user_ids too"),
    (dict(user_ids="ids", examples_per_user=0), "examples_per_user=0"),
    (dict(user_ids="ids", examples_per_user=2, validation_split=0.2), "hold out whole users"),
    (dict(user_ids="short", examples_per_user=2), "user_ids with 11 entries"),
    (dict(user_ids="float", examples_per_user=2), "dtype float64"),
    (dict(user_ids="ids", examples_per_user=2, batch_size=7), "users \\(distinct user_ids\\) \\(6\\)"),
])
def test_bad_user_arguments_are_refused_before_any_step(kwargs, message):
    x, y, ids = data([2] * 6)
    choices = {"ids": ids, "short": ids[:-1], "float": ids.astype(float)}
    kwargs = {k: choices.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    kwargs.setdefault("batch_size", 2)
    model = make_model()
    with pytest.raises(ValueError, match=message):
        model.fit(x, y, verbose=0, **kwargs)
    assert model.privacy.steps == 0


def test_record_and_user_level_steps_do_not_mix_in_one_ledger():
    x, y, ids = data([2] * 6)
    model = make_model()
    model.fit(x, y, batch_size=4, steps_per_epoch=1, verbose=0)
    with pytest.raises(ValueError, match="record-level private steps"):
        model.fit(x, y, user_ids=ids, examples_per_user=2, batch_size=2, verbose=0)
    users_first = make_model()
    users_first.fit(x, y, user_ids=ids, examples_per_user=2, batch_size=2, steps_per_epoch=1,
                    verbose=0)
    with pytest.raises(ValueError, match="holds user-level steps"):
        users_first.fit(x, y, batch_size=4, verbose=0)
    ledger = tfdp.accounting.PrivacyLedger()
    ledger.begin_steps(tfdp.accounting.dpsgd_event(1.0, 0.1))
    ledger.advance(3)
    with pytest.raises(ValueError, match="must all be user-level or all record-level"):
        ledger.begin_steps(tfdp.accounting.dpsgd_event(1.0, 0.1), relation="add_or_remove_user")


def text_model(policy):
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model = tfdp.DPSequential([
            keras.Input((6,), dtype="int32"), keras.layers.Embedding(20, 8),
            keras.layers.Dense(8, activation="relu"), keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ])
    finally:
        keras.config.set_dtype_policy("float32")
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=CLIP, noise_multiplier=0.5,
                                                  seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_a_sequence_model_trains_user_level_and_keeps_the_bound(policy):
    rng = np.random.default_rng(5)
    x = rng.integers(0, 20, size=(60, 6)).astype("int32")
    y = rng.integers(0, 2, size=60)
    ids = rng.integers(0, 12, size=60)
    model = text_model(policy)
    before = weights(model)
    model.fit(x, y, user_ids=ids, examples_per_user=3, batch_size=4, epochs=2, verbose=0)
    after = weights(model)
    assert all(np.all(np.isfinite(a)) for a in after)
    assert max(np.max(np.abs(a - b)) for a, b in zip(after, before)) > 1e-3
    result = tfdp.auditing.sensitivity_search(model, x, y, records=3, search_steps=6)
    assert result.worst_ratio <= 1 + 1e-5, result.summary()


def test_a_privacy_journal_replays_user_level_steps_as_the_ledger(tmp_path):
    x, y, ids = data([3] * 12)
    journal = tfdp.callbacks.PrivacyJournal(str(tmp_path / "journal.jsonl"))
    model = make_model(noiseless=False)
    model.fit(x, y, user_ids=ids, examples_per_user=3, batch_size=4, epochs=2, verbose=0,
              callbacks=[journal])
    replay = make_model(noiseless=False)
    assert journal.recover(replay) == model.privacy.steps == 6
    assert replay.privacy.relation == "add_or_remove_user"
    assert replay.privacy.epsilon(1e-5) == model.privacy.epsilon(1e-5)
