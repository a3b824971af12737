"""Multi-input models: `x` as a list, tuple or dict trains privately."""

import keras
import numpy as np
import pytest

import tfdp

L = keras.layers


def two_input_model():
    numeric = keras.Input((3,), name="numeric")
    categorical = keras.Input((2,), dtype="int32", name="categorical")
    embedded = L.Flatten()(L.Embedding(5, 2)(categorical))
    hidden = L.Concatenate()([L.Dense(3)(numeric), embedded])
    model = tfdp.DPModel([numeric, categorical], L.Dense(2)(hidden))
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@pytest.mark.parametrize("form", ["list", "tuple", "dict"])
def test_fit_takes_several_inputs(form):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    numeric = rng.normal(size=(64, 3)).astype("float32")
    categorical = rng.integers(0, 5, (64, 2))
    x = {
        "list": [numeric, categorical],
        "tuple": (numeric, categorical),
        "dict": {"numeric": numeric, "categorical": categorical},
    }[form]
    model = two_input_model()
    before = [v.numpy().copy() for v in model.trainable_variables]
    history = model.fit(x, rng.integers(0, 2, 64), batch_size=16, epochs=1, verbose=0)
    assert model.privacy.steps == 4
    assert np.isfinite(history.history["loss"][0])
    assert all(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))
    assert "batched" in model.per_example_path
