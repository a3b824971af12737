"""Rule for ReversibleEmbedding: a token table that is also the output layer.

`layer(ids)` looks rows up (as Embedding: `EmbeddingGrads`); `layer(h,
reverse=True)` projects hidden states to logits Z = h E^T (soft-capped after,
if set), a linear map whose per-example gradient is G_i^T h_i (`LinearGrads`
on the transposed table). With tied weights (the default) both uses update
the SAME table, so example i's gradient is the sum of the two, and its
squared norm has a cross term: `TiedGrads`. The cross term needs only the
output gradient's columns at the example's own token ids, never a per-example
[vocabulary, dim] tensor.

Example:

>>> import keras, tensorflow as tf
>>> from tfdp.per_example.recorder import Recorder
>>> layer = keras.layers.ReversibleEmbedding(7, 3)
>>> layer.build((None, 4))
>>> rule = ReversibleEmbeddingRule()
>>> with tf.GradientTape() as tape:
...     recorder = Recorder(tape)
...     with recorder.hooked([(layer, rule)]):
...         logits = layer(layer(tf.constant([[1, 2, 2, 5]])), reverse=True)
...     total = tf.reduce_sum(logits ** 2)
>>> recorder.compute_gradients(total)
>>> [type(p).__name__ for p in rule.parts(layer, recorder.records_of(layer))]
['TiedGrads']
"""

import keras
import tensorflow as tf

from tfdp.per_example import rounding
from tfdp.per_example.grads import OFFSET_SPREAD, LinearGrads, Part
from tfdp.per_example.patches import as_rows
from tfdp.per_example.registry import ALLOWED, register_rule
from tfdp.per_example.rules.common import concat_positions, plain_weights
from tfdp.per_example.rules.embedding import EmbeddingGrads


class TiedGrads(Part):
    """One table's per-example gradients from a lookup and a projection.

    Example i's gradient is L_i + P_i, the lookup's merged rows and the
    projection's G_z^T h; its squared norm |L|^2 + |P|^2 + 2 <L, P> is bounded
    term by term, the cross term with its rounding (a record whose lookup
    and projection gradients cancel is clipped by the bound).

    Args:
        lookup: `EmbeddingGrads` of the table's lookups (ids [B, T], G [B, T, D]).
        projection: `LinearGrads` of Z = h E^T (h [B, S, D], G_z [B, S, V]).
    """

    def __init__(self, lookup, projection):
        self.lookup = lookup
        self.projection = projection
        self.variables = lookup.variables

    def _cross(self):
        """[B] <L_i, P_i> in float64: the projection's gradient rows at
        example i's ids (sum_s G_z[i, s, id] h[i, s]) against the lookup's
        merged rows, and a bound on its rounding (and on the gap between P_i's
        factors and its materialized matrix, when the projection materializes
        it): sum_{t,d} |L_td| sum_s |G_z[s, id_t]| |h_sd| <= |L| sum_s |h_s| |G_z,s|;
        plus the subnormal readings of L (times |P|) and of h and G_z (times
        |L|, the projection's own reading bound)."""
        merged = tf.cast(self.lookup.merged_rows(), tf.float64)
        columns = tf.gather(self.projection.g, self.lookup.ids, axis=2, batch_dims=1)  # [B, S, T]
        rows = tf.einsum("bst,bsd->btd", tf.cast(columns, tf.float64),
                         tf.cast(self.projection.x, tf.float64))
        cross = rounding.reduce_per_example(rows * merged)
        terms = 2 * self.projection.x.shape[1] + rounding.terms_per_example(merged)
        lookup_size = tf.sqrt(self.lookup.sq_norm_bounds())
        error = (rounding.dot_rounding(terms, lookup_size, self.projection.mass())
                 + rounding.subnormal_reading(rounding.terms_per_example(merged),
                                              self.projection.mass())
                 + lookup_size * self.projection.summation_errors())
        return cross, error

    def sq_norm_bounds(self):
        cross, error = self._cross()
        total = self.lookup.sq_norm_bounds() + self.projection.sq_norm_bounds()
        # The two tables are summed apart across examples: keep each
        # example's separate pieces within OFFSET_SPREAD of the bound, as for
        # weight-decay offsets (`PerExampleGradients.norm_bounds`).
        sizes = tf.sqrt(self.lookup.sq_norm_bounds()) + tf.sqrt(self.projection.sq_norm_bounds())
        return tf.maximum(total + 2.0 * (cross + error), tf.square(sizes / OFFSET_SPREAD))

    def summation_errors(self):
        # The two tables are summed apart and then added: one more rounding
        # of |L| + |P|.
        sizes = tf.sqrt(self.lookup.sq_norm_bounds()) + tf.sqrt(self.projection.sq_norm_bounds())
        return (self.projection.summation_errors() + self.lookup.summation_errors()
                + 2.0 * rounding.gamma(1) * sizes)

    def absolute_errors(self):
        return self.lookup.absolute_errors() + self.projection.absolute_errors()

    def dots(self, vectors):
        return self.lookup.dots(vectors) + self.projection.dots(vectors)

    def dot_errors(self, vectors):
        return self.lookup.dot_errors(vectors) + self.projection.dot_errors(vectors)

    def weighted_sum(self, weights, accumulate=tf.float32):
        return [a + b for a, b in zip(self.lookup.weighted_sum(weights, accumulate),
                                      self.projection.weighted_sum(weights, accumulate))]

    def materialize(self):
        return [a + b for a, b in zip(self.lookup.materialize(), self.projection.materialize())]

    def grouped(self, k):
        return TiedGrads(self.lookup.grouped(k), self.projection.grouped(k))


