"""Rows' float32 sums of squares in one fixed order, by a compiled op.

`rounding.row_bounds` measures each row of a per-example tensor (a Dense
layer's input and output gradient at each position, an embedding's merged
rows, a materialized part's rows) by the float32 sum of its squared
entries. Its bound holds for a sum in any order (the per-example page,
F1), so the order is fixed here, pairwise by halves
(`halving_sum_of_squares`), and a compiled op
(`tfdp/mechanisms/native/row_squares.cc`, built with the noise kernel by
`tfdp.mechanisms.native.build`) makes the same squares and additions in
the same order in plain loops: the same values bit for bit, without
TensorFlow's separate square, its intermediate tensor and its reduction.
The TensorFlow ops stay the reference and run instead:

- when the library cannot be had (no C++ compiler, no headers, a compile
  error; `tfdp.mechanisms.native_noise.noise_path` says why), or with
  `TFDP_NOISE_KERNEL=graph`;
- when the loaded op fails its self-check against TensorFlow's ops (random
  rows of many widths with -0.0, subnormal, tiny, huge, infinite and NaN
  entries, in a `tf.function`: the values must not depend on the path);
- under XLA and on machines with a GPU (the op has a CPU kernel only).

Example:

>>> import tensorflow as tf
>>> float(row_squares(tf.constant([[3.0, 4.0]]))[0])
25.0
"""

import logging

import numpy as np
import tensorflow as tf

from tfdp.mechanisms import native_noise
from tfdp.mechanisms.native import build

logger = logging.getLogger("tfdp")

_CHECK_WIDTHS = (1, 2, 3, 5, 8, 17, 128, 129, 784)
_loaded = None  # (library or None, reason) once decided in this process


def halving_sum_of_squares(rows):
    """[...] sums of the squares of rows [..., C] (static C >= 1), in their
    dtype (float32 for the compiled op), added pairwise in a fixed order: with P the least power of two
    >= C, entry j of the first P/2 takes entry j + P/2 (where there is one),
    then the first P/4 take the next P/4, and so on down to one entry.

    The reference of the compiled op (`row_squares`), and its fallback.

    Example:

    >>> float(halving_sum_of_squares(tf.constant([1.0, 2.0, 2.0])))
    9.0
    """
    squares = tf.square(rows)
    width = rows.shape[-1]
    half = (1 << (width - 1).bit_length()) // 2
    while half >= 1:
        added = squares[..., :width - half] + squares[..., half:width]
        if width - half < half:  # the entries without a partner keep their value
            added = tf.concat([added, squares[..., width - half:half]], -1)
        squares, width, half = added, half, half // 2
    return squares[..., 0]


def row_squares(rows):
    """`halving_sum_of_squares(rows)`, compiled where it may run (see the
    module) on float32 rows.

    Args:
        rows: float tensor [..., C], C static and >= 1. Rows of another
            dtype (a float64 input) take the reference, in their dtype.
    """
    library = library_here() if rows.dtype == tf.float32 else None
    if library is None:
        return halving_sum_of_squares(rows)
    return library.tfdp_row_squares(rows)


def library_here():
    """The op library if its row squares may run here, else None."""
    if not native_noise.compiled_ops_may_run():
        return None
    return _load()[0]


def squares_path():
    """Which ops sum rows' squares here, in one line. Also logged once
    (logger "tfdp", INFO) when the library is first asked for.

    Example: `print(tfdp.per_example.native_squares.squares_path())`.
    """
    if native_noise.forced_graph():
        return f"TensorFlow's ops ({build.ENV_SWITCH}=graph)"
    library, reason = _load()
    return "compiled op" if library is not None else f"TensorFlow's ops ({reason})"


@tf.autograph.experimental.do_not_convert  # plain Python: loads and checks
def _load():
    global _loaded
    if _loaded is None:
        _loaded = build.load_checked(_self_check)
        logger.info("tfdp row squares: %s", squares_path())
    return _loaded


def check_rows(rng, shape):
    """Random float32 rows of `shape` [..., C] with special entries: a third
    of the rows hold -0.0, subnormal and tiny entries (their squares flush
    to zero; the sums stay finite), a third also a few huge, infinite or
    NaN entries (about two a row), a third a tenth of every kind."""
    values = rng.uniform(-3.0, 3.0, shape) * rng.choice([1e-3, 1.0, 1e3], shape)
    tiny = np.finfo(np.float32).tiny
    finite = np.array([-0.0, tiny / 4, -tiny / 2, tiny, 1e-20])
    everything = np.concatenate([finite, [3e19, -2e38, np.inf, np.nan]])
    kind = rng.integers(0, 3, list(shape[:-1]) + [1])
    rate = np.where(kind == 1, min(1.0, 2.0 / shape[-1]), 0.1)
    picks = rng.random(shape) < rate
    chosen = np.where(np.broadcast_to(kind == 0, shape)[picks],
                      rng.choice(finite, int(picks.sum())),
                      rng.choice(everything, int(picks.sum())))
    values[picks] = chosen
    return values.astype(np.float32)


def _self_check(library, seed=None):
    """None if the compiled op gives the reference's values bit for bit
    here, else what differed. Runs in a `tf.function` (the executor's
    threads, as in a train step), traced once a width."""
    rng = np.random.default_rng(seed)
    with tf.init_scope():
        for width in _CHECK_WIDTHS + (int(rng.integers(2, 4097)),):
            @tf.function(input_signature=[tf.TensorSpec([None, width], tf.float32)])
            def both(rows):
                return halving_sum_of_squares(rows), library.tfdp_row_squares(rows)

            count = int(rng.integers(1, 300))
            want, got = both(tf.constant(check_rows(rng, [count, width])))
            if not np.array_equal(want.numpy().view(np.uint32), got.numpy().view(np.uint32)):
                return (f"the compiled squares of {count} rows of {width} differ from "
                        f"halving_sum_of_squares on TensorFlow {tf.__version__}")
    return None


# Gradients, for what differentiates through a clipped sum (tfdp.auditing's
# record search): the reference's, grad times 2 x (TensorFlow's Square).
@tf.RegisterGradient("TfdpRowSquares")
def _row_squares_gradient(op, grad):
    rows = op.inputs[0]
    return grad[..., None] * (rows * 2.0)
