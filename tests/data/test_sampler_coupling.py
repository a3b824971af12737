"""Coupling tests: one unit's presence never moves another unit's draws.

Every sampler's randomness must be the unit's own: with the same key,
removing (or adding, or replacing) one unit leaves every other unit's draws
bit for bit the same where the unit has an identity of its own (a person's
id), and the same in law where it has only its position (a record's index:
the draws are i.i.d. over positions, so the others' joint law is a product
that does not care where they sit). Issue 43, item 3: the user sampler chose
a person's records from frac(rank * PHI + shift), one shift for everybody,
so removing one person changed the records of most people after them.
"""

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tfdp.data.cyclic_poisson import CyclicPoissonSampler, record_groups
from tfdp.data.importance import ImportanceSampler
from tfdp.data.poisson import PoissonSampler
from tfdp.data.sampling import fold_key, philox4x32, sampling_key, unit_uniforms
from tfdp.data.users import UserRecords, UserSampler


# -- the generator --------------------------------------------------------------


@pytest.mark.parametrize("key, counter, expected", [
    # Random123's known-answer vectors for philox4x32_10.
    ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_matches_the_published_vectors_and_tensorflow(key, counter, expected):
    block = philox4x32(tf.constant(key, tf.uint64), tf.constant([counter], tf.uint64))[0]
    assert [int(word) for word in block] == list(expected)
    tf_block = tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=[4], key=tf.constant([key[0] | key[1] << 32], tf.uint64),
        counter=tf.constant([counter[0] | counter[1] << 32, counter[2] | counter[3] << 32],
                            tf.uint64), alg=1, dtype=tf.uint32)
    assert [int(word) for word in tf_block] == list(expected)


def test_unit_uniforms_are_uniform_and_each_units_own():
    codes = np.stack([np.ones(20000), np.zeros(20000), np.zeros(20000), np.arange(20000)],
                     axis=-1).astype(np.uint32)
    key = fold_key(sampling_key(0), 3, 1)
    pairs = unit_uniforms(key, codes).numpy()
    assert stats.kstest(pairs[:, 0], "uniform").pvalue > 1e-3
    assert stats.kstest(pairs[:, 1], "uniform").pvalue > 1e-3
    assert abs(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]) < 0.03
    # A unit's pair does not depend on which other units are drawn with it.
    subset = np.random.default_rng(0).permutation(20000)[:500]
    assert np.array_equal(unit_uniforms(key, codes[subset]).numpy(), pairs[subset])
    # Another key, other numbers.
    assert not np.array_equal(unit_uniforms(fold_key(sampling_key(0), 4, 1), codes).numpy(),
                              pairs)


# -- people: bit-identical couplings --------------------------------------------


def _people(num_people, per_person, rng, as_str=False):
    """Ids (shuffled record order) and a label per record (its owner, its number)."""
    owners = np.repeat(np.arange(num_people), per_person)
    labels = np.stack([owners, np.tile(np.arange(per_person), num_people)], axis=-1)
    shuffle = rng.permutation(owners.size)
    ids = owners[shuffle]
    return (np.array([f"user-{i}" for i in ids]) if as_str else ids), labels[shuffle]


def _remove(ids, labels, who):
    keep = labels[:, 0] != who
    return ids[keep], labels[keep]


def _choices(sampler, labels, key, step):
    """{person: tuple of their chosen records' labels} of one step's draw."""
    draw = sampler.draw(key, step)
    rows = draw["indices"].numpy()[draw["mask"].numpy() == 1]
    k = sampler.examples_per_user
    chosen = labels[rows].reshape(-1, k, 2)
    return {int(person[0, 0]): tuple(map(tuple, person)) for person in chosen}


def _old_user_rows(sampler, offset_key, users):
    """Today's rule before issue 43, the negative control: offsets from
    frac(rank * PHI + shift), one shift per step for everybody (k = 1)."""
    counts = sampler.users.counts[users]
    shift = tf.random.stateless_uniform([], seed=offset_key, dtype=tf.float64).numpy()
    spread = np.mod(users * 0.6180339887498949 + shift, 1.0)
    offset = np.minimum(np.floor(spread * counts).astype(np.int64), counts - 1)
    return sampler.users.order[sampler.users.starts[users] + offset]


@pytest.mark.parametrize("as_str", [False, True])
def test_removing_a_person_leaves_everyone_elses_records(as_str):
    # The attack: 2,000 people of 2 records, k = 1, q = 1.
    rng = np.random.default_rng(1)
    ids, labels = _people(2000, 2, rng, as_str)
    key = sampling_key(7)
    full = UserSampler(UserRecords(ids), 1, expected_users=2000, seed=0)
    for removed in (0, 1000, 1999):
        less_ids, less_labels = _remove(ids, labels, removed)
        less = UserSampler(UserRecords(less_ids), 1, expected_users=1999, seed=0)
        for step in (0, 5):
            before = _choices(full, labels, key, step)
            after = _choices(less, less_labels, key, step)
            assert set(before) - set(after) == {removed}
            changed = [p for p in after if after[p] != before[p]]
            assert changed == [], f"{len(changed)} of 1999 people changed records"
    # Both records are used: the choice is random, not always the first.
    firsts = np.mean([c[0][1] == 0 for c in _choices(full, labels, key, 0).values()])
    assert 0.45 < firsts < 0.55