# Lookups and x E^T per example: keeps examples independent.
ALLOWED.add(keras.layers.ReversibleEmbedding)


@register_rule(keras.layers.ReversibleEmbedding)
class ReversibleEmbeddingRule:
    """Lookups and reverse projections of a float32 ReversibleEmbedding."""

    def supports(self, layer):
        return plain_weights(layer) and layer.reverse_dtype in (None, "float32")

    def call(self, layer, recorder, call, inputs, reverse=False, **kwargs):
        inputs = tf.convert_to_tensor(inputs)
        if not reverse:
            record = recorder.record(layer, ids=inputs)
            return record.probe("rows", call(inputs, **kwargs))
        record = recorder.record(layer, h=inputs)
        kernel = tf.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
        logits = record.probe("z", keras.ops.matmul(inputs, kernel))
        if layer.logit_soft_cap is not None:
            cap = layer.logit_soft_cap
            logits = keras.ops.multiply(keras.ops.tanh(keras.ops.divide(logits, cap)), cap)
        return logits

    def parts(self, layer, records):
        lookups = [r for r in records if "ids" in r.values]
        projections = [r for r in records if "h" in r.values]
        lookup = projection = None
        if lookups:
            dim = layer.embeddings.shape[-1]
            ids = concat_positions(
                [tf.reshape(tf.cast(r.ids, tf.int32), [tf.shape(r.ids)[0], -1]) for r in lookups])
            g = concat_positions(
                [tf.reshape(r.grads["rows"], [tf.shape(r.ids)[0], -1, dim]) for r in lookups])
            lookup = EmbeddingGrads(ids, g, layer.embeddings)
        if projections:
            h = concat_positions([as_rows(r.h) for r in projections])
            g = concat_positions([as_rows(r.grads["z"]) for r in projections])
            if layer.tie_weights:
                projection = LinearGrads(h, g, layer.embeddings, kernel_perm=[1, 0])
            else:
                projection = LinearGrads(h, g, layer.reverse_embeddings)
        if lookup is not None and projection is not None and layer.tie_weights:
            return [TiedGrads(lookup, projection)]
        return [p for p in (lookup, projection) if p is not None]
