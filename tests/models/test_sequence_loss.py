"""The per-token weighted sequence loss: its mean divides by the weights' sum,
its sum does not divide, and a sequence without weighted tokens has loss 0."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.models.sequence_loss import token_weighted_loss

PROBABILITIES = tf.constant([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]],
                             [[0.3, 0.7], [0.6, 0.4], [0.1, 0.9]]])
LABELS = tf.constant([[1, 0, 1], [0, 0, 1]])
TOKEN_LOSSES = -np.log(np.array([[0.5, 0.9, 0.8], [0.3, 0.6, 0.9]]))
WEIGHTS = np.array([[2.0, 1.0, 0.0], [0.5, 0.25, 3.0]], np.float32)


def _loss(reduction, weights=WEIGHTS):
    fn = token_weighted_loss("sparse_categorical_crossentropy", reduction)
    return fn((LABELS, tf.constant(weights)), PROBABILITIES).numpy()


def test_mean_divides_by_the_sum_of_token_weights():
    want = np.sum(TOKEN_LOSSES * WEIGHTS, 1) / np.sum(WEIGHTS, 1)
    np.testing.assert_allclose(_loss("mean"), want, rtol=1e-6)


def test_sum_does_not_divide():
    np.testing.assert_allclose(_loss("sum"), np.sum(TOKEN_LOSSES * WEIGHTS, 1), rtol=1e-6)


def test_a_sequence_without_weighted_tokens_has_loss_zero():
    weights = WEIGHTS.copy()
    weights[1] = 0.0
    assert _loss("mean", weights)[1] == 0.0 and _loss("sum", weights)[1] == 0.0


def test_an_unknown_reduction_is_refused_by_name():
    with pytest.raises(ValueError, match="reduction='max'"):
        token_weighted_loss("mse", "max")
