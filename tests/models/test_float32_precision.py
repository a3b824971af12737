"""A DP fit on a GPU computes float32 in full precision: no TensorFloat-32.

On an H100 with TensorFlow's default TF32, per-example squared norms
differed from their references by up to 3.7e-4 relative (README, "On a
GPU"): where a norm comes out low, a clipped gradient's true norm passes
the clip norm the accountant charges for. These tests run on CPU with the device
types replaced; the negative control shows nothing changes without a GPU.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.models import float32_precision


@pytest.fixture
def tf32_on():
    before = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(True)
    yield
    tf.config.experimental.enable_tensor_float_32_execution(before)


def _fit_on(monkeypatch, device_types):
    monkeypatch.setattr(float32_precision, "present_device_types", lambda: device_types)
    inputs = keras.Input((4,))
    model = tfdp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    model.fit(x, np.arange(64) % 2, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)
    return model


def test_a_dp_fit_on_a_gpu_turns_tensor_float_32_off_and_says_so(monkeypatch, tf32_on, caplog):
    with caplog.at_level(logging.WARNING, logger="tfdp"):
        model = _fit_on(monkeypatch, ["CPU", "GPU"])
    assert not tf.config.experimental.tensor_float_32_execution_enabled()
    assert model.privacy.steps == 2
    assert any("TensorFloat-32" in record.getMessage() for record in caplog.records)


def test_it_is_turned_off_again_when_a_user_turns_it_back_on_between_fits(monkeypatch, tf32_on):
    model = _fit_on(monkeypatch, ["CPU", "GPU"])
    tf.config.experimental.enable_tensor_float_32_execution(True)
    model.fit(np.zeros((64, 4), "float32"), np.zeros(64), batch_size=16, epochs=1,
              steps_per_epoch=1, verbose=0)
    assert not tf.config.experimental.tensor_float_32_execution_enabled()


def test_without_a_gpu_the_setting_is_left_alone(monkeypatch, tf32_on, caplog):
    with caplog.at_level(logging.WARNING, logger="tfdp"):
        _fit_on(monkeypatch, ["CPU"])
    assert tf.config.experimental.tensor_float_32_execution_enabled()
    assert not any("TensorFloat-32" in record.getMessage() for record in caplog.records)


def test_the_helper_reports_whether_it_changed_the_setting(tf32_on):
    assert float32_precision.keep_float32_exact(["CPU", "GPU"]) is True
    assert float32_precision.keep_float32_exact(["CPU", "GPU"]) is False  # already off
    tf.config.experimental.enable_tensor_float_32_execution(True)
    assert float32_precision.keep_float32_exact(["CPU"]) is False
    assert tf.config.experimental.tensor_float_32_execution_enabled()
