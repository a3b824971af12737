"""Issue 54's first-hour settings: target_epsilon readable, a budget below
the target advised with the target, steps_per_execution epochs that show
what runs, and target_epsilon with steps_per_execution refused in its own
words."""

import keras
import numpy as np
import pytest

import tfdp

X = np.random.default_rng(0).normal(size=(1000, 4)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


def _model(steps_per_execution=1, **noise):
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, **noise),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    return model


def test_target_epsilon_and_delta_are_readable():
    optimizer = tfdp.optimizers.DPSGD(0.1, target_epsilon=3.0, target_delta=1e-5)
    assert (optimizer.target_epsilon, optimizer.target_delta) == (3.0, 1e-5)
    fixed = tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0)
    assert fixed.target_epsilon is None and fixed.target_delta is None


def test_an_epoch_runs_the_steps_it_shows_with_several_steps_per_execution():
    model = _model(steps_per_execution=8, noise_multiplier=1.0)
    history = model.fit(X, Y, batch_size=32, epochs=2, verbose=0)
    # round(1000 / 32) = 31 steps, rounded up to 4 whole calls of 8.
    assert model.privacy.steps == 2 * 32 == 2 * history.params["steps"]


def test_target_epsilon_with_several_steps_per_execution_names_the_target():
    model = _model(steps_per_execution=8, target_epsilon=3.0, target_delta=1e-5)
    with pytest.raises(ValueError, match="target_epsilon=3 is enforced between steps") as error:
        model.fit(X, Y, batch_size=32, epochs=1, verbose=0)
    assert "PrivacyBudget" not in str(error.value)
    assert model.privacy.steps == 0


def test_a_budget_below_the_target_is_advised_with_the_target():
    model = _model(target_epsilon=3.0, target_delta=1e-5)
    budget = tfdp.callbacks.PrivacyBudget(epsilon=1.0, delta=1e-5)
    with pytest.raises(ValueError, match=r"target_epsilon=3 calibrated the noise .* give the "
                                         r"optimizer target_epsilon=1"):
        model.fit(X, Y, batch_size=32, epochs=3, verbose=0, callbacks=[budget])


def test_the_tf_data_refusal_gives_the_batched_conversion():
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((X[:64], Y[:64])).batch(16)
    with pytest.raises(ValueError, match=r"write_records\(dataset, path, batched=True\) for a "
                                         r"batched pipeline"):
        _model(noise_multiplier=1.0).fit(dataset, epochs=1, verbose=0)
