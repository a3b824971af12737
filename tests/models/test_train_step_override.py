"""A DPModel subclass with its own train_step is refused before any release.

Issue 34: a subclass mixing each record with its neighbour in the batch
(mixup with tf.roll) trained with sensitivity 2.55 C and no warning, while
the ledger charged a step of sensitivity C.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tests.noiseless import NoiselessDPSGD


class MixupDPSequential(tfdp.DPSequential):
    """Mixes every record with the next one in the batch: not private."""

    def train_step(self, data):
        arrays, step_info = data
        x = 0.5 * arrays[0] + 0.5 * tf.roll(arrays[0], 1, 0)
        return super().train_step(((x,) + tuple(arrays[1:]), step_info))


class CountingDPSequential(tfdp.DPSequential):
    """Wraps the DP step unchanged and says so."""

    train_step_is_private = True
    calls = 0

    def train_step(self, data):
        type(self).calls += 1
        return super().train_step(data)


def build(cls, loss=None):
    model = cls([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=NoiselessDPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def linear_loss(y_true, y_pred):
    """-y . prediction: a record's kernel gradient is -x y^T whatever the weights."""
    return -tf.reduce_sum(y_true * y_pred, axis=-1)


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 4)).astype(np.float32), rng.integers(0, 2, 16)


def test_an_overridden_train_step_is_refused_before_the_first_step():
    model = build(MixupDPSequential)
    weights = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"MixupDPSequential overrides train_step\(\)") as error:
        model.fit(*data(), batch_size=8, epochs=1, verbose=0)
    assert "train_step_is_private = True" in str(error.value)
    assert "Received: a MixupDPSequential with its own train_step" in str(error.value)
    assert model.privacy.steps == 0 and model.privacy.epsilon(1e-5) == 0.0
    assert model.privacy.composed_event().events == []  # no step event was opened
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)


def replace_one_ratio(cls):
    """||update(D) - update(D')|| over DP-SGD's bound 2 C / b, for D and D'
    differing in record 1 (crafted: norm 100, opposite signs, every gradient
    clipped), noise 0, q = 1, plain SGD with learning rate 1."""
    a = np.array([0.1, 0.2, 0.0, 0.0], np.float32)
    b = np.array([100.0, 0.0, 50.0, 0.0], np.float32)
    y = np.array([[1.0, 0.0], [1.0, 0.0]], np.float32)

    def update(x):
        keras.utils.set_random_seed(0)  # the same initial weights in both runs
        model = build(cls, loss=linear_loss)
        before = model.layers[-1].kernel.numpy().copy()
        model.fit(x, y, batch_size=2, epochs=1, steps_per_epoch=1, verbose=0)
        return model.layers[-1].kernel.numpy() - before

    change = update(np.stack([a, b])) - update(np.stack([a, -b]))
    return float(np.linalg.norm(change)) / (2 * 1.0 / 2)


def test_the_refused_override_really_breaks_the_bound():
    """Why it is refused: declared private by mistake, the mixup step lets one
    replaced record move the update by more than DP-SGD's bound (both rows of
    the batch carry it); tfdp's own step stays within it."""
    mixing = type("DeclaredMixup", (MixupDPSequential,), {"train_step_is_private": True})
    assert replace_one_ratio(mixing) > 1.5
    assert replace_one_ratio(tfdp.DPSequential) <= 1 + 1e-5


def test_a_declared_wrapper_trains():
    model = build(CountingDPSequential)
    before = CountingDPSequential.calls
    model.fit(*data(), batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 2 and CountingDPSequential.calls > before
