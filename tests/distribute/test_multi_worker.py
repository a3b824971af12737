"""DP training under MultiWorkerMirroredStrategy: 2 local workers on loopback.

Each worker is a process with its own TF_CONFIG (127.0.0.1 ports), running
`scenarios.py worker` (started with the others by conftest.py); a time
limit kills all if any hangs or fails.
One CPU device per worker, so R = 2 replicas, one per worker.
"""

import numpy as np
import pytest

NOISE_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def workers(scenario_runs):
    return [scenario_runs["worker_0"], scenario_runs["worker_1"]]


def test_workers_are_two_tasks_of_one_cluster(workers):
    assert sorted(int(w["task"]) for w in workers) == [0, 1]


def test_global_noise_matches_single_device_and_unscaled_noise_fails(workers):
    # The all-reduced update is the same on both workers.
    np.testing.assert_array_equal(workers[0]["noise"], workers[1]["noise"])
    assert abs(np.std(workers[0]["noise"]) - 1.0) < NOISE_TOLERANCE
    unscaled = np.std(workers[0]["noise_unscaled"])  # negative control
    assert abs(unscaled - 1.0) > 10 * NOISE_TOLERANCE
    assert abs(unscaled - np.sqrt(2)) < NOISE_TOLERANCE * np.sqrt(2)


@pytest.mark.parametrize("key", ["parts", "parts_unseeded"])
def test_each_worker_draws_its_own_independent_part_of_the_noise(workers, key):
    parts = np.concatenate([w[key] for w in workers])  # [2, coordinates]
    assert not np.array_equal(parts[0], parts[1])
    for part in parts:
        assert abs(np.std(part) * np.sqrt(2) - 1.0) < NOISE_TOLERANCE
    assert abs(np.corrcoef(parts)[0, 1]) < 0.03
    assert abs(np.std(parts.sum(0)) - 1.0) < NOISE_TOLERANCE


def test_noiseless_training_equals_single_device_training(workers):
    for worker in workers:
        np.testing.assert_allclose(
            worker["exact_dpsgd"], worker["exact_dpsgd_single"], rtol=0, atol=1e-5
        )
        assert int(worker["steps"]) == int(worker["steps_single"]) == 8
        assert float(worker["epsilon"]) == float(worker["epsilon_single"])


def test_a_record_source_trains_as_arrays_and_each_worker_reads_only_its_shard(workers):
    for worker in workers:
        # worker w samples and reads only its shard: records with index % 2 == w
        assert np.all(worker["source_reads"] % 2 == int(worker["task"]))
        assert np.all(worker["source_shares"] % 2 == int(worker["task"]))
        np.testing.assert_allclose(worker["source_dpsgd"], worker["exact_dpsgd"], rtol=0, atol=1e-6)
        assert int(worker["source_steps"]) == int(worker["steps"]) == 8
        assert float(worker["source_epsilon"]) == float(worker["epsilon"])
        reads, shares = worker["source_reads"], worker["source_shares"]
        # every read is a record of this worker's share (a multiset), nothing else
        read_counts = np.bincount(reads, minlength=96)
        assert np.all(read_counts <= np.bincount(shares, minlength=96)), "read beyond its share"
        assert len(reads) > 0
    # the two workers together read at least the 16 steps' expected ~24 records each
    assert sum(len(w["source_reads"]) for w in workers) > 16 * 24 * 0.7


def test_unseeded_workers_agree_on_every_global_batch(workers):
    """No user seed: the chief's secret seed is shared, so the batches match."""
    draws = [w["draws"] for w in workers]  # [fits, steps, N]
    np.testing.assert_array_equal(draws[0], draws[1])
    assert np.all((draws[0] >= 0).sum(-1) > 0)
    assert not np.array_equal(draws[0][0], draws[0][1])  # fresh seed per fit


def test_chief_seed_reaches_every_worker_and_data_mismatch_is_refused(workers):
    assert str(workers[0]["shared_seed"]) == str(workers[1]["shared_seed"])
    for worker in workers:
        message = str(worker["mismatch"])
        assert "Every worker must hold the same training data" in message
        assert "[96, 97] across the replicas" in message


