"""The compiled embedding-row ops give TensorFlow's values bit for bit, and
TensorFlow's ops run, named, wherever the compiled ones cannot."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.mechanisms import native_noise
from tfdp.mechanisms.native import build
from tfdp.per_example import native_rows
from tfdp.per_example.rules import embedding

DTYPES = [tf.float32, tf.float64]
TINY = {tf.float32: np.finfo(np.float32).tiny, tf.float64: np.finfo(np.float64).tiny}


@pytest.fixture(scope="module")
def library():
    """The compiled ops (built on first use); CI must have them."""
    library, reason = native_rows._load()
    if library is None:
        message = f"the compiled row ops are unavailable here: {reason}"
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    return library


def bits(tensor):
    return tensor.numpy().view(f"u{tensor.dtype.size}")


def crafted(shape, dtype, seed):
    """Normal entries with -0.0, subnormal, tiny and huge ones in every row
    (sums of them flush, cancel and overflow)."""
    rng = np.random.default_rng(seed)
    values = rng.normal(size=shape)
    flat = values.reshape(-1, shape[-1])
    tiny = TINY[dtype]
    for k, value in enumerate([-0.0, tiny / 4, -tiny / 2, tiny, 2e38, -2e38]):
        flat[k::7, k % shape[-1]] = value
    return tf.constant(values.astype(dtype.as_numpy_dtype))


def run(function, compiled):
    return tf.function(function)() if compiled else function()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("compiled", [True, False], ids=["tf.function", "eager"])
@pytest.mark.parametrize("count, width, rows", [
    (0, 4, 3), (1, 1, 1), (5, 15, 2), (64, 16, 4), (300, 17, 9), (4000, 129, 50),
    (32768, 128, 20000)])
def test_the_scatter_is_scatter_nd_bit_for_bit(library, dtype, compiled, count, width, rows):
    ids = tf.constant(np.random.default_rng(count).integers(0, rows, count), tf.int32)
    updates = crafted([count, width], dtype, width)
    want = run(lambda: tf.scatter_nd(ids[:, None], updates, [rows, width]), compiled)
    got = run(lambda: library.tfdp_scatter_rows(ids, updates, rows), compiled)
    np.testing.assert_array_equal(bits(want), bits(got))
    if count > rows:  # the control: ids repeat, so rows were summed, not copied
        assert len(np.unique(ids.numpy())) < count


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("count, width, rows, hot", [
    (32768, 128, 20000, 0), (32768, 128, 20000, 19999), (4000, 33, 3, 1), (50, 8, 100000, 0)])
def test_the_scatter_of_skewed_ids_is_scatter_nd_bit_for_bit(library, dtype, count, width, rows,
                                                             hot):
    """Half of the ids on one row (a padding id), the rest spread: the
    threads own table rows, so one owns most of the additions."""
    rng = np.random.default_rng(rows + hot)
    ids = rng.integers(0, rows, count)
    ids[rng.random(count) < 0.5] = hot
    ids = tf.constant(ids, tf.int32)
    updates = crafted([count, width], dtype, width + 1)
    want = run(lambda: tf.scatter_nd(ids[:, None], updates, [rows, width]), True)
    got = run(lambda: library.tfdp_scatter_rows(ids, updates, rows), True)
    np.testing.assert_array_equal(bits(want), bits(got))
    assert np.sum(ids.numpy() == hot) > count // 3  # the control: one row takes many


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("compiled", [True, False], ids=["tf.function", "eager"])
@pytest.mark.parametrize("batch, length, width, vocab", [
    (1, 1, 1, 1), (1, 6, 3, 1), (3, 9, 5, 4), (8, 40, 16, 3), (8, 40, 16, 500),
    (256, 128, 128, 20000)])
def test_the_merge_is_merge_rows_bit_for_bit(library, dtype, compiled, batch, length, width,
                                             vocab):
    ids = tf.constant(np.random.default_rng(vocab).integers(0, vocab, (batch, length)), tf.int32)
    g = crafted([batch, length, width], dtype, vocab)
    first = embedding.first_positions(ids)
    want = run(lambda: embedding.merge_rows(g, first), compiled)
    got = run(lambda: library.tfdp_merge_rows(g, first), compiled)
    np.testing.assert_array_equal(bits(want), bits(got))


@pytest.mark.parametrize("compiled", [True, False], ids=["tf.function", "eager"])
@pytest.mark.parametrize("ids", [
    np.zeros([0, 4]), np.zeros([3, 0]), [[5]], [[7, 7, 7, 7, 7]],
    [[-2**31, 2**31 - 1, -2**31, -1, 0, 2**31 - 1, -1]],
    [[4, 7, 4, 4], [2, 2, 9, -1]], [[3, 1, 3], [3, 1, 3]],  # rows alike: each row its own
    np.arange(64).reshape(1, 64) * 2**26,  # ids alike in their low bits
    np.random.default_rng(0).integers(0, 20000, (256, 128)),
    np.random.default_rng(1).integers(-3, 3, (9, 300))], ids=lambda ids: str(np.shape(ids)))
def test_the_first_positions_are_first_positions(library, compiled, ids):
    ids = tf.constant(np.asarray(ids, np.int64).astype(np.int32))
    want = run(lambda: embedding.first_positions(ids), compiled).numpy()
    got = run(lambda: library.tfdp_first_positions(ids), compiled).numpy()
    np.testing.assert_array_equal(want, got)
    assert got.shape == ids.shape


def test_the_crafted_rows_flush_and_overflow(library):
    """The control of the two tests above: sums of their crafted entries
    overflow, and a sum of subnormal entries flushes to zero in a step's
    thread, so bit-equality covers those cases."""
    ids = tf.constant(np.arange(300) % 9, tf.int32)
    summed = tf.function(lambda: library.tfdp_scatter_rows(
        ids, crafted([300, 17], tf.float32, 17), 9))().numpy()
    assert np.isinf(summed).any() and np.isfinite(summed).any()
    tiny = tf.constant([[TINY[tf.float32] / 4]] * 4, tf.float32)
    flushed = tf.function(lambda: library.tfdp_scatter_rows(tf.zeros([4], tf.int32), tiny, 1))()
    assert flushed.numpy()[0, 0] == 0.0


@pytest.mark.parametrize("op", ["scatter", "merge"])
def test_an_index_out_of_range_is_an_error_not_a_write(library, op):
    if op == "scatter":
        def call():
            return library.tfdp_scatter_rows(tf.constant([0, 3]), tf.ones([2, 4]), 3)
        message = "does not index into shape"
    else:
        def call():
            return library.tfdp_merge_rows(tf.ones([1, 3, 2]), tf.constant([[0, 1, 3]]))
        message = "is not a position"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        call()
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        tf.function(call)()


@pytest.mark.parametrize("op, shapes", [
    ("scatter", ([2], [2], [])), ("scatter", ([2], [1, 2, 4], [])),
    ("scatter", ([2, 1], [2, 4], [])), ("scatter", ([2], [2, 4], [1])),
    ("merge", ([3, 2], [1, 3])), ("merge", ([1, 3, 2], [3])),
])
def test_inputs_of_other_ranks_are_refused_when_traced(library, op, shapes):
    specs = [tf.TensorSpec(shape, dtype) for shape, dtype in zip(
        shapes, [tf.int32, tf.float32, tf.int32] if op == "scatter" else [tf.float32, tf.int32])]
    call = library.tfdp_scatter_rows if op == "scatter" else library.tfdp_merge_rows
    with pytest.raises(ValueError, match="rank"):
        tf.function(call).get_concrete_function(*specs)


def test_rows_of_width_zero_are_an_error_as_in_tensorflow(library):
    with pytest.raises(tf.errors.InvalidArgumentError, match="width 0"):
        library.tfdp_scatter_rows(tf.constant([0, 1]), tf.zeros([2, 0]), 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="width 0"):
        library.tfdp_merge_rows(tf.zeros([1, 2, 0]), tf.constant([[0, 0]]))
    with pytest.raises(tf.errors.InvalidArgumentError):  # the reference raises too
        embedding.merge_rows(tf.zeros([1, 2, 0]), tf.constant([[0, 0]]))


def test_a_self_check_that_raises_leaves_tensorflows_ops_and_says_why(library, monkeypatch,
                                                                     caplog):
    def broken(library, seed):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(native_rows, "_self_check", broken)
    monkeypatch.setattr(native_rows, "_loaded", None)
    with caplog.at_level("INFO", logger="tfdp"):
        assert native_rows.library_here(tf.float32) is None
    reason = native_rows.rows_path()
    assert "raised RuntimeError: no kernel for this shape (self-check seed " in reason
    assert f"tfdp embedding rows: {reason}" in caplog.text


class _Reordered:
    """A planted library whose scatter adds the rows in reverse order (the
    same sum in real arithmetic, other roundings in floating point)."""

    def __init__(self, library):
        self.library = library

    def tfdp_scatter_rows(self, indices, updates, rows):
        return self.library.tfdp_scatter_rows(indices[::-1], updates[::-1], rows)

    def tfdp_merge_rows(self, g, first):
        return self.library.tfdp_merge_rows(g, first)

    def tfdp_first_positions(self, ids):
        return self.library.tfdp_first_positions(ids)


class _LastPositions(_Reordered):
    """A planted library that takes each id's last position for its first
    when the id is the row's largest value (a hash that mishandles int32's
    extremes), and scatters as TensorFlow does."""

    def tfdp_scatter_rows(self, indices, updates, rows):
        return self.library.tfdp_scatter_rows(indices, updates, rows)

    def tfdp_first_positions(self, ids):
        first = self.library.tfdp_first_positions(ids)
        last = tf.reverse(self.library.tfdp_first_positions(tf.reverse(ids, [1])), [1])
        last = tf.shape(ids)[1] - 1 - last
        return tf.where(tf.equal(ids, 2**31 - 1), last, first)


def test_a_library_that_rounds_differently_is_refused(library):
    assert "scatter" in native_rows._self_check(_Reordered(library), seed=0)
    assert native_rows._self_check(library, seed=0) is None  # negative control


def test_a_library_that_finds_other_first_positions_is_refused(library):
    assert "first positions" in native_rows._self_check(_LastPositions(library), seed=0)


def test_a_refused_library_leaves_tensorflows_ops_named(library, monkeypatch):
    monkeypatch.setattr(native_rows, "_loaded", (None, "the check failed"))
    assert native_rows.library_here(tf.float32) is None
    assert native_rows.rows_path() == "TensorFlow's ops (the check failed)"
    ids, rows = tf.constant([1, 1]), tf.constant([[1.0], [2.0]])
    np.testing.assert_array_equal(native_rows.scatter_rows(ids, rows, 2).numpy(), [[0.0], [3.0]])


def test_where_the_compiled_ops_run(library, monkeypatch):
    assert native_rows.rows_path() == "compiled ops"
    assert native_rows.library_here(tf.float32) is library
    assert native_rows.library_here(tf.bfloat16) is None
    assert tf.function(lambda: native_rows.library_here(tf.float32) is None,
                       jit_compile=True)()
    monkeypatch.setenv(build.ENV_SWITCH, "graph")
    assert native_noise.forced_graph() and native_rows.library_here(tf.float32) is None
    assert native_rows.rows_path() == "TensorFlow's ops (TFDP_NOISE_KERNEL=graph)"


def test_gradients_through_the_compiled_ops_are_tensorflows(library):
    """tfdp.auditing's record search differentiates the clipped sum by the
    record: through the compiled ops it gets the reference ops' gradients."""
    ids = tf.constant([[4, 4, 7, 4], [1, 2, 1, 1]])
    g = crafted([2, 4, 3], tf.float32, 5)
    weights = tf.constant(np.arange(60, dtype=np.float32).reshape(20, 3) - 30.0)

    def gradient(merge, scatter):
        with tf.GradientTape() as tape:
            tape.watch(g)
            first = embedding.first_positions(ids)
            rows = tf.reshape(merge(g, first), [-1, 3])
            table = scatter(tf.reshape(ids, [-1]), rows, 20)
            value = tf.reduce_sum(table * weights)
        return tape.gradient(value, g).numpy()

    want = gradient(embedding.merge_rows,
                    lambda i, r, n: tf.scatter_nd(i[:, None], r, [n, r.shape[-1]]))
    got = gradient(library.tfdp_merge_rows, library.tfdp_scatter_rows)
    np.testing.assert_array_equal(want, got)
    assert np.any(want != 0)