def test_the_coupling_check_catches_the_old_shared_shift_rule():
    # Negative control: the same comparison on the old rule finds most people
    # after the removed one changed (the issue measured 76%).
    ids, labels = _people(2000, 2, np.random.default_rng(1))
    key = fold_key(sampling_key(7), 0, 2**40)
    full = UserSampler(UserRecords(ids), 1, expected_users=2000, seed=0)
    less_ids, less_labels = _remove(ids, labels, 1000)
    less = UserSampler(UserRecords(less_ids), 1, expected_users=1999, seed=0)
    before = labels[_old_user_rows(full, key, np.arange(2000))]
    after = less_labels[_old_user_rows(less, key, np.arange(1999))]
    before = {int(p): int(r) for p, r in before}
    after = {int(p): int(r) for p, r in after}
    changed = np.mean([after[p] != before[p] for p in after if p > 1000])
    assert changed > 0.5


def test_people_are_sampled_and_choose_records_by_their_own_id():
    # q < 1, uneven record counts, k = 3: removing, adding (an id that sorts
    # first) or replacing a person leaves the others' inclusion and records.
    rng = np.random.default_rng(2)
    counts = rng.integers(1, 8, size=2048)
    owners = np.repeat(np.arange(2048), counts)
    labels = np.stack([owners, np.concatenate([np.arange(c) for c in counts])], axis=-1)
    ids = owners + 10  # room for an id that sorts first
    key = sampling_key(11)

    def sampler(ids, people):  # q = 1/8 exactly for 2047, 2048 and 2049 people
        return UserSampler(UserRecords(ids), 3, expected_users=people / 8, seed=0)

    full = sampler(ids, 2048)
    variants = {
        "removed": (*_remove(ids, labels, 700), 2047),
        "added": (np.concatenate([ids, [0, 0]]),
                  np.concatenate([labels, [[-10, 0], [-10, 1]]]), 2049),
        "replaced": (np.concatenate([_remove(ids, labels, 700)[0], [710] * 9]),
                     np.concatenate([_remove(ids, labels, 700)[1],
                                     np.stack([[700] * 9, np.arange(9) + 100], -1)]), 2048),
    }
    for step in range(4):
        before = _choices(full, labels, key, step)
        assert 150 < len(before) < 370  # about 256 people a step
        for name, (other_ids, other_labels, people) in variants.items():
            after = _choices(sampler(other_ids, people), other_labels, key, step)
            others = set(before) | set(after)
            others -= {700, -10}
            assert {p for p in others if p in before} == {p for p in others if p in after}, name
            assert all(after[p] == before[p] for p in others if p in after), name


def test_user_draws_are_seeded_and_fresh_each_step():
    ids = np.repeat(np.arange(300), 3)
    one = UserSampler(UserRecords(ids), 2, expected_users=30, seed=5)
    two = UserSampler(UserRecords(ids), 2, expected_users=30, seed=5)
    first = one.draw(one.key, 0)
    assert np.array_equal(first["indices"], two.draw(two.key, 0)["indices"])
    assert not np.array_equal(first["users"], one.draw(one.key, 1)["users"])
    other = UserSampler(UserRecords(ids), 2, expected_users=30, seed=6)
    assert not np.array_equal(first["users"], other.draw(other.key, 0)["users"])


def test_user_inclusion_rate_and_offsets_are_uniform():
    ids = np.repeat(np.arange(4000), 5)
    sampler = UserSampler(UserRecords(ids), 1, expected_users=400, seed=0)
    sizes, offsets = [], []
    for step in range(20):
        draw = sampler.draw(sampler.key, step)
        real = draw["mask"].numpy() == 1
        sizes.append(int(real.sum()))
        offsets.extend(draw["indices"].numpy()[real] % 5)
    # 20 steps x Binomial(4000, 0.1): mean 400, sd of the mean about 4.2.
    assert abs(np.mean(sizes) - 400) < 20
    assert stats.chisquare(np.bincount(offsets, minlength=5)).pvalue > 1e-3


# -- records: exchangeable (same in law), bit-identical before the removed one ----


def _window_law_differs(patterns_full, patterns_less):
    """A chi-square two-sample test of two samples of small integer patterns."""
    categories = np.union1d(patterns_full, patterns_less)
    table = np.stack([[np.sum(patterns_full == c) for c in categories],
                      [np.sum(patterns_less == c) for c in categories]])
    table = table[:, table.sum(0) > 0]
    return stats.chi2_contingency(table).pvalue < 1e-4


def _pattern(bits):
    return int(sum(int(b) << i for i, b in enumerate(bits)))


