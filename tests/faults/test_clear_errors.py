"""Settings and inputs that used to fail late, obscurely or silently
(issue 25, item 7): each is refused before the first step by an error that
names the argument and the value received."""

import math

import keras
import numpy as np
import pytest

import tfdp


def _model(units=3, trainable=True):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(units)])
    model.layers[0].trainable = trainable
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


X = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
Y = np.arange(40) % 3


def _fit(model, x=X, y=Y, **kwargs):
    return model.fit(x, y, batch_size=8, epochs=1, verbose=0, **kwargs)


@pytest.mark.parametrize("make, match", [
    (lambda: tfdp.optimizers.DPSGD(l2_norm_clip=1e308), r"l2_norm_clip.*overflows float32"),
    (lambda: tfdp.optimizers.DPSGD(l2_norm_clip=1e20, noise_multiplier=1e20),
     r"noise_multiplier \* l2_norm_clip.*overflows float32"),
    (lambda: tfdp.optimizers.DPSGD(momentum=math.nan), r"momentum.*Received: momentum=nan"),
    (lambda: tfdp.optimizers.DPOptimizer(keras.optimizers.Adam(beta_1=math.inf), 1.0, 1.0),
     r"beta_1.*Received: beta_1=inf"),
    (lambda: tfdp.optimizers.DPSGD(seed=-5), r"seed.*Received: seed=-5"),
    (lambda: tfdp.optimizers.AdaDP(0.1, 1.0, 1.0, beta=-1), r"AdaDP got unexpected.*beta=-1"),
])
def test_settings_that_would_destroy_the_model_are_refused(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_a_sane_setting_is_still_accepted():
    """Control for the refusals above."""
    tfdp.optimizers.DPSGD(momentum=0.9, l2_norm_clip=1e6, noise_multiplier=1e6, seed=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(x=[list(row) for row in X[:39]] + [[1.0, 2.0]]), r"`x`.*rows of different lengths"),
    (dict(y=np.array(["cat", "dog"] * 20)), r"numeric labels.*dtype text"),
    (dict(y=(np.arange(40) % 5).astype(np.float32)), r"class indices in \[0, 2\].*16 label\(s\) outside that range"),
    (dict(class_weight={0: 1.0, 1: 2.0}), r"class_weight.*classes \[2\].*keys \[0, 1\]"),
    (dict(sample_weight=np.ones((40, 2))), r"sample_weight.*shape \(40, 2\)"),
    (dict(validation_data=(X[:10], Y[:9])), r"validation_data.*lengths \[10, 9\]"),
])
def test_bad_inputs_are_named_before_the_first_step(kwargs, match):
    model = _model()
    with pytest.raises(ValueError, match=match):
        _fit(model, **kwargs)
    assert model.privacy.epsilon(1e-5) == 0.0  # no budget spent


def test_a_python_list_x_trains_like_an_array():
    model = _model()
    _fit(model, x=X.tolist(), y=Y.tolist(), steps_per_epoch=2)
    assert model.privacy.epsilon(1e-5) > 0


def test_a_model_without_trainable_weights_is_named():
    model = _model(trainable=False)
    with pytest.raises(ValueError, match="no trainable weights.*Received: 0 trainable"):
        _fit(model)


def test_an_all_nan_batch_does_not_log_a_perfect_loss():
    model = _model()
    history = _fit(model, x=np.full_like(X, np.nan), steps_per_epoch=2)
    assert math.isnan(history.history["loss"][0])
    assert history.history["nonfinite_examples"][0] > 0
