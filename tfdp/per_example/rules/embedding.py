"""Rule for Embedding: gradient rows only at each example's token ids.

Example i's gradient of the table is sum_t e_{id_t} G_{i,t}^T: rows at its
token ids, never a dense vocabulary x dim tensor per example. Its squared
norm is sum over distinct ids u of ||sum_{t: id_t = u} G_{i,t}||^2 (tokens
that repeat add before squaring); the weighted sum over examples scatters
weighted rows into one dense [vocabulary, dim] tensor (dense, because DP
noise goes on every row: a sparse update would reveal which tokens occurred;
`tfdp.optimizers.sparse_embeddings` selects rows privately instead, from the
rows each example touches, `first_occurrences`).

Example:

>>> import tensorflow as tf
>>> table = tf.Variable(tf.zeros([5, 2]))
>>> ids = tf.constant([[1, 1, 3]])
>>> g = tf.constant([[[1.0, 0.0], [1.0, 0.0], [0.0, 2.0]]])
>>> EmbeddingGrads(ids, g, table).sq_norms().numpy().round(4)   # |(2, 0)|^2 + |(0, 2)|^2
array([8.], dtype=float32)
"""

import keras
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tfdp.per_example import native_rows, rounding
from tfdp.per_example.grads import SummedAsMeasured, as_float32, joined_rows, norm_of
from tfdp.per_example.registry import register_rule
from tfdp.per_example.rules.common import concat_positions, plain_weights


def first_positions(ids):
    """int32 [B, T]: for each position of `ids` [B, T], the first position in
    its row holding the same id.

    One hash lookup a position (`tf.unique` of the int64 keys row * 2^32 +
    id, `_row_keys`), not the T x T comparisons of each row's ids with
    each other. No shape here depends on how many ids are distinct (the
    distinct keys themselves are not used): every result is [B, T].

    Example:

    >>> first_positions(tf.constant([[4, 7, 4, 4], [2, 2, 9, -1]])).numpy()
    array([[0, 1, 0, 0],
           [0, 0, 2, 3]], dtype=int32)
    """
    keys = _row_keys(ids)
    _, key_of = tf.unique(keys, out_idx=tf.int32)
    size = tf.size(keys)  # at least as many as the distinct keys
    firsts = tf.math.unsorted_segment_min(tf.range(size), key_of, size)
    return _in_rows(tf.gather(firsts, key_of), ids)


def _row_keys(ids):
    """int64 [B T]: the keys row * 2^32 + id of `ids` [B, T] (two int32 ids
    differ by less than 2^32, so distinct (row, id) pairs are distinct keys)."""
    ids = tf.convert_to_tensor(ids)
    rows = tf.cast(tf.range(tf.shape(ids)[0]), tf.int64)[:, None] * 2**32
    return tf.reshape(rows + tf.cast(tf.cast(ids, tf.int32), tf.int64), [-1])


def _in_rows(first, ids):
    """Flat first positions [B T] as positions in their rows, [B, T]."""
    batch, length = tf.shape(ids)[0], tf.shape(ids)[1]
    return tf.reshape(first, [batch, length]) - length * tf.range(batch)[:, None]


def first_positions_by_sort(ids):
    """`first_positions(ids)` from one sort of the keys, for XLA on
    accelerators.

    XLA lowers `tf.unique` to a loop with one iteration an element: a text
    model's 32,768 ids a step took 0.6 s on an H200 (a few kernels an
    iteration). The sort puts equal (row, id) keys next to each other; each
    run's smallest position is its key's first, and every position reads
    its run's (whatever order the sort leaves ties in). The values
    are `first_positions`' (a function of the ids alone), shapes [B, T] as
    there. On CPUs XLA keeps `tf.unique` (13 ms for those ids; this sort
    alone takes 5 ms, but the text model's compiled step then ran at 0.8 s
    instead of 0.19 s: XLA fused the noise's seed derivations into its
    per-entry loop).

    Example:

    >>> first_positions_by_sort(tf.constant([[4, 7, 4, 4], [2, 2, 9, -1]])).numpy()
    array([[0, 1, 0, 0],
           [0, 0, 2, 3]], dtype=int32)
    """
    keys = _row_keys(ids)
    size = tf.size(keys)
    order = tf.argsort(keys)  # sorted index -> flat position
    ordered = tf.gather(keys, order)
    # Each key against the one before it (the first against itself - 1).
    starts = tf.not_equal(ordered, tf.concat([ordered[:1] - 1, ordered[:-1]], 0))
    run = tf.math.cumsum(tf.cast(starts, tf.int32)) - 1  # run of each sorted index
    first_of_run = tf.math.unsorted_segment_min(order, run, size)
    first = tf.scatter_nd(order[:, None], tf.gather(first_of_run, run),
                          tf.shape(keys))  # back to positions
    return _in_rows(first, ids)


