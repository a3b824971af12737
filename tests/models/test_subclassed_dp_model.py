"""A subclassed `tfdp.DPModel` works before and after functional ones.

Keras's `Model.__init__` rewrites the bases of a class built with
`(inputs, outputs)` for the rest of the process (`inject_functional_model_class`);
`tfdp.DPModel` must never be that class, else every later subclass breaks.
"""

import keras
import numpy as np
import pytest
from keras.src.models.functional import Functional

import tfdp


class TwoLayer(tfdp.DPModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def _functional():
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs))
    return tfdp.DPModel(inputs, outputs)


def _fit(model, steps=2):
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = np.arange(32) % 3
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=steps, verbose=0)
    return model


def test_functional_then_subclassed_then_functional_all_train():
    functional = _fit(_functional())
    subclassed = _fit(TwoLayer())
    again = _fit(_functional())
    assert isinstance(functional, tfdp.DPModel) and isinstance(functional, Functional)
    assert isinstance(subclassed, tfdp.DPModel) and not isinstance(subclassed, Functional)
    assert isinstance(again, Functional)
    assert subclassed.privacy.steps == 2 and functional.privacy.steps == 2


def test_dp_model_itself_never_becomes_functional():
    _functional()
    assert not issubclass(tfdp.DPModel, Functional)
    assert not issubclass(TwoLayer, Functional)


def test_subclassed_model_takes_the_vectorized_path():
    model = TwoLayer()
    model(np.zeros((1, 4), "float32"))
    assert "vectorized" in model.per_example_path


def test_subclass_built_functionally_does_not_rewrite_dp_model():
    class Named(tfdp.DPModel):
        pass

    inputs = keras.Input((4,))
    model = Named(inputs, keras.layers.Dense(2)(inputs))
    assert isinstance(model, Named) and isinstance(model, Functional)
    assert not issubclass(tfdp.DPModel, Functional)
    _fit(TwoLayer(), steps=1)


def test_functional_dp_model_saves_under_its_registered_name(tmp_path):
    model = _fit(_functional(), steps=1)
    assert keras.saving.get_registered_name(type(model)) == "tfdp>DPModel"
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, tfdp.DPModel) and loaded.privacy.steps == 1


def test_a_functional_dp_model_reads_as_dp_model():
    model = _functional()
    assert type(model).__name__ == "DPModel" and model.name.startswith("dp_model")
    assert repr(model).startswith("<DPModel name=dp_model")
