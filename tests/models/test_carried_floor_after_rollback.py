"""A carried training's floor after the carrying model's source rolls back
(seventh review, F2): every distinct step that reached the weights is charged.

A trains 10 steps, saves, trains 10 more; B, built on A's encoder, trains 5
steps (its head learns from A's 20 steps); A rolls back to its 10-step file
and trains 30 steps on the shared encoder. 55 distinct steps reach B's
weights: A's 20 before the rollback, A's 30 after it, B's 5. Comparing
ledger segments by (event, count) took A's (event, 40) for "its 20 steps ran
on to 40" and charged 45.
"""

import dp_accounting
import keras
import numpy as np
import pytest

import tfdp
from tfdp.accounting import PrivacyLedger, dpsgd_event

DELTA, Z, BATCH, N = 1e-5, 0.8, 64, 256


def independent(steps):
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        BATCH / N, dp_accounting.GaussianDpEvent(Z)), steps)
    return accountant.get_epsilon(DELTA)


def fit(model, x, y, steps):
    if getattr(model, "optimizer", None) is None:
        model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=Z),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=steps, verbose=0)


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    path = tmp_path_factory.mktemp("rollback") / "a10.weights.h5"
    inputs = keras.Input((4,))
    encoder = keras.layers.Dense(8, activation="tanh", name="enc")
    a = tfdp.DPModel(inputs, keras.layers.Dense(2, name="head_a")(encoder(inputs)), name="A")
    fit(a, x, y, 10)
    a.save_weights(path)
    fit(a, x, y, 10)
    inputs_b = keras.Input((4,))
    b = tfdp.DPModel(inputs_b, keras.layers.Dense(2, name="head_b")(encoder(inputs_b)), name="B")
    fit(b, x, y, 5)
    before = b.privacy.epsilon(DELTA)
    a.load_weights(path)
    fit(a, x, y, 30)
    return a, b, before


def test_before_the_rollback_the_carried_charge_is_exact(rolled_back):
    _, _, before = rolled_back
    assert before == pytest.approx(independent(25), rel=1e-9)
    assert round(before, 4) == 14.8479


def test_after_the_rollback_every_distinct_step_is_charged(rolled_back):
    a, b, _ = rolled_back
    assert a.privacy.steps == 40
    assert b.privacy.epsilon(DELTA) == pytest.approx(independent(55), rel=1e-6)
    assert b.privacy.epsilon(DELTA) > independent(45) + 1.0  # what (event, count) charged


def test_the_charge_survives_saving_the_carrying_model(rolled_back, tmp_path):
    _, b, _ = rolled_back
    b.save(tmp_path / "b.keras")
    loaded = keras.models.load_model(tmp_path / "b.keras")
    assert loaded.privacy.epsilon(DELTA) == pytest.approx(independent(55), rel=1e-6)


def _source(steps):
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(Z, BATCH / N))
    ledger.advance(steps)
    return ledger


def test_a_resumed_source_that_did_not_roll_back_is_charged_once():
    """Control: saved, loaded and trained on (a resume) is the same history."""
    source = _source(20)
    holder = PrivacyLedger()
    holder.carry("a", "model 'a'", source.own_history())
    holder.hold_carried()
    resumed = PrivacyLedger.from_json(source.to_json())
    resumed.advance(15)
    holder.carry("a", "model 'a'", resumed.own_history())
    assert sum(n for _, n in holder.carried["a"].parts) == 35


def test_two_branches_from_one_file_are_both_charged_and_survive_json():
    saved = _source(10).to_json()
    first, second = PrivacyLedger.from_json(saved), PrivacyLedger.from_json(saved)
    first.advance(10)
    second.advance(30)
    holder = PrivacyLedger()
    holder.carry("a", "model 'a'", first.own_history())
    holder.hold_carried()
    holder = PrivacyLedger.from_json(holder.to_json())  # the floor keeps its identities
    holder.carry("a", "model 'a'", second.own_history())
    assert sum(n for _, n in holder.carried["a"].parts) == 10 + 10 + 30
    assert PrivacyLedger.from_json(saved).to_json() == saved  # nothing released: unchanged


def test_one_off_records_of_two_branches_are_both_charged():
    """A record released after a rollback at the index a discarded one had is another release."""
    ledger = _source(10)
    saved = ledger.to_json()
    ledger.record(dpsgd_event(2.0, 1.0))  # discarded branch: record 0
    holder = PrivacyLedger()
    holder.carry("a", "model 'a'", ledger.own_history())
    holder.hold_carried()
    rolled_back = PrivacyLedger.from_json(saved)
    rolled_back.record(dpsgd_event(2.0, 1.0))  # new branch: record 0 again
    holder.carry("a", "model 'a'", rolled_back.own_history())
    assert sorted(n for _, n in holder.carried["a"].parts) == [1, 1, 10]


@pytest.mark.parametrize("lineage, message", [
    ("x", "lineage to be a list"),
    ([["a", 0]], r"lineage\[0\] to be \[id, step, record\]"),
    ([["a", 3, 0]], r"lineage\[0\] starts at step 3"),
    ([["a", 0, 0], ["b", 99, 0]], r"lineage\[1\] starts at step 99"),
    ([], "an empty lineage"),
])
def test_a_malformed_lineage_is_refused(lineage, message):
    import json

    data = json.loads(_source(10).to_json())
    data["lineage"] = lineage
    with pytest.raises(ValueError, match="Corrupt privacy ledger: .*" + message):
        PrivacyLedger.from_json(json.dumps(data))


