"""`examples_per_user` beyond the largest user's record count is refused
before the first step, naming the argument (issue 44, item 9): k = 10**9
failed with an out-of-memory error from the input pipeline that did not
name it, after a step was charged."""

import keras
import numpy as np
import pytest

import tfdp


def fit(k):
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(6), [1, 2, 3, 3, 4, 5])  # at most 5 records a user
    x = rng.normal(size=(len(ids), 4)).astype("float32")
    y = rng.integers(0, 3, size=len(ids))
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, user_ids=ids, examples_per_user=k, batch_size=2, steps_per_epoch=2,
              verbose=0)
    return model


@pytest.mark.parametrize("k", [6, 10**9])
def test_examples_per_user_above_the_largest_user_is_refused_before_a_step(k):
    with pytest.raises(ValueError, match=r"Expected `examples_per_user` <= 5, the largest number "
                                         rf".*median, 3 here.*Received: examples_per_user={k}"):
        fit(k)


def test_examples_per_user_up_to_the_largest_user_trains():
    model = fit(5)
    assert model.privacy.steps == 2
    assert model.optimizer.iterations.numpy() == 2


def test_a_refused_fit_charges_nothing():
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(4), 2)
    x, y = rng.normal(size=(8, 4)).astype("float32"), np.zeros(8, "int64")
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="examples_per_user"):
        model.fit(x, y, user_ids=ids, examples_per_user=10**9, batch_size=2, verbose=0)
    assert model.privacy.steps == 0 and model.optimizer.iterations.numpy() == 0
