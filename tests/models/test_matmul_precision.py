"""Grappler's automatic mixed precision rewrites float32 matmuls to bfloat16
or float16 outside the clipping bounds: a DP fit refuses it before the first
step (a review measured a crafted record moving the clipped sum 1.56 times
the clip norm with `auto_mixed_precision_onednn_bfloat16` on)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp


def small_model():
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("option", ["auto_mixed_precision_onednn_bfloat16",
                                    "auto_mixed_precision_mkl", "auto_mixed_precision"])
def test_a_dp_fit_refuses_grapplers_mixed_precision_rewrite(option):
    model = small_model()
    x, y = np.ones((16, 4), "float32"), np.zeros(16, "int32")
    tf.config.optimizer.set_experimental_options({option: True})
    try:
        with pytest.raises(ValueError, match=f"automatic mixed precision.*{option}=True"):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    finally:
        tf.config.optimizer.set_experimental_options({option: False})
    assert model.privacy.steps == 0
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # negative control: switched off
    assert model.privacy.steps > 0


def test_the_sensitivity_search_refuses_it_as_fit_does():
    """The search's neighbour step traces the model's train step outside fit:
    under the rewrite it measured a crafted record at 1.56 times the bound
    (review of the float32 Gram norms), a breach of the rewrite, not of the step."""
    model = small_model()
    x, y = np.ones((16, 4), "float32"), np.zeros(16, "int32")
    option = "auto_mixed_precision_onednn_bfloat16"
    tf.config.optimizer.set_experimental_options({option: True})
    try:
        with pytest.raises(ValueError, match=f"automatic mixed precision.*{option}=True"):
            tfdp.auditing.sensitivity_search(model, x, y, search_steps=1)
    finally:
        tf.config.optimizer.set_experimental_options({option: False})