def _op_types(function):
    return {op.type for op in tf.function(function).get_concrete_function().graph.get_operations()}


def test_the_cpu_step_finds_merges_and_scatters_with_the_compiled_ops(library, monkeypatch):
    ids, g = tf.constant([[4, 4, 7, 4]]), tf.ones([1, 4, 2])
    table = tf.Variable(tf.zeros([10, 2]))

    def clipped_sum():
        part = embedding.EmbeddingGrads(ids, g, table)
        return part.sq_norm_bounds(), part.weighted_sum(tf.ones([1]))

    compiled = _op_types(clipped_sum)
    assert {"TfdpFirstPositions", "TfdpMergeRows", "TfdpScatterRows"} <= compiled
    assert not {"Unique", "ScatterNd", "TensorScatterAdd"} & compiled
    monkeypatch.setattr(native_rows, "library_here", lambda dtype: None)
    reference = _op_types(clipped_sum)  # the control: TensorFlow's ops where there is no library
    assert {"Unique", "ScatterNd", "TensorScatterAdd"} <= reference
    assert not {"TfdpFirstPositions", "TfdpMergeRows", "TfdpScatterRows"} & reference


def _trained_table(monkeypatch, compiled_rows):
    """(the embedding table after a seeded DP fit whose records repeat ids,
    the libraries the step's trace was given), with the compiled row ops or
    TensorFlow's (the same noise kernel either way)."""
    given = []
    original = native_rows.library_here

    def recorded(dtype):
        given.append(original(dtype) if compiled_rows else None)
        return given[-1]

    monkeypatch.setattr(native_rows, "library_here", recorded)
    keras.utils.set_random_seed(1)
    ids = np.random.default_rng(0).integers(0, 30, (64, 12)).astype(np.int32)
    ids[:8] = 7  # records of one id, repeated
    targets = np.random.default_rng(1).normal(size=(64, 2)).astype(np.float32)
    model = tfdp.DPSequential([keras.Input((12,), dtype="int32"), keras.layers.Embedding(30, 4),
                               keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=0.1, noise_multiplier=1.0,
                                                  seed=3), loss="mse")
    before = model.layers[0].embeddings.numpy()
    model.fit(ids, targets, batch_size=16, epochs=2, verbose=0)
    trained = model.layers[0].embeddings.numpy()
    assert not np.array_equal(trained, before)  # the control: the fit moved the table
    return trained, given


def test_a_dp_fit_trains_the_same_table_with_the_compiled_ops(library, monkeypatch):
    with monkeypatch.context() as patched:
        compiled, given = _trained_table(patched, compiled_rows=True)
    assert given and all(g is library for g in given)  # the merge and the scatter, compiled
    with monkeypatch.context() as patched:
        reference, given = _trained_table(patched, compiled_rows=False)
    assert given and not any(given)
    np.testing.assert_array_equal(compiled.view(np.uint32), reference.view(np.uint32))
