"""`fold_key` and `uniform_float64` are TensorFlow's public Philox ops, bit for bit.

Both call one raw op instead of the public wrappers (whose ~15-op key
scramble cost 7 ms to instantiate in every fit's input pipeline), so a
seeded run must still draw exactly what the public ops draw. The reference
`poisson_indices` below is the draw written with the public ops.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfdp.data import sampling

EDGE_KEYS = [[0, 0], [-1, -1], [2**63 - 1, -(2**63)], [1, 2]]


def random_keys(count):
    rng = np.random.default_rng(0)
    return EDGE_KEYS + rng.integers(-(2**63), 2**63 - 1, size=(count, 2), dtype=np.int64).tolist()


def public_fold(key, *data):
    key = tf.constant(key, tf.int64)
    for value in data:
        key = tf.random.experimental.stateless_fold_in(key, tf.constant(value, tf.int64),
                                                     alg="philox")
    return key.numpy()


def test_fold_key_is_public_philox_fold_in():
    for key in random_keys(60):
        for data in [(0,), (1,), (2**62,), (-5,), (7, 3), (10**12, 0, 1)]:
            np.testing.assert_array_equal(sampling.fold_key(key, *data).numpy(),
                                          public_fold(key, *data), err_msg=f"{key} {data}")


def test_fold_key_in_a_graph_is_the_eager_fold():
    fold = tf.function(lambda key, value: sampling.fold_key(key, value))
    for key in random_keys(10):
        np.testing.assert_array_equal(fold(tf.constant(key, tf.int64), tf.constant(9, tf.int64)),
                                      public_fold(key, 9))


def test_negative_control_the_comparison_sees_another_fold():
    key = random_keys(0)[3]
    assert not np.array_equal(sampling.fold_key(key, 1).numpy(), public_fold(key, 2))
    assert not np.array_equal(sampling.fold_key(key, 1).numpy(), public_fold([1, 3], 1))
    assert not np.array_equal(sampling.fold_key(key, 1, 2).numpy(), public_fold(key, 2, 1))


@pytest.mark.parametrize("size", [0, 1, 37, 1000])
def test_uniform_float64_is_public_philox_uniform(size):
    for key in random_keys(20):
        public = tf.random.stateless_uniform([size], seed=key, dtype=tf.float64, alg="philox")
        np.testing.assert_array_equal(sampling.uniform_float64([size], key).numpy(), public)
    dynamic = tf.function(lambda shape, key: sampling.uniform_float64(shape, key))
    key = tf.constant(random_keys(0)[3], tf.int64)
    np.testing.assert_array_equal(
        dynamic(tf.constant([size], tf.int64), key),
        tf.random.stateless_uniform([size], seed=key, dtype=tf.float64, alg="philox"))


def public_poisson_indices(key, n, q):
    """`poisson_indices` written with TensorFlow's public stateless ops."""
    def fold(key, value):
        return tf.random.experimental.stateless_fold_in(key, tf.constant(value, tf.int64),
                                                        alg="philox")
    key = tf.constant(key, tf.int64)
    uniform = tf.random.stateless_uniform([sampling.chunk_size(q * n)], seed=fold(key, 0),
                                          dtype=tf.float64, alg="philox")
    gaps = tf.floor(tf.math.log1p(-uniform) / math.log1p(-q)) + 1.0
    walked = tf.cumsum(tf.cast(tf.minimum(gaps, float(n + 1)), tf.int64)) - 1
    last = walked[-1]
    tail = tf.random.stateless_uniform(tf.reshape(tf.maximum(n - 1 - last, 0), [1]),
                                       seed=fold(key, 1), dtype=tf.float64, alg="philox")
    rest = last + 1 + tf.where(tail < q)[:, 0]
    return tf.concat([tf.boolean_mask(walked, walked < n), rest], axis=0).numpy()


@pytest.mark.parametrize("short_chunks", [False, True])
def test_poisson_indices_are_the_public_ops_draw(monkeypatch, short_chunks):
    if short_chunks:  # the walk ends short of N: the tail uniforms decide the rest
        monkeypatch.setattr(sampling, "chunk_size", lambda expected: 3)
    for key in random_keys(8):
        for n, q in [(1000, 0.05), (60000, 256 / 60000), (7, 0.5)]:
            step_key = sampling.fold_key(key, 4).numpy()
            np.testing.assert_array_equal(sampling.poisson_indices(step_key, n, q).numpy(),
                                          public_poisson_indices(step_key, n, q))
