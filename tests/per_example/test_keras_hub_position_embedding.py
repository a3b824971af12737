"""KerasHub's PositionEmbedding rule on its two untested claims (issue 34,
item 7): rows at positions `start_index + t`, and inputs of rank > 3, whose
rows broadcast over the middle axes (their gradients summed over them). Each
against one example at a time; a wrong start_index or an unsummed middle axis
gives other rows or other sums."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.per_example import hub_models

keras_hub = hub_models.import_keras_hub()

import tfdp  # noqa: E402


def _model(input_shape, **call_kwargs):
    inputs = keras.Input(input_shape)
    positions = keras_hub.layers.PositionEmbedding(sequence_length=9)(inputs, **call_kwargs)
    h = keras.layers.Flatten()(keras.layers.Dense(3)(inputs + positions))
    return tfdp.DPModel(inputs, keras.layers.Dense(2)(h))


@pytest.mark.parametrize("input_shape, call_kwargs", [
    ((4, 3), dict(start_index=3)),           # rows 3..6 of 9
    ((2, 4, 3), {}),                          # [B, 2, S, D]: rows shared by the middle axis
    ((2, 3, 4, 3), dict(start_index=5)),      # both at once, rank 5
], ids=["start_index", "rank4", "rank5_start_index"])
def test_position_rows_match_one_example_at_a_time(input_shape, call_kwargs, check_batched_pass):
    keras.utils.set_random_seed(3)
    model = _model(input_shape, **call_kwargs)
    rng = np.random.default_rng(4)
    x = tf.constant(rng.normal(size=(5, *input_shape)), tf.float32)
    check_batched_pass(model, x, rng)
