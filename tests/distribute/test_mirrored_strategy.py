"""DP training under MirroredStrategy on 2 and 3 logical CPU devices.

The scenarios run in fresh processes (`scenarios.py`; logical devices must
be set before TensorFlow starts), concurrently with the multi-worker ones and
with a time limit (conftest.py); the tests assert on their results. Noise is measured in units of sigma * C / b, so the
global update's noise should be N(0, 1) per coordinate whatever R is.
"""

import numpy as np
import pytest

REPLICAS = (2, 3)
NOISE_TOLERANCE = 0.02  # 40,000 coordinates: the std's sampling error is 0.35%


@pytest.fixture(scope="module")
def runs(scenario_runs):
    return {r: scenario_runs[f"mirrored_{r}"] for r in REPLICAS}


@pytest.mark.parametrize("replicas", REPLICAS)
def test_global_noise_matches_single_device_and_unscaled_noise_fails(runs, replicas):
    run = runs[replicas]
    single, distributed = np.std(run["noise_1"]), np.std(run["noise"])
    assert abs(single - 1.0) < NOISE_TOLERANCE
    assert abs(distributed - 1.0) < NOISE_TOLERANCE, distributed
    assert abs(np.mean(run["noise"])) < 0.02
    # Negative control: full noise on every replica (no 1/sqrt(R)) sums to
    # sqrt(R) times too much noise, and the same check must reject it.
    unscaled = np.std(run["noise_unscaled"])
    assert abs(unscaled - 1.0) > 10 * NOISE_TOLERANCE
    assert abs(unscaled - np.sqrt(replicas)) < NOISE_TOLERANCE * np.sqrt(replicas)


@pytest.mark.parametrize("key", ["parts", "parts_unseeded"])
@pytest.mark.parametrize("replicas", REPLICAS)
def test_per_replica_noise_draws_are_independent_parts_of_the_total(runs, replicas, key):
    parts = runs[replicas][key]  # [R, coordinates], one row per replica
    assert parts.shape[0] == replicas
    for part in parts:
        assert abs(np.std(part) * np.sqrt(replicas) - 1.0) < NOISE_TOLERANCE
    correlation = np.corrcoef(parts)
    off_diagonal = correlation[~np.eye(replicas, dtype=bool)]
    assert np.all(np.abs(off_diagonal) < 0.03), correlation  # 0.005 sampling error
    assert abs(np.std(parts.sum(0)) - 1.0) < NOISE_TOLERANCE


def test_adadp_adaptive_noise_is_split_over_replicas_too(runs):
    """Per-coordinate noise sigma_j of AdaDP's adaptive phase, R = 2."""
    parts = runs[2]["adadp_parts"]  # each coordinate in units of sigma_j / b
    assert abs(np.std(parts.sum(0)) - 1.0) < NOISE_TOLERANCE
    assert abs(np.corrcoef(parts)[0, 1]) < 0.03
    unscaled = runs[2]["adadp_parts_unscaled"]  # negative control: full noise per replica
    assert abs(np.std(unscaled.sum(0)) - np.sqrt(2)) < NOISE_TOLERANCE * np.sqrt(2)


@pytest.mark.parametrize("replicas", REPLICAS)
def test_noiseless_dpsgd_reproduces_single_device_training(runs, replicas):
    """8 seeded steps, momentum, sample weights, weight decay after the noise."""
    run = runs[replicas]
    np.testing.assert_allclose(
        run[f"exact_dpsgd_{replicas}"], run["exact_dpsgd_1"], rtol=0, atol=1e-5
    )