def test_the_law_test_catches_the_old_user_rule():
    # Negative control of the law test below: with the old rule, the records
    # of the people on either side of the removed one are coupled differently
    # once the removed one is gone (P(same choice) 0.53 at two ranks apart,
    # 0.24 at one), which the test sees from 800 independent keys a side.
    ids, labels = _people(20, 2, np.random.default_rng(3))
    full = UserSampler(UserRecords(ids), 1, expected_users=20, seed=0)
    less_ids, less_labels = _remove(ids, labels, 10)
    less = UserSampler(UserRecords(less_ids), 1, expected_users=19, seed=0)
    window = np.array([8, 9, 11, 12])

    def patterns(sampler, labels, first, positions):
        out = []
        for trial in range(800):
            key = fold_key(sampling_key(first + trial), 0, 2**40)
            chosen = labels[_old_user_rows(sampler, key, positions)][:, 1]
            out.append(_pattern(chosen))
        return np.array(out)

    assert _window_law_differs(patterns(full, labels, 0, window),
                               patterns(less, less_labels, 10**6, window - [0, 0, 1, 1]))


def _drawn(sampler, key, step=0):
    draw = sampler.draw(key, step)
    return draw["indices"].numpy()[draw["mask"].numpy() == 1]


def test_poisson_records_are_exchangeable():
    full = PoissonSampler(64, 32, seed=0)  # q = 1/2 for both
    less = PoissonSampler(63, 31.5, seed=0)
    removed, window = 30, np.array([28, 29, 31, 32])
    full_law, less_law = [], []
    for trial in range(800):
        key = sampling_key(trial)
        before, after = _drawn(full, key), _drawn(less, key)
        # Bit-identical before the removed record.
        assert np.array_equal(before[before < removed], after[after < removed])
        full_law.append(_pattern(np.isin(window, before)))
        after_law = sampling_key(10**6 + trial)  # independent keys for the other sample
        less_law.append(_pattern(np.isin(window - [0, 0, 1, 1],
                                         _drawn(less, after_law))))
    assert not _window_law_differs(np.array(full_law), np.array(less_law))


def test_cyclic_groups_are_exchangeable():
    bands, removed, window = 2, 30, np.array([28, 29, 31, 32])
    full_law, less_law = [], []
    for trial in range(800):
        full = record_groups(sampling_key(trial), 64, bands)
        less = record_groups(sampling_key(trial), 63, bands)
        assert np.array_equal(full[:removed], less[:removed])
        full_law.append(_pattern(full[window]))
        other = record_groups(sampling_key(10**6 + trial), 63, bands)
        less_law.append(_pattern(other[window - [0, 0, 1, 1]]))
    assert not _window_law_differs(np.array(full_law), np.array(less_law))
    # Within an active step the group's members are Poisson-sampled by their
    # place in the group, i.i.d.: the records before the removed one keep
    # their places, so their draws are bit-identical (q = 1/4 for both).
    full = CyclicPoissonSampler(64, 8, bands=2, groups_key=sampling_key(1), seed=0)
    less = CyclicPoissonSampler(63, 7.875, bands=2, groups_key=sampling_key(1), seed=0)
    for step in range(6):
        before, after = _drawn(full, full.key, step), _drawn(less, full.key, step)
        assert np.array_equal(before[before < removed], after[after < removed])


def _dpis(ghat, seed=0):
    sampler = ImportanceSampler(ghat.size, 4, seed=seed)
    sampler.start_epoch(8.0, ghat, expected_size=float(np.sum(ghat) / 2),
                        population=float(ghat.size))
    return sampler


def test_dpis_replacing_a_record_leaves_the_others_draws():
    # A record's ghat is its own data: replacing it may change its own
    # inclusion, never another record's inclusion or stage-2 uniform.
    ghat = np.random.default_rng(4).uniform(0.5, 2.0, size=64).astype(np.float32)
    replaced = ghat.copy()
    replaced[5] = 0.0  # record 5 now never drawn
    one, two = _dpis(ghat), _dpis(replaced)
    for _ in range(20):
        a, b = one.draw(), two.draw()
        rows_a = {int(i): float(u) for i, u, m in zip(a["indices"], a["uniform"], a["mask"]) if m}
        rows_b = {int(i): float(u) for i, u, m in zip(b["indices"], b["uniform"], b["mask"]) if m}
        rows_a.pop(5, None)
        assert rows_a == rows_b


def test_dpis_records_are_exchangeable():
    ghat = np.random.default_rng(5).uniform(0.5, 2.0, size=32).astype(np.float32)
    removed, window = 15, np.array([13, 14, 16, 17])
    full, less = _dpis(ghat), _dpis(np.delete(ghat, removed), seed=1)
    full_draw, less_draw = tf.function(full.draw_tensors), tf.function(less.draw_tensors)
    full_law, less_law = [], []
    for _ in range(800):
        draw = full_draw()
        full_law.append(_pattern(np.isin(window, draw["indices"][draw["mask"] == 1])))
        draw = less_draw()
        less_law.append(_pattern(np.isin(window - [0, 0, 1, 1],
                                         draw["indices"][draw["mask"] == 1])))
    assert not _window_law_differs(np.array(full_law), np.array(less_law))
