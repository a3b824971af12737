"""An embedding's repeated ids, merged rows and clipped sum by compiled ops.

`EmbeddingGrads` finds each example's repeated ids (`first_positions`, by
`tf.unique` of row-and-id keys), adds their rows into the id's first
position (`merge_rows`) and scatters the weighted rows into the table
(`tf.scatter_nd`). TensorFlow's CPU kernels for the two sums add one row at
a time through Eigen (about 8 ms each for 32,768 rows of 128 on two
cores); the compiled ops (`tfdp/mechanisms/native/embedding_rows.cc`, built
with the noise kernel by `tfdp.mechanisms.native.build`) find the same
first positions with a small hash table a row and make the same additions
in the same order in plain loops: the same values bit for bit. The
TensorFlow ops stay the reference and run instead:

- when the library cannot be had (no C++ compiler, no headers, a compile
  error; `tfdp.mechanisms.native_noise.noise_path` says why), or with
  `TFDP_NOISE_KERNEL=graph`;
- when the loaded ops fail their self-check against TensorFlow's (random
  rows with repeated ids, -0.0, subnormal and huge entries, float32 and
  float64, in a `tf.function`: the values must not depend on the path);
- under XLA and on machines with a GPU (the ops have CPU kernels only).

Example:

>>> import tensorflow as tf
>>> ids = tf.constant([2, 0, 2])
>>> rows = tf.constant([[1.0], [2.0], [4.0]])
>>> scatter_rows(ids, rows, 3)[:, 0].numpy()
array([2., 0., 5.], dtype=float32)
"""

import logging
import os

import numpy as np
import tensorflow as tf

from tfdp.mechanisms import native_noise
from tfdp.mechanisms.native import build

logger = logging.getLogger("tfdp")

_DTYPES = (tf.float32, tf.float64)
_MERGE_WIDTH = 19  # the self-check's merged rows: two 8-float packets and 3 more
_loaded = None  # (library or None, reason) once decided in this process


def scatter_rows(indices, updates, rows):
    """`tf.scatter_nd(indices[:, None], updates, [rows, D])`, compiled where
    it may run (see the module).

    Args:
        indices: int32 [N], each in [0, rows).
        updates: float [N, D].
        rows: the output's row count (a Python int or an int32 scalar).
    """
    library = library_here(updates.dtype)
    if library is None:
        return tf.scatter_nd(tf.reshape(indices, [-1, 1]), updates,
                             tf.stack([rows, tf.shape(updates)[1]]))
    return library.tfdp_scatter_rows(indices, updates, tf.cast(rows, tf.int32))


def library_here(dtype):
    """The op library if its ops may run on rows of `dtype` here, else None
    (`library.tfdp_first_positions(ids)` is `rules.embedding.first_positions`,
    `library.tfdp_merge_rows(g, first)` is `rules.embedding.merge_rows`)."""
    if tf.as_dtype(dtype) not in _DTYPES or not native_noise.compiled_ops_may_run():
        return None
    return _load()[0]


def rows_path():
    """Which ops find, merge and scatter an embedding's rows here, in one
    line. Also logged once (logger "tfdp", INFO) when the library is first
    asked for.

    Example: `print(tfdp.per_example.native_rows.rows_path())`.
    """
    if native_noise.forced_graph():
        return f"TensorFlow's ops ({build.ENV_SWITCH}=graph)"
    library, reason = _load()
    return "compiled ops" if library is not None else f"TensorFlow's ops ({reason})"


@tf.autograph.experimental.do_not_convert  # plain Python: loads and checks
def _load():
    global _loaded
    if _loaded is None:
        ops = build.load()
        library, reason = ops.library, ops.reason
        if library is not None:
            seed = int.from_bytes(os.urandom(8), "little")
            try:
                reason = _self_check(library, seed)
            except Exception as error:  # noqa: BLE001 -- any failure means TensorFlow's ops
                reason = f"the self-check raised {type(error).__name__}: {error}"
            if reason:
                reason, library = f"{reason} (self-check seed {seed})", None
        _loaded = (library, reason)
        logger.info("tfdp embedding rows: %s", rows_path())
    return _loaded