def _flat_targets(first):
    """[B, T] first positions as indices into the [B T] flattened rows."""
    length = tf.shape(first)[1]
    return first + length * tf.range(tf.shape(first)[0])[:, None]


def scatter_merge(g, first):
    """[B, T, D] rows `g` summed into their first positions `first` [B, T]
    (`first_positions`), zero elsewhere: one scatter of every row.

    Example:

    >>> g = tf.constant([[[1.0], [2.0], [4.0]]])
    >>> scatter_merge(g, tf.constant([[0, 1, 0]]))[0, :, 0].numpy()
    array([5., 2., 0.], dtype=float32)
    """
    batch, length, width = tf.shape(g)[0], tf.shape(g)[1], g.shape[-1]
    # scatter_nd sums duplicates; measured 1.5x faster than
    # unsorted_segment_sum for 32k rows of 128 on 2 CPU cores.
    merged = tf.scatter_nd(tf.reshape(_flat_targets(first), [-1, 1]),
                           tf.reshape(g, [-1, width]), tf.stack([batch * length, width]))
    return tf.reshape(merged, tf.shape(g))


def merge_rows(g, first):
    """`scatter_merge(g, first)`, scattering only the rows of repeated
    positions: the first rows, then the repeated rows added to them in
    position order, the scatter's order. The values are the scatter's but
    where its 0 + x reads x otherwise: a -0.0 entry of a first row stays
    -0.0 (0.0 there) and, under flush-to-zero, a subnormal one stays (0
    there). Shapes depend on how many positions repeat an id of their row.

    Example:

    >>> g = tf.constant([[[1.0], [2.0], [4.0]]])
    >>> merge_rows(g, tf.constant([[0, 1, 0]]))[0, :, 0].numpy()
    array([5., 2., 0.], dtype=float32)
    """
    width = g.shape[-1]
    own = tf.equal(first, tf.range(tf.shape(first)[1])[None, :])
    firsts = tf.where(own[..., None], g, tf.zeros_like(g))
    repeated = tf.where(tf.logical_not(own))  # [R, 2], in row-major (position) order
    targets = tf.gather_nd(_flat_targets(first), repeated)
    rows = tf.gather_nd(g, repeated)
    merged = tf.tensor_scatter_nd_add(tf.reshape(firsts, [-1, width]), targets[:, None], rows)
    return tf.reshape(merged, tf.shape(g))


def _in_xla():
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _xla_on_accelerator():
    """Under XLA with a GPU or TPU present (where the step runs there; an
    XLA_CPU device is a CPU)."""
    return _in_xla() and any(device.device_type in ("GPU", "TPU")
                             for device in tf.config.list_logical_devices())


