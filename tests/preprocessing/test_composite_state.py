"""A composite adaptable layer is fingerprinted at every depth (review 7, F9).

A layer with `adapt()` holding a `keras.Sequential` that holds a
`StringLookup`: the lookup, two levels down, is part of the layer's state.
Adapting it again on the raw data after the layer was declared public is
refused by `fit`'s check.
"""

import keras
import numpy as np
import pytest

import tfdp
from tfdp import preprocessing

CANARY = "zqxjcanary"


class Featurizer(keras.layers.Layer):
    """A preprocessing block with an adapt() method, holding a small Sequential."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = keras.Sequential([keras.layers.StringLookup(
            output_mode="one_hot", max_tokens=8, pad_to_max_tokens=True, name="inner_lookup")],
            name="block")

    @property
    def lookup(self):
        return self.block.layers[0]

    def adapt(self, data):
        self.lookup.adapt(data)

    def call(self, x):
        return self.block(x)


def model_of(featurizer):
    inputs = keras.Input((1,), dtype="string")
    return tfdp.DPModel(inputs, keras.layers.Dense(2)(featurizer(inputs)))


@pytest.mark.parametrize("readapt", [True, False])
def test_a_lookup_two_levels_down_adapted_again_is_refused(readapt):
    featurizer = Featurizer(name="featurizer")
    featurizer.adapt(np.array(["red", "green", "blue"]))
    preprocessing.declare_public(featurizer, source="the public colour list")
    if readapt:
        featurizer.lookup.adapt(np.array(["red"] * 10 + [CANARY]))
    model = model_of(featurizer)
    if not readapt:  # negative control: the declared state is accepted
        preprocessing.check_model(model)
        return
    with pytest.raises(ValueError, match="'featurizer'.*changed after it was declared") as caught:
        preprocessing.check_model(model)
    assert CANARY not in str(caught.value)
