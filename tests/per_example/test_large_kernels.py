"""Large kernels (a language model's vocabulary projection) take ghost norms.

GPT-2's tied 50257 x 128 projection over 128 positions costs about the same
materialized or by Gram matrices, and was materialized: B x 6.4M floats, so
full fine-tuning's memory grew with the vocabulary. Ghost norms hold
2 x 128^2 floats per example and give the same norms and sums.
"""

import numpy as np
import tensorflow as tf

from tfdp.per_example.grads import LinearGrads


def test_a_vocabulary_projection_is_not_materialized():
    kernel = tf.Variable(tf.zeros([128, 50257]))
    grads = LinearGrads(tf.zeros([2, 128, 128]), tf.zeros([2, 128, 50257]), kernel)
    assert grads._ghost
    small = LinearGrads(tf.zeros([2, 128, 64]), tf.zeros([2, 128, 64]), tf.Variable(tf.zeros([64, 64])))
    assert not small._ghost  # control: small kernels keep the cheaper materialized path


def test_ghost_norms_and_sums_of_a_large_kernel_match_the_materialized_ones():
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(3, 16, 64)).astype(np.float32))
    g = tf.constant(rng.normal(size=(3, 16, 20000)).astype(np.float32) * 1e-2)
    kernel = tf.Variable(tf.zeros([64, 20000]))
    grads = LinearGrads(x, g, kernel)
    assert grads._ghost
    per_example = np.einsum("bsk,bso->bko", x.numpy(), g.numpy())
    np.testing.assert_allclose(grads.sq_norms().numpy(), (per_example**2).sum((1, 2)), rtol=1e-4)
    weights = np.array([0.5, 0.0, -2.0], np.float32)
    np.testing.assert_allclose(grads.weighted_sum(tf.constant(weights))[0].numpy(),
                               np.tensordot(weights, per_example, axes=1), rtol=1e-4, atol=1e-6)
