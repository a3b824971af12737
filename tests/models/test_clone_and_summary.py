"""`keras.models.clone_model` and `summary()` on tfdp's models.

Keras clones any Sequential as a plain `keras.Sequential`, which would
train without privacy; a DPSequential clones as a DPSequential (as a
DPModel clones as a DPModel). `summary()` counts the model's parameters: the
private step counter (`dp_steps`) is bookkeeping, not one of them.
"""

import re

import keras
import numpy as np
import pytest

import tfdp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def layers():
    frozen = keras.layers.Dense(5, activation="tanh")
    frozen.trainable = False
    return [keras.Input((4,), name="features"), frozen, keras.layers.Dense(3)]


def dp_sgd():
    return tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.1)


def test_clone_model_of_a_dp_sequential_is_a_dp_sequential():
    model = tfdp.DPSequential(layers(), per_example_gradients="vectorized", name="private")
    model.compile(optimizer=dp_sgd(), loss=LOSS)
    clone = keras.models.clone_model(model)

    assert type(clone) is tfdp.DPSequential
    assert clone.name == "private" and clone.per_example_gradients == "vectorized"
    assert clone.layers[0].trainable is False
    assert clone.input_shape == (None, 4)
    assert not any(a is b for a, b in zip(clone.weights, model.weights))  # new weights
    assert clone.compiled and isinstance(clone.optimizer, tfdp.optimizers.DPSGD)
    assert clone.optimizer is not model.optimizer

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.integers(0, 3, 32)
    clone.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert clone.privacy.steps == 4 and model.privacy.steps == 0


def test_clone_model_with_clone_function_and_uncompiled():
    model = tfdp.DPSequential(layers())
    clone = keras.models.clone_model(model, clone_function=lambda layer: layer)  # shares layers
    assert type(clone) is tfdp.DPSequential and not clone.compiled
    assert clone.layers[1] is model.layers[1]


def test_clone_model_of_a_plain_sequential_stays_plain():
    clone = keras.models.clone_model(keras.Sequential(layers()))
    assert type(clone) is keras.Sequential


def test_clone_model_of_a_dp_model_is_a_dp_model():
    inputs = keras.Input((4,))
    model = tfdp.DPModel(inputs, keras.layers.Dense(3)(inputs))
    clone = keras.models.clone_model(model)
    assert isinstance(clone, tfdp.DPModel) and type(clone) is type(model)


def summary_counts(model):
    lines = []
    model.summary(print_fn=lambda line, **kwargs: lines.append(line))
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines))
    return {name: int(count.replace(",", ""))
            for name, count in re.findall(r"(Total|Trainable|Non-trainable) params: ([\d,]+)", text)}


@pytest.mark.parametrize("compiled", [False, True])
def test_summary_counts_the_parameters_of_the_plain_model(compiled):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential(layers())
    plain = keras.Sequential(layers())
    if compiled:
        model.compile(optimizer=dp_sgd(), loss=LOSS)
    weights = list(model.weights)
    assert summary_counts(model) == summary_counts(plain)
    assert summary_counts(model)["Non-trainable"] == 25  # the frozen Dense: 4 * 5 + 5
    assert model.weights == weights  # the step counter is still saved and counted
    assert any(v is model._dp_steps for v in model.non_trainable_weights)
