"""Preprocessing layers named by fit(augment=fn) are checked like the model's own.

Crafted record: one record's features are 1e4. A Normalization adapted on
the records with Keras's `adapt` carries it in its mean and shifts every
other record's augmented input; a fit whose augment function calls it is
refused before any step. Adapted privately, it is accepted and charged.
"""

import keras
import numpy as np
import pytest

import tfdp
from tfdp import preprocessing

X = np.random.default_rng(0).normal(size=(200, 3)).astype("float32")
X[-1] = 1e4  # the crafted record
Y = (X[:, 0] > 0).astype("int32")


def model():
    dense = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
    dense.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return dense


def fit(trained, augment):
    trained.fit(X, Y, batch_size=20, epochs=1, steps_per_epoch=2, verbose=0, augment=augment)


def test_a_normalization_adapted_on_the_records_in_augment_is_refused():
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(X)

    def augment(example, seed):
        return norm(example[None])[0]

    trained = model()
    with pytest.raises(ValueError, match=r"'norm' \(Normalization\).*adapt_privately") as caught:
        fit(trained, augment)
    assert "10000" not in str(caught.value) and "1e+04" not in str(caught.value)
    assert trained.privacy.steps == 0


def test_a_normalization_adapted_privately_in_augment_is_accepted_and_charged():
    norm = keras.layers.Normalization(name="norm")
    preprocessing.adapt_privately(norm, X, epsilon=1.0, delta=1e-7, value_range=(-5, 5), seed=0)
    layers = {"norm": norm}  # reached through a dict in the closure

    def augment(example, seed):
        return layers["norm"](example[None])[0]

    trained = model()
    fit(trained, augment)
    assert trained.privacy.steps == 2
    assert [e["layer"] for e in trained.privacy.preprocessing] == ["norm"]