def test_physical_batches_on_each_replica_reproduce_single_device_training(runs):
    run = runs[2]
    np.testing.assert_allclose(run["exact_dpsgd_chunked_2"], run["exact_dpsgd_1"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(run["logs_dpsgd_chunked_2"], run["logs_dpsgd_1"], rtol=1e-5)


def test_user_level_training_on_two_replicas_reproduces_single_device_training(runs):
    """Each replica's share holds whole users (3 records each), clipped per user."""
    run = runs[2]
    np.testing.assert_allclose(run["exact_users_2"], run["exact_users_1"], rtol=0, atol=1e-5)
    # Not vacuous: user-level training differs from record-level training.
    assert np.max(np.abs(run["exact_users_1"] - run["exact_dpsgd_1"])) > 1e-2


def test_decay_added_in_full_on_every_replica_is_caught(runs):
    # Negative control for the test above: without the 1/R share the
    # classic weight decay is applied R times per step.
    run = runs[2]
    assert np.max(np.abs(run["exact_dpsgd_unshared_decay"] - run["exact_dpsgd_1"])) > 0.05


@pytest.mark.parametrize("name", ["adam", "adadp"])
def test_noiseless_adam_and_adadp_reproduce_single_device_training(runs, name):
    run = runs[2]
    np.testing.assert_allclose(run[f"exact_{name}_2"], run[f"exact_{name}_1"], rtol=0, atol=1e-5)


def test_adadp_statistic_reads_the_global_noisy_gradient(runs):
    # Negative control: s from each replica's own part of the gradient
    # changes the adaptive clipping and the trajectory.
    run = runs[2]
    assert np.max(np.abs(run["exact_adadp_local_moments"] - run["exact_adadp_1"])) > 1e-3


@pytest.mark.parametrize("replicas", REPLICAS)
def test_ledger_counts_global_steps_with_the_single_device_epsilon(runs, replicas):
    run = runs[replicas]
    names = ["dpsgd", "adam", "adadp"] if replicas == 2 else ["dpsgd"]
    for name in names:
        assert int(run[f"steps_{name}_{replicas}"]) == int(run[f"steps_{name}_1"]) == 8
        assert float(run[f"epsilon_{name}_{replicas}"]) == float(run[f"epsilon_{name}_1"])


@pytest.mark.parametrize("replicas", REPLICAS)
def test_logged_loss_and_nonfinite_count_are_the_single_device_ones(runs, replicas):
    """The first epoch's logged training loss (sample weights, Poisson batches
    split over replicas) and count of dropped NaN/Inf rows (3 in the data) are
    what a single device logs for the same steps: counted once, not per replica."""
    run = runs[replicas]
    names = ["dpsgd", "adam", "adadp"] if replicas == 2 else ["dpsgd"]
    for name in names:
        (loss_1, count_1), (loss_r, count_r) = run[f"logs_{name}_1"], run[f"logs_{name}_{replicas}"]
        assert np.isfinite(loss_1) and loss_1 > 0
        assert loss_r == pytest.approx(loss_1, rel=1e-5)
        assert count_1 >= 1 and count_r == count_1


def test_unseeded_fits_draw_fresh_global_batches(runs):
    draws = runs[2]["draws"]  # [fits, steps, N], -1 after the sampled indices
    sizes = (draws >= 0).sum(-1)
    assert np.all(sizes > 0) and abs(sizes.mean() - 24) < 12
    for fit in draws:
        for step in fit:
            real = step[step >= 0]
            assert np.all(np.diff(real) > 0)  # each record at most once per step
    assert not np.array_equal(draws[0], draws[1])  # a new secret seed per fit


def test_mechanisms_that_cannot_be_split_refuse_before_any_step(runs):
    run = runs[2]
    assert "SADPSGD cannot train under a tf.distribute strategy" in str(run["refusal_sadpsgd"])
    assert "DPIS" in str(run["refusal_dpis"]) and "2 replicas" in str(run["refusal_dpis"])
    assert "clipnorm=1.0 with 2 replicas" in str(run["refusal_clipnorm"])
    # Keras's multi-step execution fails inside TensorFlow under replicas
    assert "steps_per_execution=2 with 2 replicas" in str(run["refusal_steps_per_execution"])
    for name in ("sadpsgd", "dpis", "clipnorm", "steps_per_execution"):
        assert str(run[f"refusal_{name}"]).endswith("steps=0")


@pytest.mark.parametrize("mode", ["fixed", "amplified"])
def test_bandmf_with_noise_on_two_replicas_reproduces_single_device_training(runs, mode):
    """Seeded DP-BandMF (3 bands, noise on, momentum, decay after the noise):
    a fixed order split row-wise, or shared cyclic Poisson draws; every
    replica draws the same z_t and adds 1/R of w_t, so R = 2 trains the same
    weights as one device, noise included."""
    run = runs[2]
    np.testing.assert_allclose(run[f"bandmf_{mode}_2"], run[f"bandmf_{mode}_1"], rtol=0, atol=1e-5)
    assert int(run[f"bandmf_{mode}_steps_2"]) == int(run[f"bandmf_{mode}_steps_1"]) > 0
    assert float(run[f"bandmf_{mode}_epsilon_2"]) == float(run[f"bandmf_{mode}_epsilon_1"])
    # negative control: every replica adding all of w_t puts R times the noise in
    assert np.abs(run["bandmf_fixed_unshared"] - run["bandmf_fixed_1"]).max() > 0.01


def test_bandmf_fixed_order_batch_not_divisible_by_replicas_trains_as_one_device(runs):
    """A fixed-order batch of 25 on 3 replicas: the two padding rows of the
    uneven shares add nothing (negative control: the same split with mask 1
    on the padding trains other weights)."""
    run = runs[3]
    np.testing.assert_allclose(run["bandmf_uneven_3"], run["bandmf_uneven_1"], rtol=0, atol=1e-5)
    assert np.abs(run["bandmf_uneven_unmasked"] - run["bandmf_uneven_1"]).max() > 1e-3


def test_bandmf_noise_state_saved_and_resumed_on_two_replicas_as_on_one(runs):
    """The file written on 2 replicas holds one device's history; resumed on
    2 replicas it is restored into every replica's copy (a stale copy would
    draw other noise and train other weights)."""
    run = runs[2]
    assert np.abs(run["bandmf_saved_1"]).max() > 0
    np.testing.assert_allclose(run["bandmf_saved_2"], run["bandmf_saved_1"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(run["bandmf_resumed_2"], run["bandmf_resumed_1"], rtol=0, atol=1e-5)
