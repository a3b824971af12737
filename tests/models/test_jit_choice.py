"""jit_compile="auto": the measured, device-aware choice (tfdp.models.jit)."""

import keras
import numpy as np
import pytest

import tfdp
from tfdp.models import jit
from tfdp.models.jit import resolve_jit_compile


def test_auto_is_false_on_cpu_where_xla_measured_slower():
    assert resolve_jit_compile("auto", device_types=["CPU"]) is False


def test_auto_is_xla_on_a_gpu_where_xla_measured_faster():
    # benchmarks/results/throughput_gpu_h100.md: XLA's DP fit 1.02x-1.79x on an H100.
    assert resolve_jit_compile("auto", device_types=["CPU", "GPU"]) is True


def test_auto_follows_the_measurement_of_the_accelerator_present(monkeypatch):
    monkeypatch.setitem(jit.MEASURED_XLA_FASTER, "TPU", True)
    assert resolve_jit_compile("auto", device_types=["CPU", "TPU"]) is True
    assert resolve_jit_compile("auto", device_types=["CPU"]) is False  # the CPU's own measurement
    monkeypatch.delitem(jit.MEASURED_XLA_FASTER, "TPU")
    assert resolve_jit_compile("auto", device_types=["CPU", "TPU"]) is False  # never measured


class NoXLA(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False

    def call(self, x):
        return x


def test_auto_stays_off_for_a_layer_xla_cannot_compile_and_for_an_eager_run():
    inputs = keras.Input((4,))
    plain = tfdp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    assert resolve_jit_compile("auto", device_types=["CPU", "GPU"], model=plain) is True
    blocked = tfdp.DPModel(inputs, keras.layers.Dense(2)(NoXLA()(inputs)))
    assert resolve_jit_compile("auto", device_types=["CPU", "GPU"], model=blocked) is False
    assert resolve_jit_compile("auto", device_types=["CPU", "GPU"], run_eagerly=True) is False


def test_explicit_choices_pass_through_and_bad_values_are_refused():
    assert resolve_jit_compile(True, device_types=["CPU"]) is True
    assert resolve_jit_compile(False, device_types=["CPU", "GPU"]) is False
    with pytest.raises(ValueError, match="jit_compile='yes'"):
        resolve_jit_compile("yes")


def _model():
    inputs = keras.Input((4,))
    return tfdp.DPModel(inputs, keras.layers.Dense(2)(inputs))


def test_compile_resolves_auto_and_keeps_an_explicit_xla_request():
    optimizer = tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = _model()
    model.compile(optimizer=optimizer, loss=loss)
    assert model.jit_compile is False
    xla = _model()
    xla.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
                loss=loss, jit_compile=True)
    assert xla.jit_compile is True
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = np.arange(64) % 2
    xla.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)  # the XLA path runs on CPU
    assert xla.privacy.steps == 2