def _check_values(rng, shape, dtype):
    """Random entries of `shape` with -0.0, subnormal, tiny and huge values
    mixed in (sums of them flush to zero, cancel and overflow)."""
    values = rng.uniform(-3.0, 3.0, shape)
    tiny = np.finfo(dtype.as_numpy_dtype).tiny
    special = np.array([-0.0, tiny / 4, -tiny / 2, tiny, 2e38, -2e38, 1e-30])
    picks = rng.random(shape) < 0.2
    values[picks] = rng.choice(special, int(picks.sum()))
    return values.astype(dtype.as_numpy_dtype)


def _both(library, dtype):
    """tf.functions of (reference, compiled) pairs on `dtype` rows, each
    traced once (shapes unknown but the merge's width): scatter, first
    positions, merge."""
    from tfdp.per_example.rules import embedding  # the reference (imports this module)

    def spec(rank, kind=dtype):
        return tf.TensorSpec([None] * rank, kind)

    @tf.function(input_signature=[spec(1, tf.int32), spec(2), spec(0, tf.int32)])
    def scatter(ids, updates, rows):
        return (tf.scatter_nd(ids[:, None], updates, tf.stack([rows, tf.shape(updates)[1]])),
                library.tfdp_scatter_rows(ids, updates, rows))

    @tf.function(input_signature=[spec(2, tf.int32)])
    def first(ids):
        return embedding.first_positions(ids), library.tfdp_first_positions(ids)

    # merge_rows takes rows of a known width.
    @tf.function(input_signature=[spec(2, tf.int32), tf.TensorSpec([None, None, _MERGE_WIDTH],
                                                                   dtype)])
    def merge(ids, g):
        positions = embedding.first_positions(ids)
        return embedding.merge_rows(g, positions), library.tfdp_merge_rows(g, positions)

    return scatter, first, merge


def _self_check(library, seed=None):
    """None if the compiled ops give TensorFlow's values bit for bit here,
    else what differed. Runs in `tf.function`s (the executor's threads, as
    in a train step) on random sizes, ids and values."""
    rng = np.random.default_rng(seed)
    with tf.init_scope():
        for dtype in _DTYPES:
            scatter, first, merge = _both(library, dtype)
            for count, width, rows in [(1, 1, 1), (7, 17, 3), (int(rng.integers(500, 3000)),
                                                              int(rng.integers(1, 200)), 50)]:
                ids = tf.constant(rng.integers(0, rows, count), tf.int32)
                updates = tf.constant(_check_values(rng, [count, width], dtype))
                if not _same_bits(*scatter(ids, updates, tf.constant(rows))):
                    return (f"the compiled scatter of {count} {dtype.name} rows of {width} "
                            f"differs from tf.scatter_nd on TensorFlow {tf.__version__}")
            for batch, length in [(1, 1), (3, 9), (int(rng.integers(2, 9)),
                                                  int(rng.integers(20, 80)))]:
                extremes = rng.choice([-2**31, 2**31 - 1, -1, 0, 7], [batch, length])
                if not _same_bits(*first(tf.constant(extremes, tf.int32))):
                    return (f"the compiled first positions of {batch} x {length} ids differ "
                            f"from first_positions on TensorFlow {tf.__version__}")
                tokens = tf.constant(rng.integers(0, 4, [batch, length]), tf.int32)
                g = tf.constant(_check_values(rng, [batch, length, _MERGE_WIDTH], dtype))
                if not _same_bits(*merge(tokens, g)):
                    return (f"the compiled merge of {batch} x {length} {dtype.name} rows "
                            f"differs from merge_rows on TensorFlow {tf.__version__}")
    return None


def _same_bits(a, b):
    a, b = a.numpy(), b.numpy()
    kind = f"u{a.dtype.itemsize}"
    return a.shape == b.shape and np.array_equal(a.view(kind), b.view(kind))


# Gradients, for what differentiates through a clipped sum (tfdp.auditing's
# record search): those of the TensorFlow ops the compiled ones replace.
@tf.RegisterGradient("TfdpScatterRows")
def _scatter_rows_gradient(op, grad):
    return None, tf.gather(grad, op.inputs[0]), None


@tf.RegisterGradient("TfdpMergeRows")
def _merge_rows_gradient(op, grad):
    # Each row g[b, t] is added into its first position first[b, t].
    return tf.gather(grad, op.inputs[1], batch_dims=1), None


tf.no_gradient("TfdpFirstPositions")
