"""DP training under `tf.distribute` (MirroredStrategy, MultiWorkerMirroredStrategy).

Keras sums the replicas' gradients (an all-reduce SUM in the inner
optimizer's `apply`). A DP step stays one DP-SGD release of the *global*
Poisson batch when:

- the global batch is drawn once over the global dataset (every worker draws
  the same indices from a shared secret seed); with several workers, worker
  w takes the sampled records of its shard (index % W == w: a Poisson sample
  of its shard with the same q, and the shards' samples are exactly the
  global one) and reads only those; a worker's records are split into
  shares, one per local replica (`distribute_poisson_batches`);
- each replica clips its share, divides by the global expected batch size b
  and adds independent noise N(0, sigma^2 C^2 / R): the R noises sum to
  exactly N(0, sigma^2 C^2) on the global sum, added once (`replica_share`);
- every other term that the step adds once (e.g. weight decay after the
  noise) is added as 1/R of it per replica;
- everything nonlinear (an inner optimizer's clipnorm, a mechanism's
  statistics) reads only the all-reduced gradient: a single replica's partial
  gradient carries only noise sigma / sqrt(R), so nothing may depend on it
  alone.

The ledger counts global steps (`DPModel._dp_steps` is updated once per
step). `DPOptimizer.make_training_data` and `DPOptimizer.privatize` use this
module; users only create the strategy and the model in its scope.

Example:

```python
strategy = tf.distribute.MirroredStrategy()
with strategy.scope():
    model = tfdp.DPSequential([...])
    model.compile(optimizer=tfdp.optimizers.DPSGD(...), loss=...)
model.fit(x, y, batch_size=1024)   # global expected batch size
```
"""

import hashlib
import math
import os

import numpy as np
import tensorflow as tf

from tfdp.data.poisson import PoissonSampler, gathered_batches, padded_batch_size, unrewritten
from tfdp.data.sampling import draws, padded_draw
from tfdp.data.sources import as_source

__all__ = [
    "num_replicas_in_sync",
    "replica_share",
    "replica_shares",
    "worker_shard",
    "shared_sampling_seed",
    "SecretSetting",
    "distribute_poisson_batches",
    "distribute_fixed_batches",
    "num_workers",
    "noise_scale",
    "sum_over_replicas",
    "logs_for_keras",
]


def num_replicas_in_sync():
    """Replicas whose gradients Keras sums at this point (1 outside a replica fn).

    Example:

    >>> num_replicas_in_sync()
    1
    """
    context = tf.distribute.get_replica_context()
    if context is None:  # cross-replica context: no per-replica gradients here
        return 1
    return int(context.num_replicas_in_sync)


def replica_share():
    """1/R: the share of a once-per-step term that each of R replicas adds.

    Keras sums the replicas' gradients, so a term the global step must carry
    once is added as 1/R of it per replica; noise of variance v is added as
    independent noise of variance v/R per replica (std scaled by
    `sqrt(replica_share())`).

    Example:

    >>> replica_share()
    1.0
    """
    return 1.0 / num_replicas_in_sync()


def replica_shares(indices, mask, num_replicas):
    """Splits one padded global batch into `num_replicas` equal shares.

    The batch is padded (index 0, mask 0) to a multiple of `num_replicas`;
    share r holds rows r, r + R, r + 2R, ... Sampled rows come first in a
    padded batch, so interleaving spreads them evenly over the replicas.
    The split does not change which records the step uses. TensorFlow ops:
    it runs in the input pipeline's graph.

    Args:
        indices: int tensor [L], a padded Poisson draw (`PoissonSampler.pad`).
        mask: float tensor [L], 1 for sampled rows, 0 for padding.
        num_replicas: int R >= 1.

    Returns:
        `(indices, mask)` of shape [R, ceil(L / R)]: row r is share r.

    Example:

    >>> shares, _ = replica_shares([4, 9, 7, 0], [1., 1., 1., 0.], 2)
    >>> shares.numpy().tolist()
    [[4, 7], [9, 0]]
    """
    indices = tf.cast(indices, tf.int64)
    mask = tf.cast(mask, tf.float32)
    rows = tf.shape(indices)[0]
    length = (rows + num_replicas - 1) // num_replicas * num_replicas
    indices = tf.pad(indices, [[0, length - rows]])
    mask = tf.pad(mask, [[0, length - rows]])
    # Row-major [L / R, R]: element (i, r) is row i R + r; transposed, row r
    # of the result is share r.
    return (tf.transpose(tf.reshape(indices, [-1, num_replicas])),
            tf.transpose(tf.reshape(mask, [-1, num_replicas])))


