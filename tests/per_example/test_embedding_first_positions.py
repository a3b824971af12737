"""An embedding's repeated ids are found by hashing (row, id) pairs, or
under XLA by sorting them: the same first positions as comparing every pair
of a row's ids, for any int32 id.

The merge of repeated ids is what makes an example's measured norm the norm
of what it adds to the table: two positions of one id both taken as "first"
would each be measured alone (|a|^2 + |b|^2) while the table receives a + b.
The crafted rows below would be under-clipped by such a merge.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.per_example.rules.embedding import (EmbeddingGrads, first_positions,
                                              first_positions_by_sort)

INT32 = np.iinfo(np.int32)


def pairwise_first(ids):
    """The reference: each position's first equal id in its row, by comparing all pairs."""
    ids = np.asarray(ids)
    return np.argmax(ids[:, :, None] == ids[:, None, :], axis=2).astype(np.int32)


@pytest.mark.parametrize("ids", [
    np.random.default_rng(0).integers(0, 20000, (64, 128)),   # few repeats
    np.random.default_rng(1).integers(0, 3, (16, 40)),         # mostly repeats
    np.full((3, 7), 5),                                         # one id a row
    # Ids whose low or high bits coincide, and int32's extremes: (row, id)
    # pairs must stay distinct keys.
    np.array([[INT32.min, INT32.max, -1, 0, -1, INT32.min],
              [1, 1 << 16, (1 << 16) + 1, 1, INT32.max, -1]]),
    # Each row's ids in falling order, and a row's ids equal to the next
    # row's: the sort's runs must break at rows and keep position order.
    np.array([[9, 7, 7, 5, 3, 3, 1, 1], [9, 7, 7, 5, 3, 3, 1, 1], [1, 3, 1, 3, 1, 3, 1, 3]]),
    np.array([[INT32.max] * 4 + [INT32.min] * 4]),
    # Row 1's ids are row 0's less 2^32 - 1, 2^16, 2^24 and 2^31 + 1: with
    # any of those as the row offset (not 2^32), two rows' keys would meet.
    np.array([[INT32.max, 7, 7, 7], [INT32.min, 7 - 2**16, 7 - 2**24, 7 - 2**31 - 1]]),
    np.array([[6]]),
], ids=["random", "few_ids", "constant", "extremes", "falling", "two_extremes", "row_offsets",
        "one"])
@pytest.mark.parametrize("function, xla", [(first_positions, False),
                                           (first_positions_by_sort, False),
                                           (first_positions_by_sort, True)],
                         ids=["hash", "sort", "sort_xla"])
def test_first_positions_equal_the_pairwise_reference(ids, function, xla):
    ids = ids.astype(np.int32)
    found = tf.function(function, jit_compile=xla)(tf.constant(ids)) if xla else function(ids)
    np.testing.assert_array_equal(found.numpy(), pairwise_first(ids))


@pytest.mark.parametrize("function", [first_positions, first_positions_by_sort])
def test_rows_never_share_keys(function):
    # The same id in two rows is two keys: each row's first position of it.
    ids = tf.constant([[9, 3, 9], [3, 9, 9]])
    np.testing.assert_array_equal(function(ids).numpy(), [[0, 1, 0], [0, 1, 1]])


@pytest.mark.parametrize("function", [first_positions, first_positions_by_sort])
def test_empty_and_unknown_shapes(function):
    assert function(tf.zeros([0, 4], tf.int32)).shape == (0, 4)
    assert function(tf.zeros([3, 0], tf.int32)).shape == (3, 0)
    traced = tf.function(function).get_concrete_function(
        tf.TensorSpec([None, None], tf.int32))
    out = traced(tf.constant([[2, 2, 1]]))
    np.testing.assert_array_equal(out.numpy(), [[0, 0, 2]])


def _present_devices(monkeypatch, accelerator):
    """TensorFlow's logical devices as the embedding rule sees them: a CPU,
    and a GPU if `accelerator`."""
    devices = [tf.config.LogicalDevice("/device:CPU:0", "CPU")]
    if accelerator:
        devices.append(tf.config.LogicalDevice("/device:GPU:0", "GPU"))
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda *a: devices)


@pytest.mark.parametrize("xla, accelerator, sorts", [(True, True, True), (True, False, False),
                                                     (False, True, False)])
def test_xla_on_accelerators_finds_repeated_ids_without_unique(monkeypatch, xla, accelerator,
                                                               sorts):
    """XLA's `tf.unique` is a loop of one iteration an id (0.6 s a step for
    32k ids on an H200): under XLA with a GPU or TPU the step sorts instead;
    elsewhere it hashes (the controls: the graph's Unique op is seen where
    it is)."""
    _present_devices(monkeypatch, accelerator)
    table = tf.Variable(tf.zeros([10, 2]))
    ids = tf.constant([[4, 4, 7, 4]])
    g = tf.ones([1, 4, 2])

    def norms():
        return EmbeddingGrads(ids, g, table).sq_norms()

    traced = tf.function(norms, jit_compile=xla).get_concrete_function()
    kinds = {op.type for op in traced.graph.get_operations()}
    assert ("Unique" in kinds) == (not sorts)
    assert float(traced()[0]) >= 3 * 3 * 2 + 2  # the three 4s merged, measured as summed


