"""tfdp.distribute's pieces on one device (no logical devices needed)."""

import doctest

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import distribute
from tfdp.data import PoissonSampler


def test_shares_partition_the_global_batch_evenly():
    sampler = PoissonSampler(1000, 97, seed=3)
    for indices, mask in sampler.epoch():
        for replicas in (1, 2, 3, 5):
            shares = distribute.replica_shares(indices, mask, replicas)
            assert len(shares) == replicas
            assert len({len(i) for i, _ in shares}) == 1  # one shape per step
            real = np.concatenate([i[m > 0] for i, m in shares])
            np.testing.assert_array_equal(np.sort(real), np.sort(indices[mask > 0]))
            counts = [int(m.sum()) for _, m in shares]
            assert max(counts) - min(counts) <= 1  # interleaved: balanced


def test_worker_shards_partition_each_global_draw_by_index():
    sampler = PoissonSampler(1000, 97, seed=3)
    for indices, mask in sampler.epoch():
        shards = [distribute.worker_shard(indices, mask, w, 3, 40) for w in range(3)]
        for worker, (rows, rows_mask) in enumerate(shards):
            real = rows[rows_mask > 0]
            assert np.all(real % 3 == worker)  # only its own shard
            assert np.all(rows_mask[: len(real)] == 1) and len(rows) % 40 == 0
        together = np.concatenate([r[m > 0] for r, m in shards])
        np.testing.assert_array_equal(np.sort(together), np.sort(indices[mask > 0]))
    rows, rows_mask = distribute.worker_shard(np.arange(100), np.ones(100, np.float32), 1, 2, 8)
    assert len(rows) == 56 and rows_mask.sum() == 50  # an oversized draw is never cut


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


def test_later_iterations_draw_new_batches_and_need_a_seed():
    sampler = PoissonSampler(500, 50, seed=9)
    first = distribute._iteration_sampler(sampler, 0)
    assert first is sampler
    again = [distribute._iteration_sampler(sampler, 1).sample_indices() for _ in range(2)]
    np.testing.assert_array_equal(again[0], again[1])  # same on every worker
    other = distribute._iteration_sampler(sampler, 2).sample_indices()
    fresh = PoissonSampler(500, 50, seed=9).sample_indices()
    assert not np.array_equal(again[0], other) and not np.array_equal(again[0], fresh)
    with pytest.raises(ValueError, match="seed=None"):
        distribute._iteration_sampler(PoissonSampler(500, 50), 1)


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
