"""The sensitivity search drives a DPBandMF-compiled model's real step.

DP-BandMF's guarantee needs the same per-step bound as DP-SGD's: one record
moves the clipped sum x_t by at most C (its rows of C x by at most C, since
||c|| = 1). The search runs the model's step without noise, so it measures
that sum, for a model trained in a fixed order from tf.data and for one
trained amplified from arrays, and leaves the secret noise stream (history,
step, groups) as it was. Negative control: the same model with clipping
skipped is caught.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.auditing import SensitivityExceeded, sensitivity_search

TOLERANCE = 1e-5
CLIP = 0.01  # below every real record's gradient norm: clipping always acts
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dense_model(optimizer):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(16, activation="tanh")(inputs))
    model = tfdp.DPModel(inputs, outputs)
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


def bandmf(cls=tfdp.optimizers.DPBandMF):
    return cls(keras.optimizers.SGD(0.1), l2_norm_clip=CLIP, noise_multiplier=1.0, bands=4,
               seed=0)


def records(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype("float32"), rng.integers(0, 3, n)


def stream_state(optimizer):
    stream = optimizer._stream
    return (stream.model_step(), [h.numpy().copy() for h in stream.history],
            None if stream.groups_key is None else stream.groups_key.copy())


@pytest.mark.parametrize("mode", ["fixed order", "amplified"])
def test_a_dpbandmf_model_keeps_each_record_within_the_bound(mode):
    x, y = records()
    model = dense_model(bandmf())
    if mode == "fixed order":
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True),
                  epochs=1, verbose=0)
    else:
        model.fit(x, y, batch_size=4, epochs=1, steps_per_epoch=8, verbose=0)
    before = stream_state(model.optimizer)
    ledger = model.privacy.to_json()
    result = sensitivity_search(model, x, y, search_steps=8)
    assert result.worst_ratio <= 1 + TOLERANCE, result.summary()
    assert "DPBandMF" in result.settings
    # the secret stream and the ledger are untouched: training continues as before
    after = stream_state(model.optimizer)
    assert after[0] == before[0] == 8
    assert all(np.array_equal(a, b) for a, b in zip(after[1], before[1]))
    assert (after[2] is None) == (mode == "fixed order")
    assert after[2] is None or np.array_equal(after[2], before[2])
    assert model.privacy.to_json() == ledger


def test_an_untrained_dpbandmf_model_is_measured_too():
    x, y = records()
    model = dense_model(bandmf())
    result = sensitivity_search(model, x, y, search_steps=4)
    assert result.worst_ratio <= 1 + TOLERANCE, result.summary()
    assert model.optimizer._stream is None  # the search starts no stream


class _SkipsClipping(tfdp.optimizers.DPBandMF):
    """A broken DPBandMF: sums gradients without clipping them."""

    def clipped_sum(self, per_example, step_info):
        ones = tf.ones_like(step_info["mask"]) * step_info["mask"]
        return per_example.weighted_sum(ones), {"nonfinite_examples": tf.constant(0.0)}


def test_negative_control_a_dpbandmf_that_skips_clipping_is_caught():
    x, y = records()
    model = dense_model(bandmf(_SkipsClipping))
    result = sensitivity_search(model, x, y, search_steps=4)
    # Hundreds of times the bound (weighted_sum still takes flushed-to-zero
    # errors from the weights it is given, so extreme records move it less
    # than the 1e3 they did before that).
    assert result.worst_ratio > 1e2, result.summary()
    with pytest.raises(SensitivityExceeded, match="times the bound"):
        result.check(TOLERANCE)