def test_repeated_ids_are_measured_as_they_are_summed():
    # Crafted: one id three times with gradients that add up (norm 3 |a|),
    # a second id once. Measured alone they would give sqrt(3) |a|.
    table = tf.Variable(tf.zeros([10, 2]))
    ids = tf.constant([[4, 4, 7, 4]])
    a = [3.0, 4.0]
    g = tf.constant([[a, a, [0.0, 1.0], a]])
    part = EmbeddingGrads(ids, g, table)
    assert float(part.sq_norms()[0]) >= 9 * 25 + 1
    summed = part.weighted_sum(tf.constant([1.0]))[0].numpy()
    np.testing.assert_array_equal(summed[4], [9.0, 12.0])
    assert float(np.sum(summed**2)) <= float(part.sq_norms()[0])


def test_zero_weight_rows_add_nothing_even_when_not_finite():
    table = tf.Variable(tf.zeros([5, 2]))
    ids = tf.constant([[1, 2], [1, 3]])
    g = tf.constant([[[np.nan, np.inf], [1.0, 1.0]], [[2.0, 0.0], [0.0, 2.0]]])
    summed = EmbeddingGrads(ids, g, table).weighted_sum(tf.constant([0.0, 0.5]))[0].numpy()
    np.testing.assert_array_equal(summed, [[0, 0], [1, 0], [0, 0], [0, 1], [0, 0]])


def _crafted_rows(shape, seed):
    """Row gradients with a -0.0 row, a NaN row, a row of subnormal entries
    and a row near float32's range."""
    g = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    g[0, 0] = -0.0
    g[1, 3] = np.nan
    g[2, :, 0] = 1e-40
    g[3] *= 1e30
    return g


@pytest.mark.parametrize("vocab", [3, 50, 500])
@pytest.mark.parametrize("compiled", [True, False], ids=["tf.function", "eager"])
def test_merging_the_repeated_rows_is_the_scatter_of_every_row(vocab, compiled):
    """`merge_rows` adds only the repeated positions' rows, in the scatter's
    order: the scatter's values, but for entries its 0 + x reads otherwise
    (a -0.0, or a subnormal under flush-to-zero): zeros or subnormals both."""
    from tfdp.per_example.rules.embedding import merge_rows, scatter_merge

    rng = np.random.default_rng(vocab)
    ids = tf.constant(rng.integers(0, vocab, (8, 40)), tf.int32)
    g = tf.constant(_crafted_rows((8, 40, 16), vocab))
    first = first_positions(ids)
    run = tf.function if compiled else (lambda f: f)
    merged, scattered = run(merge_rows)(g, first).numpy(), run(scatter_merge)(g, first).numpy()
    same = merged.view(np.uint32) == scattered.view(np.uint32)
    tiny = 2.0**-126
    assert np.all(same | ((np.abs(merged) < tiny) & (np.abs(scattered) < tiny)))
    assert np.mean(same) > 0.99
    repeated = first.numpy() != np.arange(40)[None, :]
    assert repeated.any()  # the control: rows were merged, not only copied


@pytest.mark.parametrize("xla", [True, False])
def test_the_merge_scatters_every_row_under_xla_only(monkeypatch, xla):
    """Outside XLA the step merges only the repeated rows (the speed-up);
    under XLA it keeps the scatter of every row it was reviewed with."""
    from tfdp.per_example.rules import embedding

    called = []

    def recorded(name, function):
        def call(*args):
            called.append(name)
            return function(*args)
        return call

    for name in ("merge_rows", "scatter_merge"):
        monkeypatch.setattr(embedding, name, recorded(name, getattr(embedding, name)))
    # TensorFlow's merge (the compiled twin's reference: test_native_rows.py).
    monkeypatch.setattr(embedding.native_rows, "library_here", lambda dtype: None)
    ids = tf.constant([[1, 2, 1, 1]])
    g = tf.constant([[[1.0], [2.0], [4.0], [8.0]]])
    table = tf.Variable(tf.zeros([3, 1]))
    merged = tf.function(lambda: EmbeddingGrads(ids, g, table).merged_rows(), jit_compile=xla)()
    np.testing.assert_array_equal(merged.numpy()[0, :, 0], [13.0, 2.0, 0.0, 0.0])
    assert called == ["scatter_merge" if xla else "merge_rows"]


def test_the_compiled_step_trains_the_same_weights_with_the_sort(monkeypatch):
    """A DP step under XLA with the sort (an accelerator present) and with the
    hash (CPUs only): the same weights bit for bit, on records whose ids
    repeat (one seed: the same batches and noise on both)."""
    import keras

    import tfdp
    from tfdp.per_example.rules import embedding

    sorted_calls = []
    original = embedding.first_positions_by_sort

    def counted(ids):
        sorted_calls.append(ids)
        return original(ids)

    monkeypatch.setattr(embedding, "first_positions_by_sort", counted)
    ids = np.array([[3, 3, 3, 1], [2, 5, 2, 5], [4, 4, 4, 4], [0, 1, 2, 3]] * 4, np.int32)
    targets = np.random.default_rng(0).normal(size=(16, 2)).astype(np.float32)

    def trained(accelerator):
        _present_devices(monkeypatch, accelerator)
        keras.utils.set_random_seed(1)
        model = tfdp.DPSequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(8, 2),
                                   keras.layers.GlobalAveragePooling1D()])
        model.compile(optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=0.1, noise_multiplier=1.0,
                                                      seed=3),
                      loss="mse", jit_compile=True)
        model.fit(ids, targets, batch_size=8, epochs=1, verbose=0)
        return model.layers[0].embeddings.numpy()

    with_sort = trained(accelerator=True)
    assert sorted_calls  # the control: the sort ran in the compiled step
    del sorted_calls[:]
    with_hash = trained(accelerator=False)
    assert not sorted_calls
    np.testing.assert_array_equal(with_sort.view(np.uint32), with_hash.view(np.uint32))
