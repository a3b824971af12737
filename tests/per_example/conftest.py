"""Shared reference for the per-example gradient tests: one example at a time."""

import numpy as np
import pytest
import tensorflow as tf


def _reference_gradients(model, x, y, weights, loss_fn):
    """Per-example gradients by a Python loop of batch-of-1 backward passes."""
    per_example = []
    batch = len(weights)
    for i in range(batch):
        x_i = tf.nest.map_structure(lambda t: t[i : i + 1], x)
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i : i + 1], model(x_i, training=False)) * weights[i]
        grads = tape.gradient(loss, model.trainable_variables, unconnected_gradients="zero")
        per_example.append(grads)
    return [np.stack([tf.convert_to_tensor(g[j]).numpy() for g in per_example]) for j in range(len(model.trainable_variables))]


def _assert_matches_reference(grads, reference, rtol=1e-5):
    """Materialized gradients, norms and a weighted sum agree with the loop.

    Relative to the largest entry of the reference, so that entries that are
    zero in exact arithmetic (a key bias under softmax) do not fail on float32
    round-off.
    """
    materialized = [g.numpy() for g in grads.materialize()]
    scale = max(max(np.abs(r).max() for r in reference), 1e-12)
    for got, want in zip(materialized, reference):
        np.testing.assert_allclose(got / scale, want / scale, atol=rtol * 10, rtol=rtol)
    batch = reference[0].shape[0]
    want_norms = sum(np.sum(np.square(r.reshape(batch, -1)), 1) for r in reference)
    # The norms are upper bounds: not below the reference (up to its own
    # float32 rounding), and above it by at most the factored norms' float32
    # Gram bound (about gamma(256) S relative where rows are nearly parallel).
    got_norms = grads.sq_norms().numpy()
    assert np.all(got_norms >= want_norms * (1 - 1e-5) - 1e-9), (got_norms, want_norms)
    np.testing.assert_allclose(got_norms, want_norms, rtol=1e-4, atol=1e-9)
    weights = np.linspace(0.5, 1.5, batch).astype(np.float32)
    sums = grads.weighted_sum(tf.constant(weights))
    for got, want in zip(sums, reference):
        expected = np.tensordot(weights, want, axes=1)
        np.testing.assert_allclose(got.numpy() / scale, expected / scale, atol=1e-5)
    rng = np.random.default_rng(7)
    vectors = [rng.normal(size=r.shape[1:]).astype(np.float32) for r in reference]
    want_dots = sum(r.reshape(batch, -1) @ v.reshape(-1) for r, v in zip(reference, vectors))
    got_dots = grads.dots([tf.constant(v) for v in vectors]).numpy()
    np.testing.assert_allclose(got_dots / scale, want_dots / scale, atol=1e-5)


def _mse(y, p):
    return tf.reduce_mean(tf.square(tf.reshape(y, [tf.shape(y)[0], -1]) - tf.reshape(p, [tf.shape(p)[0], -1])), -1)


def _check_batched_pass(model, x, rng):
    """The batched pass on a 5-example batch `x` (weights 1, 0.5, 2, 1, 0)
    against the one-example-at-a-time reference; returns (plan, y_pred)."""
    from tfdp.per_example import compute_per_example_gradients, plan_for

    plan = plan_for(model)
    assert plan.path == "batched", plan.reason
    y = tf.constant(rng.normal(size=(5, 2)), tf.float32)
    weights = tf.constant([1.0, 0.5, 2.0, 1.0, 0.0])
    grads, y_pred, _ = compute_per_example_gradients(model, x, y, weights, _mse, "batched", training=False)
    assert grads.path == "batched"
    _assert_matches_reference(grads, _reference_gradients(model, x, y, weights.numpy(), _mse))
    return plan, y_pred


@pytest.fixture
def mse():
    return _mse


@pytest.fixture
def check_batched_pass():
    return _check_batched_pass


@pytest.fixture
def reference_gradients():
    return _reference_gradients


@pytest.fixture
def assert_matches_reference():
    return _assert_matches_reference


@pytest.fixture
def without_dot_error_terms(monkeypatch):
    """A function that drops the relative and/or absolute term of
    `rounding.float32_dot_error` for the rest of the test (a mutant of the
    float32 bounds, the negative control of their tests)."""
    from tfdp.per_example import rounding

    original = rounding.float32_dot_error

    def drop(relative=False, absolute=False):
        def mutant(width, chunk=rounding.FLOAT32_GRAM_CHUNK):
            rel, abs_ = original(width, chunk)
            return (0.0 if relative else rel), (0.0 if absolute else abs_)

        monkeypatch.setattr(rounding, "float32_dot_error", mutant)

    return drop