class EmbeddingGrads(SummedAsMeasured):
    """Per-example gradients of an embedding table from ids and row gradients.

    The rows of an id an example looked up several times are added first
    (`merged_rows`); the norms and the weighted sum both read those merged
    rows, so what is summed is exactly what was measured.

    Args:
        ids: int tensor [B, T], the token ids each example looked up.
        g: float tensor [B, T, D], the loss gradient at each looked-up row.
        table: the embedding variable [V, D].
    """

    def __init__(self, ids, g, table):
        self.ids = tf.cast(ids, tf.int32)
        self.g = as_float32(g)
        self.variables = [table]
        self._table = table
        self._merged = None
        self._first = None

    def _first_positions(self):
        """[B, T]: each position's first position of its id in its row
        (computed once; under XLA on a GPU or TPU by sorting,
        `first_positions_by_sort`; outside XLA on CPUs by a compiled op,
        `native_rows`)."""
        if self._first is None:
            library = native_rows.library_here(self.g.dtype)  # None under XLA
            if _xla_on_accelerator():
                self._first = first_positions_by_sort(self.ids)
            elif library is not None:
                self._first = library.tfdp_first_positions(self.ids)  # first_positions' values
            else:
                self._first = first_positions(self.ids)
        return self._first

    def first_occurrences(self):
        """bool [B, T]: True at the first position of each distinct id of an
        example (the rows the example touches, once each)."""
        return tf.equal(self._first_positions(), tf.range(tf.shape(self.ids)[1])[None, :])

    def merged_rows(self):
        """[B, T, D]: at the first position of each distinct id of an example
        the sum of that id's row gradients, elsewhere zero (computed once).

        `merge_rows` adds only the repeated positions' rows to the first
        rows (outside XLA on CPUs by its compiled twin, the same values bit
        for bit: `native_rows`); under XLA `scatter_merge` scatters every
        row (the form the XLA step was measured and reviewed with;
        `merge_rows` compiles there too on the CPU, untried on
        accelerators). Either way the norms and the
        weighted sum read these same rows, each example's from its own rows
        alone."""
        if self._merged is None:
            first = self._first_positions()
            library = native_rows.library_here(self.g.dtype)  # None under XLA
            if _in_xla():
                self._merged = scatter_merge(self.g, first)
            elif library is not None:
                self._merged = library.tfdp_merge_rows(self.g, first)  # merge_rows' values
            else:
                self._merged = merge_rows(self.g, first)
        return self._merged

    def sq_norm_bounds(self):
        # Float32 squares a merged row, with the proved bound (no floor: the
        # zero rows of repeated positions keep float32's tiny absolute term).
        bounds = rounding.row_bounds(self.merged_rows(), floor=0.0)
        return rounding.sum_of_squared_bounds(bounds)

    def _entries(self):
        return rounding.entries_per_example(self.g)

    def dots(self, vectors):
        rows = tf.gather(tf.cast(vectors[0], tf.float64), self.ids)  # [B, T, D]
        return rounding.reduce_per_example(rows * tf.cast(self.merged_rows(), tf.float64))

    def dot_errors(self, vectors):
        # sum_t |V[id_t]| |merged_t| <= |V|_F |merged| (merged rows are zero
        # at repeated ids, so each table row is met once).
        magnitude, size = tf.sqrt(self.sq_norm_bounds()), norm_of(vectors)
        return (rounding.dot_rounding(rounding.terms_per_example(self.g), magnitude, size)
                + rounding.subnormal_reading(self._entries(), magnitude + size))

    def weighted_sum(self, weights, accumulate=tf.float32):
        # w g, and 0 where w is 0 even for a row that is not finite: one pass.
        g = tf.math.multiply_no_nan(self.merged_rows(), weights[:, None, None])
        table = native_rows.scatter_rows(
            tf.reshape(self.ids, [-1]), tf.cast(tf.reshape(g, [-1, g.shape[-1]]), accumulate),
            tf.shape(self._table, out_type=tf.int32)[0])
        return [table]

    def grouped(self, k):
        return EmbeddingGrads(tf.reshape(self.ids, [tf.shape(self.ids)[0] // k, -1]),
                              joined_rows(self.g, k), self._table)

    def materialize(self):
        """[B, V, D] per-example tables (batch x vocabulary x dim floats)."""
        batch, length = tf.shape(self.g)[0], tf.shape(self.g)[1]
        example = tf.repeat(tf.range(batch), length)
        index = tf.stack([example, tf.reshape(self.ids, [-1])], axis=1)
        return [
            tf.scatter_nd(
                index,
                tf.reshape(self.merged_rows(), [-1, self.g.shape[-1]]),
                tf.concat([[batch], tf.shape(self._table)], 0),
            )
        ]


@register_rule(keras.layers.Embedding)
class EmbeddingRule:
    """Embedding lookups of ids of any shape [B, ...]."""

    def supports(self, layer):
        return plain_weights(layer)

    def call(self, layer, recorder, call, inputs, **kwargs):
        inputs = tf.convert_to_tensor(inputs)
        record = recorder.record(layer, ids=inputs)
        return record.probe("rows", call(inputs, **kwargs))

    def parts(self, layer, records):
        ids = concat_positions(
            [tf.reshape(tf.cast(r.ids, tf.int32), [tf.shape(r.ids)[0], -1]) for r in records]
        )
        dim = layer.embeddings.shape[-1]
        g = concat_positions(
            [tf.reshape(r.grads["rows"], [tf.shape(r.ids)[0], -1, dim]) for r in records]
        )
        return [EmbeddingGrads(ids, g, layer.embeddings)]
