"""Guards found missing by a mutation test of the privacy code (issue 43, item 12).

* `SensitivityResult.check()`'s default tolerance (1e-5 over the bound) was
  untested: a default of 1e-1 passed every test, and would let a record that
  moves the update 1.09 times the bound through.
* The search's "replace" relation could be skipped: no test had a step
  whose flaw only a replacement shows. Here a mechanism that weights the
  batch's first row 3 times (a flaw that adding a record, as the last
  drawn row or in a padded batch, never reaches, since row 0 is the same
  real record on both sides) must be reported, by the replacement (and by
  a record added first, which takes row 0).
* A step that gives each example something by its position in the batch
  (a review found constants whose rows did, 1.77x and 1.87x a neighbouring
  step's bound) is seen only when an added record moves the others down:
  the "add, record first" relation, here against a mechanism that weights
  rows +1, -1, +1, ... by position.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.auditing import SensitivityExceeded, SensitivityResult, sensitivity_search
from tfdp.auditing.neighbour_step import RELATIONS, NeighbourStep
from tfdp.mechanisms import dpsgd


def result(ratio):
    return SensitivityResult(
        worst_ratio=ratio, worst_record=(np.zeros(2), np.zeros(1)), construction="test",
        relation="add", per_example_path="batched", table=(("test", 1, ratio, "add"),),
        settings="test", steps=1, seconds=0.0,
    )


@pytest.mark.parametrize("ratio", [1.0, 1.0 + 5e-6, 1.0 + 9.9e-6, 0.3])
def test_check_accepts_ratios_within_1e_5_of_the_bound(ratio):
    result(ratio).check()


@pytest.mark.parametrize("ratio", [1.0 + 2e-5, 1.0 + 1e-4, 1.001, 1.09, float("inf"), float("nan")])
def test_check_refuses_ratios_beyond_1e_5_of_the_bound_by_default(ratio):
    with pytest.raises(SensitivityExceeded, match=r"tolerance 1e-05"):
        result(ratio).check()


def test_an_explicit_tolerance_is_the_callers():
    result(1.0 + 2e-5).check(tolerance=1e-4)
    with pytest.raises(SensitivityExceeded, match=r"tolerance 1e-06"):
        result(1.0 + 2e-6).check(tolerance=1e-6)


class FirstRowHeavyDPSGD(tfdp.optimizers.DPSGD):
    """A broken mechanism: the batch's first row gets 3 times its clip factor."""

    def clipped_sum(self, per_example, step_info):
        factors = dpsgd.clip_factors(per_example.sq_norms(), self.l2_norm_clip,
                                     step_info["mask"])
        factors = factors * tf.concat([[3.0], tf.ones_like(factors[1:])], 0)
        return per_example.weighted_sum(factors), {"nonfinite_examples": tf.constant(0.0)}


def model_with(optimizer_class):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=optimizer_class(0.1, l2_norm_clip=0.01, noise_multiplier=1.0),
                  loss="mse")
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")


class AlternatingRowsDPSGD(tfdp.optimizers.DPSGD):
    """A broken mechanism: rows 0, 2, 4, ... are added, rows 1, 3, ... subtracted."""

    def clipped_sum(self, per_example, step_info):
        factors = dpsgd.clip_factors(per_example.sq_norms(), self.l2_norm_clip,
                                     step_info["mask"])
        signs = 1.0 - 2.0 * tf.cast(tf.range(tf.shape(factors)[0]) % 2, factors.dtype)
        return per_example.weighted_sum(factors * signs), {"nonfinite_examples": tf.constant(0.0)}


def _ratios(optimizer_class):
    """A far record's ratio under each relation, on the step `optimizer_class` runs."""
    x, y = data()
    with NeighbourStep(model_with(optimizer_class), (x, y), records=3, batch_size=4,
                       physical_batch_size=None) as step:
        record = (np.full(4, 100.0, np.float32), np.zeros(2, np.float32))
        return {relation: step.ratio(record, relation) for relation in RELATIONS}


def _others(found, *relations):
    """Each construction's worst ratio, where it was reached by none of `relations`."""
    return [ratio for _, _, ratio, relation in found.table if relation not in relations]


def test_a_flaw_only_a_replacement_shows_is_found_by_the_replace_relation():
    found = sensitivity_search(model_with(FirstRowHeavyDPSGD), *data(), search_steps=4)
    assert found.relation in ("replace", "add, record first"), found.summary()
    assert found.worst_ratio > 1.1, found.summary()
    with pytest.raises(SensitivityExceeded):
        found.check()
    # every relation but these two keeps row 0 the same real record: none
    # of them sees the flaw
    assert max(_others(found, "replace", "add, record first"), default=0.0) <= 1.0 + 1e-5
    ratios = _ratios(FirstRowHeavyDPSGD)
    assert ratios["replace"] > 1.1 and ratios["add, record first"] > 1.1, ratios
    assert max(ratios[r] for r in RELATIONS if r not in ("replace", "add, record first")) \
        <= 1.0 + 1e-5, ratios
    # control: the honest mechanism passes
    honest = sensitivity_search(model_with(tfdp.optimizers.DPSGD), *data(), search_steps=4)
    assert honest.worst_ratio <= 1.0 + 1e-5, honest.summary()


def test_a_flaw_by_position_in_the_batch_is_found_by_the_record_first_relation():
    found = sensitivity_search(model_with(AlternatingRowsDPSGD), *data(), search_steps=4)
    assert found.relation == "add, record first", found.summary()
    assert found.worst_ratio > 1.1, found.summary()
    with pytest.raises(SensitivityExceeded):
        found.check()
    # every other relation keeps each real record on its row
    assert max(_others(found, "add, record first"), default=0.0) <= 1.0 + 1e-5
    ratios = _ratios(AlternatingRowsDPSGD)
    assert ratios["add, record first"] > 1.1, ratios
    assert max(ratios[r] for r in RELATIONS if r != "add, record first") <= 1.0 + 1e-5, ratios


def test_every_relation_is_measured():
    """The search measures each construction's worst record under every
    relation (a spy on the step's ratio)."""
    from tfdp.auditing import sensitivity

    seen = set()
    real = sensitivity.NeighbourStep.ratio

    def spy(self, record, relation="add"):
        seen.add(relation)
        return real(self, record, relation)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sensitivity.NeighbourStep, "ratio", spy)
        sensitivity_search(model_with(tfdp.optimizers.DPSGD), *data(), search_steps=2)
    assert seen == set(RELATIONS)