# -- a floor without identities (saved by an earlier tfdp) met by identified releases
# (review 8, G9): the two cannot be matched, so both are charged unless they are equal.

def charged_steps(parts, floor):
    from tfdp.accounting.carried_floor import at_least
    return sum(count for _, count, _ in at_least(parts, floor))


def test_a_floor_without_identities_is_charged_with_the_rolled_back_branches():
    """The reviewer's numbers: A ran 20 steps (the floor, from an earlier
    tfdp's file), rolled back to 10 and ran 30: 50 steps happened. The
    (event, count) rule took (event, 40) for "the floor's 20 ran on" and
    charged 40."""
    step = dpsgd_event(Z, BATCH / N)
    assert charged_steps(((step, 10, "a@0"), (step, 30, "b@10")), ((step, 20),)) >= 50
    # A resumed from an earlier tfdp's 10-step file, 10 more steps: 20 in
    # total, the floor's 20 were others (a rollback the old file cannot
    # show): not "the same" because the counts add up.
    assert charged_steps(((step, 10, "a@0"), (step, 10, "b@10")), ((step, 20),)) >= 30
    # The other way round (the floors of two trainings combined in either
    # order, tfdp.models.weight_ledgers._charges): the same charge.
    assert charged_steps(((step, 20),), ((step, 10, "a@0"), (step, 30, "b@10"))) >= 50


def test_a_floor_kept_after_such_a_charge_does_not_charge_the_branches_twice():
    """The charge above, frozen as the next floor (its releases partly
    identified), then A runs 5 more steps: 20 + 10 + 35, not the 40 A's
    releases held before counted again."""
    from tfdp.accounting.carried_floor import at_least
    step = dpsgd_event(Z, BATCH / N)
    floor = at_least(((step, 10, "a@0"), (step, 30, "b@10")), ((step, 20),))
    assert charged_steps(((step, 10, "a@0"), (step, 35, "b@10")), floor) == 20 + 10 + 35


def test_a_floor_without_identities_equal_to_one_unbranched_history_is_charged_once():
    """Negative control: the training the floor froze, loaded from that
    file and not trained since (one branch, the same releases), is charged
    once."""
    step, other = dpsgd_event(Z, BATCH / N), dpsgd_event(2 * Z, BATCH / N)
    assert charged_steps(((step, 20, "a@0"), (other, 5, "a@20")), ((step, 20), (other, 5))) == 25
    # The reverse (an identified floor, an earlier file's unnamed releases)
    # is another history, charged both (review 10, I2: over-charge, never under).
    assert charged_steps(((step, 20), (other, 5)), ((step, 20, "a@0"), (other, 5, "a@20"))) == 50


# -- both sides mixed (review 9, H6): a charge like the one above, frozen as a
# floor, holds identified releases after unnamed ones; the carried releases
# can too. The identified ones are matched by identity, only the unnamed ones
# by (event, count): an earlier file's 20 unnamed steps shared by both, then
# branch b (the floor) and, after a rollback to that file, branch c (now).

def _carried_epsilon(now, floor):
    ledger = PrivacyLedger()
    ledger.carry("a", "model 'a'", floor)
    ledger.hold_carried()
    ledger.carry("a", "model 'a'", now)
    return ledger.epsilon(DELTA)


@pytest.mark.parametrize("now, floor, happened", [
    (((20,), (30, "c@20")), ((20,), (10, "b@20")), 60),
    (((20,), (10, "b@20")), ((20,), (30, "c@20")), 60),
    (((20,), (5, "c@20")), ((20,), (10, "b@20")), 35),
], ids=["c_longer", "reversed", "b_longer"])
def test_two_mixed_sides_charge_every_branch(now, floor, happened):
    step = dpsgd_event(Z, BATCH / N)
    parts = lambda items: tuple((step,) + item for item in items)  # noqa: E731
    assert _carried_epsilon(parts(now), parts(floor)) >= independent(happened) * (1 - 1e-9)
    assert charged_steps(parts(now), parts(floor)) == happened


def test_two_mixed_sides_of_one_history_charge_it_once():
    """Negative control: the same mixed releases on both sides (nothing
    trained since the floor froze) are charged once."""
    step = dpsgd_event(Z, BATCH / N)
    mixed = ((step, 20), (step, 10, "b@20"))
    assert _carried_epsilon(mixed, mixed) == pytest.approx(independent(30), rel=1e-9)


def test_an_identified_floor_met_by_an_earlier_files_history_of_the_same_count_charges_both():
    """Review 10, I2: the one-history exemption also ran the other way: a
    floor of this version (a@0, 20 steps) met by an earlier tfdp file's 20
    steps without identity (another history) was charged 20 where 40 ran."""
    step = dpsgd_event(Z, BATCH / N)
    now, floor = ((step, 20),), ((step, 20, "a@0"),)
    assert charged_steps(now, floor) == 40
    assert _carried_epsilon(now, floor) >= independent(40) * (1 - 1e-9)
