"""tfdp.distribute's pieces on one device (no logical devices needed)."""

import doctest

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import distribute
from tfdp.data import PoissonSampler


def global_draws(steps=20):
    sampler = PoissonSampler(1000, 97, seed=3)
    for step in range(steps):
        draw = sampler.draw(sampler.key, step)
        yield draw["indices"], draw["mask"]


def test_shares_partition_the_global_batch_evenly():
    for indices, mask in global_draws():
        real_rows = np.sort(indices.numpy()[mask.numpy() > 0])
        for replicas in (1, 2, 3, 5):
            rows, rows_mask = (t.numpy() for t in distribute.replica_shares(indices, mask, replicas))
            assert rows.shape[0] == replicas  # one share a replica, one shape
            real = rows[rows_mask > 0]
            np.testing.assert_array_equal(np.sort(real), real_rows)
            counts = rows_mask.sum(axis=1)
            assert max(counts) - min(counts) <= 1  # interleaved: balanced


def test_worker_shards_partition_each_global_draw_by_index():
    for indices, mask in global_draws():
        shards = [[t.numpy() for t in distribute.worker_shard(indices, mask, w, 3, 40)]
                  for w in range(3)]
        for worker, (rows, rows_mask) in enumerate(shards):
            real = rows[rows_mask > 0]
            assert np.all(real % 3 == worker)  # only its own shard
            assert np.all(rows_mask[: len(real)] == 1) and len(rows) % 40 == 0
        together = np.concatenate([r[m > 0] for r, m in shards])
        np.testing.assert_array_equal(np.sort(together), np.sort(indices.numpy()[mask.numpy() > 0]))
    rows, rows_mask = distribute.worker_shard(np.arange(100), np.ones(100, np.float32), 1, 2, 8)
    assert len(rows) == 56 and rows_mask.numpy().sum() == 50  # an oversized draw is never cut


def test_one_replica_changes_nothing():
    assert distribute.num_replicas_in_sync() == 1
    assert distribute.replica_share() == 1.0 and distribute.noise_scale() == 1.0
    tensors = [tf.ones([3])]
    assert distribute.sum_over_replicas(tensors)[0] is tensors[0]
    logs = {"loss": tf.constant(1.0)}
    assert distribute.logs_for_keras(logs) is logs


def test_shared_seed_on_one_device_is_fresh_and_checks_nothing_else():
    strategy = tf.distribute.get_strategy()
    seeds = {distribute.shared_sampling_seed(strategy, 50) for _ in range(3)}
    assert len(seeds) == 3 and all(0 <= s < 2**128 for s in seeds)
    settings = {"noise_multiplier": 1.1, "optimizer": "DPSGD {...}"}
    assert distribute.shared_sampling_seed(strategy, 50, settings) >= 0


def test_a_distributed_dataset_draws_fresh_batches_each_iteration_and_step():
    strategy = tf.distribute.get_strategy()
    x = np.arange(500, dtype=np.float32)[:, None]
    sampler = PoissonSampler(500, 50, seed=9)
    dataset = distribute.distribute_poisson_batches(
        strategy, sampler, x, lambda batch, mask: batch[:, 0][mask > 0])

    def first_steps(data):
        return [tuple(rows.numpy()) for rows, _ in zip(data, range(3))]

    once, again = first_steps(dataset), first_steps(dataset)
    assert len(set(once + again)) == 6  # no step and no iteration replays a draw
    same = distribute.distribute_poisson_batches(
        strategy, PoissonSampler(500, 50, seed=9), x, lambda batch, mask: batch[:, 0][mask > 0])
    assert first_steps(same) == once  # what every worker with the shared seed draws
    # Making an iterator does not rewrite the pipeline (and serialize x):
    # tfdp.data.poisson.unrewritten, as for one replica.
    assert dataset.options().experimental_optimization.apply_default_optimizations is False


class _TwoReplicas:
    num_replicas_in_sync = 2


@pytest.mark.parametrize("name", ["clipnorm", "clipvalue", "global_clipnorm"])
def test_inner_optimizer_clipping_is_refused_under_replicas(name):
    optimizer = tfdp.optimizers.DPOptimizer(
        keras.optimizers.SGD(0.1, **{name: 1.0}), l2_norm_clip=1.0, noise_multiplier=1.0
    )
    with pytest.raises(ValueError, match=f"{name}=1.0 with 2 replicas"):
        optimizer.check_distributable(_TwoReplicas())
    optimizer.check_distributable(tf.distribute.get_strategy())  # one replica: fine


def test_sadpsgd_declares_it_cannot_run_on_several_replicas():
    x = np.zeros((4, 3), np.float32)
    optimizer = tfdp.optimizers.SADPSGD(
        0.1, l2_norm_clip=1.0, noise_multiplier=1.0, public_energy_data=(x, np.zeros(4))
    )
    with pytest.raises(ValueError, match="SADPSGD cannot train under .* Received: 2 replicas"):
        optimizer.check_distributable(_TwoReplicas())
    assert tfdp.optimizers.DPSGD().multi_replica_unsupported is None
    assert tfdp.optimizers.AdaDP().multi_replica_unsupported is None


def test_docstring_examples_run():
    result = doctest.testmod(distribute, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_a_workers_shard_is_padded_for_the_records_its_draw_can_include():
    """A cyclic (DP-BandMF) draw includes only the active group's members:
    a worker's shard length is sized for the largest group within a shard
    (about N / (b W)), not N / W (which padded every replica's share to 4x
    the rows with 4 bands, 0.3x throughput on 2 workers)."""
    from tfdp.data.cyclic_poisson import CyclicPoissonSampler
    from tfdp.data.sampling import sampling_key

    assert PoissonSampler(1001, 10).shard_population(2) == 501
    sampler = CyclicPoissonSampler(10000, 50, bands=4, groups_key=sampling_key(3))
    population = sampler.shard_population(2)
    shards = np.arange(10000) % 2
    largest = max(int(np.sum((sampler.groups == g) & (shards == w)))
                  for g in range(4) for w in range(2))
    assert population == largest and 1200 < population < 1350
