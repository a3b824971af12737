"""SA-DPSGD's acceptance rule (tfdp.mechanisms.annealing): values, state, statistics."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfdp.mechanisms import annealing, dpsgd

KEY = tf.constant([20231, 77], tf.int64)


def step(current, candidate, temperature, tau, mu, uniform, q0=10.0, mu0=10):
    return annealing.annealing_step(
        current, candidate, temperature, tf.cast(tau, tf.int64), tf.cast(mu, tf.int64),
        uniform, q0, mu0,
    )


def test_acceptance_probability_values():
    dE = tf.constant([-3.0, -0.0, 0.0, 0.1, 0.05, float("-inf"), float("inf")])
    p = annealing.acceptance_probability(dE, tf.constant(10.0)).numpy()
    np.testing.assert_array_equal(p[:3], [1.0, 1.0, 1.0])
    assert p[3] == pytest.approx(math.exp(-1.0), rel=1e-6)
    assert p[4] == pytest.approx(math.exp(-0.5), rel=1e-6)
    assert p[5] == 1.0 and p[6] == 0.0
    # Q = 0 (the paper's temperature after a first-step rejection): any finite
    # raise is accepted; a NaN energy change is never accepted by chance.
    assert float(annealing.acceptance_probability(tf.constant(5.0), tf.constant(0.0))) == 1.0
    assert math.isnan(float(annealing.acceptance_probability(tf.constant(float("nan")), tf.constant(1.0))))


def test_accept_updates_state_as_algorithm_2():
    s = step(2.0, 1.5, 10.0, tau=3, mu=4, uniform=0.999)
    assert bool(s.accepted) and not bool(s.forced)
    assert float(s.energy) == 1.5
    assert int(s.accepted_count) == 4 and int(s.consecutive_rejections) == 0
    assert float(s.temperature) == 40.0  # Q0 * tau


def test_reject_keeps_energy_and_counts_the_rejection():
    # dE = 0.1, Q = 10: P = e^-1 = 0.368 < u = 0.5.
    s = step(1.0, 1.1, 10.0, tau=3, mu=4, uniform=0.5)
    assert not bool(s.accepted)
    assert float(s.energy) == 1.0
    assert int(s.accepted_count) == 3 and int(s.consecutive_rejections) == 5
    assert float(s.temperature) == 30.0
    # The same candidate with a draw below P is accepted.
    assert bool(step(1.0, 1.1, 10.0, tau=3, mu=4, uniform=0.3).accepted)


def test_forced_acceptance_exactly_at_the_threshold():
    # P = exp(-1000) = 0: only forced acceptance can accept.
    below = step(1.0, 2.0, 1000.0, tau=1, mu=9, uniform=0.5, mu0=10)
    assert not bool(below.accepted) and int(below.consecutive_rejections) == 10
    at = step(1.0, 2.0, 1000.0, tau=1, mu=10, uniform=0.5, mu0=10)
    assert bool(at.accepted) and bool(at.forced)
    assert int(at.consecutive_rejections) == 0 and int(at.accepted_count) == 2
    assert float(at.energy) == 2.0
    # A diverged candidate (non-finite energy) is never forced in.
    for bad in (float("nan"), float("inf")):
        s = step(1.0, bad, 1000.0, tau=1, mu=10, uniform=0.5, mu0=10)
        assert not bool(s.accepted) and int(s.consecutive_rejections) == 11


def test_step_is_branch_free_inside_tf_function():
    fn = tf.function(
        lambda cur, cand, u, mu: step(cur, cand, 10.0, 2, mu, u, mu0=3)
    )
    concrete = fn.get_concrete_function(
        tf.TensorSpec([], tf.float32), tf.TensorSpec([], tf.float32),
        tf.TensorSpec([], tf.float32), tf.TensorSpec([], tf.int64),
    )
    ops = {op.type for op in concrete.graph.get_operations()}
    assert not ops & {"If", "StatelessIf", "While", "StatelessWhile"}, ops
    accepted = concrete(tf.constant(1.0), tf.constant(0.5), tf.constant(0.9), tf.constant(0, tf.int64))
    rejected = concrete(tf.constant(1.0), tf.constant(1.5), tf.constant(0.9), tf.constant(0, tf.int64))
    assert bool(accepted.accepted) and not bool(rejected.accepted)


def _uniforms(n):
    steps = tf.range(n, dtype=tf.int64)
    fn = tf.function(
        lambda s: tf.map_fn(
            lambda t: annealing.decision_uniform(dpsgd.step_seed(KEY, t)), s,
            fn_output_signature=tf.float32,
        )
    )
    return fn(steps).numpy()


@pytest.mark.parametrize("energy_change,temperature", [(0.01, 20.0), (0.1, 10.0), (0.02, 150.0)])
def test_raising_candidates_accepted_as_often_as_exp_minus_dE_Q(energy_change, temperature):
    """Frequency of acceptance over 20,000 steps' draws matches exp(-dE*Q).

    Negative controls: the conventional rule exp(-dE/Q) and a temperature off
    by a factor 2 are both rejected by the same tolerance.
    """
    n = 20_000
    u = _uniforms(n)
    fn = tf.function(
        lambda u: annealing.annealing_step(
            tf.fill([n], 1.0), tf.fill([n], 1.0 + energy_change), temperature,
            tf.fill([n], tf.constant(5, tf.int64)), tf.fill([n], tf.constant(0, tf.int64)),
            u, 10.0, 10,
        ).accepted
    )
    rate = float(np.mean(fn(tf.constant(u)).numpy()))

    def consistent(p):
        return abs(rate - p) <= 4.5 * math.sqrt(p * (1 - p) / n)

    expected = math.exp(-energy_change * temperature)
    assert consistent(expected), (rate, expected)
    assert not consistent(math.exp(-energy_change / temperature)), rate
    assert not consistent(math.exp(-energy_change * temperature * 2)), rate
    assert not consistent(math.exp(-energy_change * temperature / 2)), rate


def test_decision_draws_are_uniform_and_keyed_by_step():
    u = _uniforms(5000)
    assert np.all((u >= 0) & (u < 1))
    hist, _ = np.histogram(u, bins=10, range=(0, 1))
    chi2 = float(np.sum((hist - 500.0) ** 2 / 500.0))
    assert chi2 < 27.9  # chi^2_9, p = 0.001
    assert len(np.unique(u)) > 4990
    again = annealing.decision_uniform(dpsgd.step_seed(KEY, 3))
    assert float(again) == u[3]
    # Independent of the step's noise stream for tensor 0 (fold-in index 0).
    seed = dpsgd.step_seed(KEY, 3)
    noise_stream = tf.random.stateless_uniform([], tf.random.experimental.stateless_fold_in(seed, 0))
    assert float(noise_stream) != float(again)


def test_subset_indices_are_distinct_in_range_and_change_per_step():
    a = annealing.subset_indices(dpsgd.step_seed(KEY, 1), 50, 20).numpy()
    b = annealing.subset_indices(dpsgd.step_seed(KEY, 2), 50, 20).numpy()
    assert len(set(a.tolist())) == 20 and a.min() >= 0 and a.max() < 50
    assert set(a.tolist()) != set(b.tolist())
    np.testing.assert_array_equal(a, annealing.subset_indices(dpsgd.step_seed(KEY, 1), 50, 20).numpy())
    full = annealing.subset_indices(dpsgd.step_seed(KEY, 1), 7, 7).numpy()
    assert sorted(full.tolist()) == list(range(7))
