"""`plan_fit`: what fit decides before its first step, and the order of its
checks (tfdp.models.fit_plan), which fit builds and then runs."""

import keras
import numpy as np
import pytest

import tfdp
from tfdp.models.fit_plan import FitPlan, plan_fit

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compiled(steps_per_execution=1, **noise):
    model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
    noise = noise or dict(noise_multiplier=1.0)
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, seed=0, **noise), loss=LOSS,
                  steps_per_execution=steps_per_execution)
    return model


def data(n=40):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype("float32"), rng.integers(0, 2, n)


def test_the_plan_holds_the_batch_chunking_split_and_steps_and_sets_the_step():
    model = compiled()
    x, y = data(40)
    plan = plan_fit(model, x, y, batch_size=8, physical_batch_size=4, validation_split=0.25,
                    epochs=2)
    assert isinstance(plan, FitPlan)
    assert (plan.num_examples, plan.unit, plan.batch_size, plan.physical_batch_size) == (
        30, "records", 8, 4)
    assert plan.users is None and plan.examples_per_user is None and plan.augmentation is None
    np.testing.assert_array_equal(plan.arrays[0], x[:30])  # the split's tail is validation
    np.testing.assert_array_equal(np.asarray(plan.validation_data[0]), x[30:])
    assert plan.steps_per_epoch is None and plan.planned_steps == 2 * 4  # ceil(30 / 8) a epoch
    assert model._physical_batch_size == 4  # the step's chunking, set by the plan
    assert [type(c).__name__ for c in plan.callbacks] == ["ProvenanceWatch"]
    assert model.privacy.steps == 0 and int(model.optimizer.iterations) == 0  # nothing drawn


def test_user_level_units_are_people():
    model = compiled()
    x, y = data(40)
    plan = plan_fit(model, x, y, batch_size=4, user_ids=np.arange(40) // 4, examples_per_user=2)
    assert (plan.num_examples, plan.unit, plan.examples_per_user) == (10, "people", 2)
    assert model._examples_per_user == 2


def test_steps_per_execution_rounds_the_epoch_the_noise_is_planned_for():
    model = compiled(steps_per_execution=8)
    x, y = data(40)
    plan = plan_fit(model, x, y, batch_size=4, epochs=3)  # 10 steps a epoch -> 16
    assert (plan.steps_per_epoch, plan.planned_steps) == (16, 48)


def test_a_target_epsilon_sets_sigma_for_the_planned_steps_and_leaves_it_open():
    model = compiled(target_epsilon=3.0, target_delta=1e-5)
    x, y = data(40)
    assert model.optimizer.noise_multiplier is None
    plan_fit(model, x, y, batch_size=4, verbose=0)
    assert model.optimizer.noise_multiplier > 0
    assert "noise_multiplier" not in model.optimizer.__dict__["_assigned_settings"]


def test_an_uncompiled_model_is_refused_first_with_the_message():
    # Keras gives an uncompiled model no `optimizer` attribute: fit raised
    # AttributeError ("no attribute 'optimizer'") instead of saying to compile.
    model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="Compile the model with a tfdp optimizer before"):
        model.fit(*data(40), batch_size=0)  # the batch size would be refused later


@pytest.mark.parametrize("arguments, message", [
    # The validation split is checked before the batch size, the batch size
    # before its chunking: the first refusal in the plan's order is the one raised.
    (dict(validation_split=1.5, batch_size=0), "Expected `validation_split` in"),
    (dict(batch_size=0, physical_batch_size=-1), "Expected `batch_size` to be an int"),
    (dict(batch_size=41), r"Expected `batch_size` <= the number of training examples \(40\)"),
])
def test_fit_refuses_in_the_plans_order_before_any_draw(monkeypatch, arguments, message):
    model = compiled()
    drawn = []
    monkeypatch.setattr(type(model.optimizer), "make_training_data",
                        lambda *args, **kwargs: drawn.append(args))
    with pytest.raises(ValueError, match=message):
        model.fit(*data(40), verbose=0, **arguments)
    assert not drawn and model.privacy.steps == 0 and int(model.optimizer.iterations) == 0

