"""Clear errors before any draw or step (issue 55, item 4).

- `augmentations` beyond what a step can hold: refused with the arithmetic
  (10**6 ran 15 minutes to 7 GB);
- an `augment` drawing Python or NumPy random numbers: traced once, every
  copy of every step was identical; refused, as stateful TF randomness is;
- messages name the argument the user gave: `target_delta`, and the
  optimizer's `target_epsilon` with steps_per_execution > 1 (not a
  PrivacyBudget the user never added);
- DP-BandMF on `dataset.batch(8)` without drop_remainder names the last,
  smaller batch and drop_remainder=True.
(The search's empty validation_data: tests/tuning/test_private_search.py.)
"""

import random

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.models.augmentation import check_augmentation

RNG = np.random.default_rng(0)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(n=60):
    x = np.random.default_rng(0).normal(size=(n, 6)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def model(optimizer=None, **compile_kwargs):
    built = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
    built.compile(optimizer=optimizer or tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0),
                  loss=LOSS, **compile_kwargs)
    return built


def refused(match, fit_kwargs, **model_kwargs):
    built = model(**model_kwargs)
    with pytest.raises(ValueError, match=match):
        built.fit(*data(), verbose=0, **fit_kwargs)
    assert built.privacy.steps == 0
    return built


def flip(x, seed):
    return tf.where(tf.random.stateless_uniform([], seed) < 0.5, -x, x)


def test_too_many_augmentations_are_refused_with_the_arithmetic():
    refused(r"augmentations` <= 1024.*here 10 examples x 1,000,000 copies = 10,000,000 "
            r"forward and backward passes.*Received: augmentations=1000000",
            dict(batch_size=10, augment=flip, augmentations=10**6))
    optimizer = tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0)  # the cap itself is allowed
    assert check_augmentation(flip, 1024, data()[0][:1], optimizer, rows=10).copies == 1024


class Jitter:
    """A callable whose Python randomness the bytecode check cannot see: the
    second trace's constants differ from the first's."""

    def __call__(self, x, seed):
        return x + float(np.random.uniform())


def numpy_global(x, seed):
    return x + np.random.uniform()


def python_random(x, seed):
    return x * random.random()


def a_generator(x, seed):
    return x + RNG.normal()


@pytest.mark.parametrize("augment, match", [
    (numpy_global, "using np.random"),
    (python_random, "using random"),
    (a_generator, "using a numpy.random._generator.Generator"),
    (lambda x, seed: x + np.random.default_rng().normal(), "using np.random"),
    (Jitter(), "other constants when traced twice"),
])
def test_python_or_numpy_randomness_in_augment_is_refused(augment, match):
    refused(f"(?s)augment.*{match}", dict(batch_size=10, augment=augment, augmentations=2))


def test_stateless_tf_randomness_with_numpy_constants_is_accepted():
    def flip_scaled(x, seed):  # numpy, but no numpy randomness
        return flip(x, seed) * np.float32(2.0)

    built = model()
    built.fit(*data(), batch_size=10, steps_per_epoch=1, augment=flip_scaled, augmentations=2,
              verbose=0)
    assert built.privacy.steps == 1


def test_target_delta_is_named_as_given():
    with pytest.raises(ValueError, match=r"`target_delta`.*Received: target_delta=2"):
        tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, target_epsilon=3.0, target_delta=2.0)


def test_a_target_epsilon_with_several_steps_per_execution_names_the_target():
    built = model(tfdp.optimizers.DPSGD(0.1, target_epsilon=3.0, target_delta=1e-5),
                  steps_per_execution=2)
    with pytest.raises(ValueError) as error:
        built.fit(*data(), batch_size=10, epochs=1, verbose=0)
    message = str(error.value)
    assert "target_epsilon=3" in message and "steps_per_execution=1" in message
    assert "PrivacyBudget" not in message


def test_bandmf_on_batches_with_a_smaller_last_one_names_it():
    x, y = data(60)  # 7 batches of 8 and one of 4
    built = model(tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.5), 1.0, 1.0, bands=4))
    with pytest.raises(ValueError, match=r"the last, smaller batch.*drop_remainder=True"):
        built.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0)
    assert built.privacy.steps == 0