def worker_shard(indices, mask, worker, num_workers, length):
    """Worker `worker`'s records of a global Poisson draw, padded.

    The shard of worker w is the records with index % num_workers == w.
    Each record joins the global draw independently with probability q, so
    the shard's sampled records are a Poisson sample of the shard with the
    same q, and the workers' samples together are the global draw, each
    record in exactly one. TensorFlow ops: it runs in the input pipeline's
    graph.

    Args:
        indices, mask: a padded global draw (`PoissonSampler.pad`).
        worker: int, this worker's index in [0, num_workers).
        num_workers: int W >= 1; W = 1 returns the draw unchanged.
        length: the padded length of a shard's draw; a longer draw is
            padded to a multiple of it (never truncated).

    Returns:
        `(indices, mask)`: the shard's sampled indices first, then padding
        (index 0, mask 0).

    Example:

    >>> idx, mask = worker_shard([3, 4, 8, 0], [1., 1., 1., 0.], 0, 2, 4)
    >>> idx.numpy().tolist(), mask.numpy().tolist()
    ([4, 8, 0, 0], [1.0, 1.0, 0.0, 0.0])
    """
    indices = tf.cast(indices, tf.int64)
    mask = tf.cast(mask, tf.float32)
    if num_workers == 1:
        return indices, mask
    real = tf.boolean_mask(indices, mask > 0)
    mine = tf.boolean_mask(real, real % num_workers == worker)
    count = tf.size(mine, out_type=tf.int64)
    padded = tf.maximum(tf.constant(length, tf.int64), (count + length - 1) // length * length)
    draw = padded_draw(mine, padded)
    return draw["indices"], draw["mask"]


class SecretSetting:
    """A run setting that every worker must share but no message may show
    (a seed): `shared_sampling_seed` compares a digest of `text` and, where
    the workers differ, names the setting without its value.

    Args:
        text: the setting as text.

    Example:

    >>> seed = SecretSetting("seed 7")
    >>> shared_sampling_seed(tf.distribute.get_strategy(), 100, {"noise seed": seed}) >= 0
    True
    """

    def __init__(self, text):
        self.text = str(text)

    def __repr__(self):
        return "SecretSetting(<not shown>)"


def _setting_value(value):
    """A setting as a float64 every collective carries exactly: numbers as
    they are, anything else (a class name, a configuration, a
    `SecretSetting`'s text) as a 48-bit digest of its text."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, SecretSetting):
        value = value.text
    digest = hashlib.sha256(str(value).encode("utf-8")).digest()
    return float(int.from_bytes(digest[:6], "big"))


def shared_sampling_seed(strategy, num_examples, settings=None):
    """A secret sampling seed that every worker of `strategy` agrees on.

    Every worker must draw the same global Poisson batches, so they need one
    seed; and the seed must stay secret, since whoever knows it knows which
    records each step used (privacy amplification by sampling assumes they
    do not). The first replica (the chief's) draws 128 bits from OS entropy
    and broadcasts them with one all-gather over the strategy's own
    collective channel (the workers already share the training data); the
    seed is never logged or saved. The same all-gather checks that all
    workers hold the same number of training examples and run with the same
    `settings`: one global step is one DP-SGD release only if every replica
    samples, clips, noises and steps alike, and each worker's ledger charges
    its own settings (a worker with a larger sigma would report an epsilon
    the run does not have).

    Must be called by every worker (as `fit` is), like any collective.

    Args:
        strategy: a `tf.distribute.Strategy`.
        num_examples: this worker's number of training examples N.
        settings: None or a dict of this worker's run settings (name to a
            number, or to text compared by a digest: an optimizer's class and
            configuration, the mechanism's step event; a `SecretSetting` is
            compared by a digest and never shown).

    Returns:
        A non-negative Python int.

    Raises:
        ValueError: when workers hold different numbers of examples, or
            differ in a setting (each is named).

    Example:

    >>> seed = shared_sampling_seed(tf.distribute.get_strategy(), 100, {"noise_multiplier": 1.1})
    >>> seed >= 0
    True
    """
    settings = dict(settings or {})
    names = list(settings)
    values = [_setting_value(settings[name]) for name in names]
    # 32-bit words and numbers in float64: exact, and every collective supports it.
    words = np.frombuffer(os.urandom(16), dtype=np.uint32).astype(np.float64)
    local = np.concatenate([words, [float(num_examples)], values])[None]

    @tf.function(autograph=False)
    def exchange():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            return context.all_gather(tf.constant(local, tf.float64), axis=0)

        return strategy.experimental_local_results(strategy.run(replica_fn))[0]

    gathered = exchange().numpy()  # [R, 5 + settings], the same on every worker
    counts = gathered[:, 4]
    if np.any(counts != counts[0]):
        raise ValueError(
            "Every worker must hold the same training data (Poisson sampling is over "
            "the global dataset and each worker takes its replicas' share of each "
            f"batch). Received: num_examples={num_examples} on this worker, "
            f"{sorted(set(int(c) for c in counts))} across the replicas"
        )
    differing = [i for i in range(len(names)) if np.any(gathered[:, 5 + i] != gathered[0, 5 + i])]
    if differing:
        shown = []
        for i in differing:
            name, value = names[i], settings[names[i]]
            if isinstance(value, SecretSetting):
                variants = len(set(gathered[:, 5 + i]))
                shown.append(f"{name} (not shown: {variants} different values across the "
                             "replicas)")
            elif isinstance(value, str):
                variants = len(set(gathered[:, 5 + i]))
                shown.append(f"{name}={value[:200]!r} on this worker ({variants} different "
                             "values across the replicas)")
            else:
                across = sorted(set(float(v) for v in gathered[:, 5 + i]))
                shown.append(f"{name}={value!r} on this worker, {across} across the replicas")
        raise ValueError(
            "Every worker must train with the same privacy settings, optimizer and "
            "steps: one global step is one DP-SGD release only if every replica "
            "samples, clips and adds noise alike, and each worker's ledger charges "
            f"its own settings. Differing: {', '.join(names[i] for i in differing)}. "
            "Training was not started. Received: " + "; ".join(shown)
        )
    seed = 0
    for word in gathered[0, :4]:  # the first replica's (the chief's) entropy
        seed = (seed << 32) | int(word)
    return seed


def distribute_poisson_batches(strategy, sampler, arrays, to_element, first_step=0):
    """A distributed dataset of global Poisson batches split over the replicas.

    Every worker uses the same `sampler` key (`shared_sampling_seed` or a
    user seed), so all draw the same global batch each step: the draws
    happen in TensorFlow, keyed by the step's number, so they agree whatever
    each worker reads ahead. With several workers each takes the sampled
    records of its shard (`worker_shard`) and reads only those (arrays,
    memmaps or a source); its local replicas get equal shares of them
    (`replica_shares`). A `tfdp.data.users.UserSampler`'s draw is split by
    user instead (worker w takes the users u with u % W == w), so a worker's
    shard and a replica's share hold whole users, k records each. The per-replica element is `to_element(batch,
    mask)`. The dataset is endless (steps `first_step`, `first_step + 1`,
    ...): pass `steps_per_epoch`. A new iteration draws fresh batches
    (`tfdp.data.sampling.draws`), the same on every worker.

    Args:
        strategy: a `tf.distribute.Strategy`.
        sampler: a `tfdp.data.PoissonSampler` over the global dataset.
        arrays: nested structure of arrays with first dimension
            `sampler.num_examples` (the same on every worker).
        to_element: function `(batch_arrays, mask) -> element`, run in the
            tf.data pipeline.
        first_step: int >= 0, the first step's number.

    Returns:
        A `tf.distribute.DistributedDataset` (one global step per element).

    Example:

    ```python
    sampler = PoissonSampler(len(x), expected_batch_size=256, seed=seed)
    dataset = distribute_poisson_batches(
        strategy, sampler, (x, y), lambda batch, mask: (batch, mask))
    ```
    """
    if not isinstance(sampler, PoissonSampler):
        raise TypeError(
            "Expected `sampler` to be a `PoissonSampler`. "
            f"Received: sampler={sampler!r} of type {type(sampler).__name__}"
        )
    num_replicas = strategy.num_replicas_in_sync

    def dataset_fn(input_context):
        workers = input_context.num_input_pipelines
        worker = input_context.input_pipeline_id
        local = num_replicas // workers
        shard_length = padded_batch_size(
            sampler.shard_population(workers), sampler.sampling_probability,
            multiple=8 * local,
        )
        # A source (or memmap) stays on disk: each worker reads only its shares.
        tensors = arrays if as_source(arrays) is not None else tf.nest.map_structure(
            tf.convert_to_tensor, arrays
        )

        def shares(draw):
            if "users" in draw:  # user-level: shards and shares are whole users
                users, user_mask = worker_shard(
                    draw["users"], draw["user_mask"], worker, workers, shard_length
                )
                users, user_mask = replica_shares(users, user_mask, local)
                return sampler.user_rows(draw["offset_key"], users, user_mask)
            indices, mask = worker_shard(
                draw["indices"], draw["mask"], worker, workers, shard_length
            )
            return replica_shares(indices, mask, local)

        # tf.data keeps the order (deterministic by default): consecutive
        # elements go to consecutive local replicas.
        pairs = draws(sampler, sampler.key, first_step).map(shares).unbatch()
        # No static rewrites: they would serialize the arrays at every iterator.
        return unrewritten(
            gathered_batches(pairs, tensors).map(to_element).prefetch(tf.data.AUTOTUNE))

    return strategy.distribute_datasets_from_function(dataset_fn)


def num_workers(strategy):
    """The number of workers (machines, processes) of `strategy`: 1 unless a
    MultiWorkerMirroredStrategy runs in a cluster.

    Example:

    >>> num_workers(tf.distribute.get_strategy())
    1
    """
    extended = strategy.extended
    if not getattr(extended, "_in_multi_worker_mode", lambda: False)():
        return 1
    return int(getattr(extended, "_num_workers", 1))


def distribute_fixed_batches(strategy, make_stream):
    """A distributed dataset of fixed global batches split over the replicas.

    For data the step does not sample (DP-BandMF's fixed order): every
    worker reads the same global batch of B rows each step (`make_stream()`
    on each worker gives the same stream); worker w keeps the rows r with
    r % W == w (`worker_shard`) and its local replicas get equal shares of
    them (`replica_shares`), so each row of the global batch goes to exactly
    one replica. "expected_batch_size" stays the global B.

    Args:
        strategy: a `tf.distribute.Strategy`.
        make_stream: function of no arguments returning a `tf.data.Dataset`
            of global elements `(arrays, step_info)`, step_info with "mask"
            (float [B]) and "expected_batch_size" (scalar), as
            `tfdp.data.fixed_order.FixedOrderData.stream` gives.

    Returns:
        A `tf.distribute.DistributedDataset` (one global step per element).

    Example:

    ```python
    dataset = distribute_fixed_batches(strategy, lambda: data.stream(0, order_check))
    ```
    """
    num_replicas = strategy.num_replicas_in_sync

    def dataset_fn(input_context):
        workers = input_context.num_input_pipelines
        worker = input_context.input_pipeline_id
        local = num_replicas // workers

        def shares(arrays, step_info):
            mask = step_info["mask"]
            rows = tf.range(tf.size(mask, out_type=tf.int64))
            per_worker = -(-mask.shape[0] // workers)
            length = -(-per_worker // local) * local
            indices, mask = worker_shard(rows, mask, worker, workers, length)
            indices, mask = replica_shares(indices, mask, local)  # [local, L / local]
            arrays = tf.nest.map_structure(lambda a: tf.gather(a, indices), arrays)
            expected = tf.fill([local], tf.cast(step_info["expected_batch_size"], tf.float32))
            return arrays, {"mask": mask, "expected_batch_size": expected}

        # consecutive elements go to consecutive local replicas
        return make_stream().map(shares).unbatch().prefetch(tf.data.AUTOTUNE)

    return strategy.distribute_datasets_from_function(dataset_fn)


def noise_scale():
    """sqrt(1/R): the factor on each replica's noise standard deviation.

    Example:

    >>> noise_scale()
    1.0
    """
    return math.sqrt(replica_share())


def sum_over_replicas(tensors):
    """The all-reduced (global) sum of per-replica tensors; identity on one replica.

    A mechanism statistic that steers training (AdaDP's second moments) must
    read the global noisy gradient, never one replica's part of it (which
    carries only 1/sqrt(R) of the noise). Every replica gets the same result.

    Example:

    >>> [t.numpy() for t in sum_over_replicas([tf.ones([2])])]
    [array([1., 1.], dtype=float32)]
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return list(tensors)
    return list(context.all_reduce(tf.distribute.ReduceOp.SUM, list(tensors)))


def logs_for_keras(logs):
    """A train step's logs in the shape Keras can reduce across workers.

    Keras 3.15 reduces step logs under a multi-worker
    MultiWorkerMirroredStrategy with `strategy.reduce("MEAN", v, axis=0)`,
    which fails on scalars; there each log gets shape [1] (the reduction
    returns a scalar). Elsewhere the logs are returned unchanged.

    Example:

    >>> logs_for_keras({"loss": tf.constant(1.0)})["loss"].shape
    TensorShape([])
    """
    strategy = tf.distribute.get_strategy()
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
        getattr(strategy.extended, "_in_multi_worker_mode", lambda: False)()
    )
    if not multi_worker:
        return logs
    return {key: tf.reshape(value, [1]) for key, value in logs.items()}
