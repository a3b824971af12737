"""A seeded adaptation is named as such in the statement (review 7, F13).

A known seed makes the adaptation's noise known: the released state gives
the exact counts back. The statement says the adaptation was seeded.
"""

import keras
import numpy as np
import pytest

import tfdp
from tfdp import preprocessing

IDS = np.repeat(np.arange(1, 21), 30)


def statement_after_adapting(**seed):
    lookup = keras.layers.IntegerLookup(name="item")
    preprocessing.adapt_privately(lookup, IDS, epsilon=2.0, delta=1e-7, **seed)
    inputs = keras.Input((1,), dtype="int64")
    model = tfdp.DPModel(inputs, keras.layers.Dense(2)(lookup(inputs)))
    return " ".join(model.privacy.statement(1e-5).split())


@pytest.mark.parametrize("seed, named", [({"seed": 0}, True), ({}, False)])
def test_the_statement_names_a_seeded_adaptation(seed, named):
    statement = statement_after_adapting(**seed)
    assert "adapted privately" in statement
    assert ("Seeded (seed= given)" in statement) is named
    assert ("private only while the seed stays secret" in statement) is named
