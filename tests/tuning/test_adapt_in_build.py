"""`adapt_privately` inside a private search's build(hp) is refused.

Each trial would adapt the layer again on the private data (its own noise
and threshold) while the chosen model's ledger counts one of them. The
crafted record's unique id, 99950, must not appear in the refusal.
"""

import keras
import numpy as np
import pytest

import tfdp
from tfdp import preprocessing

UNIQUE = 99950


def private_ids(n=400, seed=0):
    ids = np.random.default_rng(seed).integers(1, 10, size=n - 1)
    return np.append(ids, UNIQUE)


def build(hp):
    lookup = keras.layers.IntegerLookup(name="lookup", output_mode="one_hot", max_tokens=12,
                                        pad_to_max_tokens=True)
    preprocessing.adapt_privately(lookup, private_ids(), epsilon=1.0, delta=2e-6, seed=0)
    inputs = keras.Input((1,), dtype="int64")
    model = tfdp.DPModel(inputs, keras.layers.Dense(2)(lookup(inputs)))
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(hp.Float("learning_rate", 0.1, 1.0, sampling="log"),
                                        l2_norm_clip=1.0, noise_multiplier=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_an_adaptation_inside_build_is_refused_before_any_trial_trains():
    tuning = pytest.importorskip("tfdp.tuning")
    ids = private_ids()
    tuner = tuning.PrivateRandomSearch(build, mean_trials=4, distribution="geometric")
    with pytest.raises(ValueError, match="inside a private search's build") as caught:
        tuner.search(ids[:, None], (ids % 2).astype("int32"), batch_size=40, epochs=1,
                     validation_split=0.2)
    message = str(caught.value)
    assert "Adapt the layer once, outside build(hp)" in message and str(UNIQUE) not in message


def test_the_same_adaptation_outside_a_search_is_accepted():
    build(__import__("keras_tuner").HyperParameters())  # no search: adapt_privately runs