def test_validation_evaluate_and_predict_work_across_workers(workers):
    # Keras 3.15 alone fails on the first two under MultiWorkerMirroredStrategy.
    for worker in workers:
        val_loss, loss, rows = worker["keras_paths"]
        assert np.isfinite(val_loss) and np.isfinite(loss) and rows == 10
        assert abs(val_loss - loss) < 1e-5  # same weights, same 40 examples


def test_workers_with_different_settings_are_refused_before_a_step(workers):
    """Worker 1 with sigma 2 (its ledger read 209.9 against the chief's 2.02
    before), a batch of 25 for 24, or Adam for SGD: every worker refuses."""
    for worker in workers:
        sigma, batch, optimizer = (str(m) for m in worker["settings_refusals"])
        for message, name in ((sigma, "noise_multiplier"), (batch, "batch_size"),
                              (optimizer, "optimizer")):
            assert "Every worker must train with the same privacy settings" in message, message
            assert f"Differing: {name}" in message and message.endswith("steps=0"), message
        assert "[1.0, 2.0] across the replicas" in sigma
        assert "[24.0, 25.0] across the replicas" in batch


@pytest.mark.parametrize("mode", ["fixed", "amplified"])
def test_bandmf_with_noise_on_two_workers_equals_single_device_training(workers, mode):
    for worker in workers:
        np.testing.assert_allclose(
            worker[f"bandmf_{mode}"], worker[f"bandmf_{mode}_single"], rtol=0, atol=1e-5)
        assert int(worker[f"bandmf_{mode}_steps"]) > 0


def test_unseeded_bandmf_workers_share_one_noise_draw(workers):
    """Unseeded, each worker adds 1/2 of w_t: the keys must agree (the
    chief's secret), else the halves are independent and the total noise
    is 1/sqrt(2) too small (negative control: each worker its own key)."""
    noise = workers[0]["bandmf_noise"]
    np.testing.assert_array_equal(noise, workers[1]["bandmf_noise"])
    assert abs(np.std(noise) - 1.0) < NOISE_TOLERANCE
    own_keys = np.std(workers[0]["bandmf_noise_own_keys"])
    assert abs(own_keys - np.sqrt(0.5)) < NOISE_TOLERANCE


def test_bandmf_workers_whose_pipelines_differ_refuse_before_a_step(workers):
    """Worker 1 shuffles with another seed: a record would sit at two
    positions of an epoch; both workers refuse before the first step."""
    for worker in workers:
        message = str(worker["bandmf_mismatch"])
        assert "pipeline" in message and message.endswith("steps=0"), message


def test_bandmf_workers_with_other_noise_keys_or_coefficients_refuse_before_a_step(workers):
    """Worker 1 seeded 8 for 7, or unseeded for 7: each worker would add
    half of a w_t of its own, 1/sqrt(2) of the noise the ledger charges
    (measured before: the update's std 0.709 of the single-device one,
    epsilon unchanged). Worker 1 planning 3 epochs for 2: other default
    coefficients (measured before at 4 bands, 2 epochs against 12 of 8
    steps: c = 0.795, 0.438, ... on one worker, 0.685, 0.482, ... on the
    other), and the run failed only after the shorter plan's last step.
    Both refuse before a step, without showing the seed."""
    for worker in workers:
        seeds, unseeded, epochs = (str(m) for m in worker["bandmf_noise_mismatch"])
        for message in (seeds, unseeded):
            assert "Differing: noise seed" in message and message.endswith("steps=0"), message
            assert "seed=7" not in message and "seed=8" not in message, message
        assert "Differing: planned steps" in epochs and epochs.endswith("steps=0"), epochs
        assert "[8.0, 12.0] across the replicas" in epochs, epochs


def test_bandmf_workers_writing_one_noise_state_path_keep_the_epoch_before_as_prev(workers):
    """Both workers run one stream (one id, from the shared secret), so the
    second worker's save of the same moment replaces the first's instead of
    moving it to `.prev`: `.prev` keeps the state at the end of epoch 1
    (step 4), which a resume one backup behind needs (with a stream id per
    worker it held the other worker's step-8 twin)."""
    for worker in workers:
        assert int(worker["bandmf_shared_state_prev"]) == 4
