"""Sparse noise for large embedding tables: noise only on privately selected rows.

DP-SGD noises every coordinate of the gradient, and an embedding table of
V rows x d columns draws V * d normals a step even when a batch looks up a
few thousand rows. Following DP-AdaFEST (Zhang et al. 2023, arXiv
2311.08357) and tensorflow-privacy's sparsity-preserving noise, a table set
to `SparseNoise` is updated on a private selection of rows instead:

1. Contribution counts. Each unit (a record, or a person with `user_ids`)
   puts weight w = min(1, sqrt(k / n)) (rounded down) on each of the n
   distinct rows its lookups touch, so its count vector has L2 norm
   sqrt(n) w <= sqrt(k)
   (`max_rows_per_example` = k). Summed over the sampled units: c in R^V.
2. Selection. c + N(0, (sigma_c sqrt(k))^2 I_V), noise on all V rows
   (V normals, not V * d); the rows whose noisy count exceeds `threshold`
   are selected. No row is selected without its noise, so a row that one
   unit alone touched is selected with the Gaussian's probability, never
   for sure: there is no additive delta.
3. Gradient. The clipped sum restricted to the selected rows gets noise
   N(0, (sigma_g C)^2) on those rows only; the other rows' gradient is
   exactly 0. Every other variable gets its noise as in DP-SGD.

Privacy (docs/mechanisms/sparse-embeddings.md has the derivation). Adding
one unit moves the clipped sum by at most C and each table's count vector
by at most sqrt(k). Scaled by its noise, the step's pair (noisy sum, noisy
counts) is one Gaussian mechanism of unit noise and L2 sensitivity
sqrt(sigma_g^-2 + sum_tables sigma_c^-2); both draws happen in the same
Poisson-sampled step, and the released update (selected rows, noisy sum on
them) is a function of the pair. So the step is a Poisson-sampled Gaussian
of noise multiplier z = (sigma_g^-2 + sum sigma_c^-2)^(-1/2): the
optimizer's `noise_multiplier` is z, the ledger charges `dpsgd_event(z, q)`
as for DP-SGD, and the gradient's own multiplier is raised to
sigma_g = (z^-2 - sum sigma_c^-2)^(-1/2) to pay for the selections (as
adaptive clipping pays for its count).

Example:

>>> setting = SparseNoise(selection_noise_multiplier=4.0, threshold=2.0)
>>> round(gradient_noise_multiplier(1.0, [setting]), 4)    # (1 - 1/16)^(-1/2)
1.0328
"""

import math

import keras
import tensorflow as tf

from tfdp.mechanisms.gaussian import fold_seed, normals

# Streams of a step's noise key (distinct from the per-tensor indices of
# `dpsgd.gaussian_noise_like` and from adaptive clipping's COUNT_STREAM);
# table n's streams are these keys folded again with n, so no number of
# tables makes one table's selection share a key with another's rows.
SELECTION_STREAM = 2**31 - 1024
ROWS_STREAM = 2**31 - 512
_GRID = 2.0**12  # count weights are multiples of 2^-12 (exact float64 sums)


class SparseNoise:
    """One embedding table's sparse-noise setting (`DPOptimizer(sparse_embeddings=...)`).

    Args:
        selection_noise_multiplier: sigma_c > 0: the noise on each row's
            contribution count has standard deviation sigma_c * sqrt(k). It
            must exceed the optimizer's `noise_multiplier` z (the gradient's
            multiplier becomes (z^-2 - sigma_c^-2)^(-1/2)); 3 to 5 times z
            costs the gradient 6% to 2% more noise.
        threshold: a row is updated when its noisy count exceeds this (a
            finite number; in units of the count, about "how many sampled
            records looked it up").
        max_rows_per_example: k >= 1 (default 64): a unit touching n > k
            distinct rows counts sqrt(k / n) on each, so its count vector
            has L2 norm at most sqrt(k).

    Example:

    >>> SparseNoise(selection_noise_multiplier=5.0, threshold=3.0).count_stddev()
    40.0
    """

    def __init__(self, selection_noise_multiplier, threshold, max_rows_per_example=64):
        self.selection_noise_multiplier = _positive_finite(
            "selection_noise_multiplier", selection_noise_multiplier)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
                math.isfinite(threshold)):
            raise ValueError(
                "Expected `threshold` to be a finite number (a count a row's noisy count must "
                f"exceed). Received: threshold={threshold!r}")
        self.threshold = float(threshold)
        if isinstance(max_rows_per_example, bool) or not isinstance(
                max_rows_per_example, int) or max_rows_per_example < 1:
            raise ValueError(
                "Expected `max_rows_per_example` to be an int >= 1. Received: "
                f"max_rows_per_example={max_rows_per_example!r}")
        self.max_rows_per_example = max_rows_per_example

    def count_stddev(self):
        """sigma_c * sqrt(k), the noise on each row's count."""
        return self.selection_noise_multiplier * math.sqrt(self.max_rows_per_example)

    def get_config(self):
        return {"selection_noise_multiplier": self.selection_noise_multiplier,
                "threshold": self.threshold,
                "max_rows_per_example": self.max_rows_per_example}

    def __repr__(self):
        return f"SparseNoise({', '.join(f'{k}={v!r}' for k, v in self.get_config().items())})"


def _positive_finite(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"Expected `{name}` to be a finite number > 0. Received: {name}={value!r}")
    return float(value)


def check_settings(sparse_embeddings):
    """Validates `DPOptimizer(sparse_embeddings=...)`; returns a dict or None."""
    if sparse_embeddings is None:
        return None
    if not isinstance(sparse_embeddings, dict) or not sparse_embeddings:
        raise TypeError(
            "Expected `sparse_embeddings` to be a non-empty dict {embedding layer name: "
            f"tfdp.optimizers.SparseNoise(...)}}. Received: sparse_embeddings={sparse_embeddings!r}")
    for name, setting in sparse_embeddings.items():
        if not isinstance(name, str) or not isinstance(setting, SparseNoise):
            raise TypeError(
                "Expected `sparse_embeddings` to map layer names (str) to "
                f"tfdp.optimizers.SparseNoise. Received: {name!r}: {setting!r}")
    return dict(sparse_embeddings)


def gradient_noise_multiplier(noise_multiplier, settings):
    """sigma_g = (z^-2 - sum sigma_c^-2)^(-1/2): the gradient's multiplier
    when the step's z also pays for the selections.

    Raises:
        ValueError: if sum sigma_c^-2 >= z^-2 (no noise left for the gradient).
    """
    left = noise_multiplier ** -2 - sum(s.selection_noise_multiplier ** -2 for s in settings)
    if left <= 0:
        raise ValueError(
            "Each `SparseNoise.selection_noise_multiplier` sigma_c must leave noise for the "
            "gradient: the step's noise_multiplier z pays for both, "
            "z^-2 = sigma_g^-2 + sum sigma_c^-2, so sum sigma_c^-2 < z^-2 is needed "
            "(sigma_c 3 to 5 times z is typical). Received: noise_multiplier="
            f"{noise_multiplier!r}, selection_noise_multipliers="
            f"{[s.selection_noise_multiplier for s in settings]}")
    return left ** -0.5


def resolve_tables(sparse_embeddings, model):
    """{id(table variable): (layer name, setting)} for `model`, or refuses.

    Refused before the first step: a name that is no layer of the model, a
    layer that is not a plain float32 `keras.layers.Embedding` (no LoRA, no
    quantization), and a table another layer also reads (tied embeddings:
    its gradient has rows the lookups do not explain).
    """
    from tfdp.per_example.rules.common import plain_weights

    tables = {}
    layers = list(model._flatten_layers(include_self=False))
    for name, setting in sparse_embeddings.items():
        matches = [layer for layer in layers if layer.name == name]
        if not matches:
            raise ValueError(
                f"`sparse_embeddings` names layer {name!r}, which the model does not have. "
                f"Its embedding layers: {[l.name for l in layers if isinstance(l, keras.layers.Embedding)]}")
        if len(matches) > 1:
            raise ValueError(
                f"`sparse_embeddings` names layer {name!r}, which {len(matches)} layers of the "
                "model (in nested models) are called: give the Embedding a unique name.")
        layer = matches[0]
        if type(layer) is not keras.layers.Embedding:
            raise ValueError(
                f"`sparse_embeddings` applies to keras.layers.Embedding only (its gradient has "
                f"rows at the looked-up ids alone); layer {name!r} is a {type(layer).__name__} "
                "(a subclass such as ReversibleEmbedding may read its table elsewhere, as a "
                "tied output projection). Remove it from `sparse_embeddings`.")
        if not plain_weights(layer):
            raise ValueError(
                f"`sparse_embeddings` needs a float32 Embedding without LoRA or quantization: "
                f"layer {name!r} reads other weights than its table. Remove it from "
                "`sparse_embeddings`.")
        table = layer.embeddings
        readers = [other.name for other in layers if other is not layer
                   and not other._flatten_layers(include_self=False)  # leaves only
                   and any(w is table for w in other.weights)]
        if readers or not table.trainable:
            raise ValueError(
                f"`sparse_embeddings` cannot take layer {name!r}: its table is "
                + (f"also read by {readers} (tied embeddings: those reads give gradient rows "
                   "outside the looked-up ids, which a selection by lookups would drop)"
                   if readers else "not trainable")
                + ". Remove it from `sparse_embeddings`.")
        tables[id(table)] = (name, setting)
    return tables


def contribution_counts(part, mask, max_rows, vocabulary):
    """c in R^V: each unit's weight w <= min(1, sqrt(k / n)) on its n distinct rows.

    Exact arithmetic, so the sensitivity is sqrt(k) as computed, not up to
    rounding: w is sqrt(k / n) rounded down to a multiple of 2^-12 (so
    n w^2 <= k holds for the value used), and the counts are float64 sums
    of multiples of 2^-12, exact below 2^41.

    Args:
        part: the table's `EmbeddingGrads` (ids [B, T], grouped per unit).
        mask: float [B], 0 on padding units (1 elsewhere).
        max_rows: k.
        vocabulary: V.

    Returns:
        float64 [V].
    """
    first = tf.cast(part.first_occurrences(), tf.float64)  # [B, T]
    distinct = tf.reduce_sum(first, axis=1)
    ratio = tf.sqrt(float(max_rows) / tf.maximum(distinct, 1.0))
    weight = tf.minimum(tf.floor(ratio * _GRID) / _GRID, 1.0) * tf.cast(mask > 0, tf.float64)
    return tf.scatter_nd(tf.reshape(part.ids, [-1, 1]),
                         tf.reshape(first * weight[:, None], [-1]), [vocabulary])


def selected_rows(counts, setting, seed):
    """bool [V]: the rows whose count plus N(0, (sigma_c sqrt(k))^2) exceeds the threshold."""
    noise = normals([tf.shape(counts)], [seed], [counts.dtype], stddev=setting.count_stddev())[0]
    return counts + noise > setting.threshold


def noisy_rows(row_sum, selected, stddev, seed, static_shapes=False, divisor=1.0):
    """The table's noisy mean: (the clipped sum plus N(0, stddev^2)) / divisor
    on the selected rows, exactly 0 on the others.

    Normals are drawn for the selected rows only, and the [V, d] table is
    written once (a scatter into zeros). With `static_shapes` (XLA, which
    compiles no data-dependent shape) they are drawn for every row and
    masked: the same law on the selected rows, zeros elsewhere, without the
    saving.
    """
    if static_shapes:
        noise = normals([tf.shape(row_sum)], [seed], [row_sum.dtype], stddev=stddev)[0]
        mask = tf.cast(selected, row_sum.dtype)[:, None]
        return (row_sum + noise) * mask / tf.cast(divisor, row_sum.dtype)
    rows = tf.where(selected)  # [m, 1] int64
    picked = tf.gather_nd(row_sum, rows)  # [m, d]
    noise = normals([tf.shape(picked)], [seed], [row_sum.dtype], stddev=stddev)[0]
    return tf.scatter_nd(rows, (picked + noise) / tf.cast(divisor, row_sum.dtype),
                         tf.shape(row_sum, out_type=tf.int64))


def table_part(per_example, table, layer_name):
    """The `EmbeddingGrads` part that holds `table` alone, or refuses."""
    from tfdp.per_example.rules.embedding import EmbeddingGrads

    holders = [part for part in per_example.parts
               if any(v is table for v in part.variables)]
    if len(holders) != 1 or not isinstance(holders[0], EmbeddingGrads):
        kinds = [type(p).__name__ for p in holders]
        raise ValueError(
            f"`sparse_embeddings` layer {layer_name!r}: its per-example gradients come from "
            f"{kinds}, not from the Embedding rule's lookups alone (a fallback per-example "
            "path, or a table another layer reads), so its touched rows are unknown. Remove it "
            "from `sparse_embeddings`.")
    return holders[0]


def sparse_noisy_means(sums, variables, per_example, mask, tables, noise_multiplier,
                       clip_stddev_of, dense_noise, seed, static_shapes=False, divisor=1.0):
    """The step's noisy means with sparse tables.

    Args:
        sums: clipped sums aligned with `variables`.
        variables: the trainable variables.
        per_example: the step's `PerExampleGradients` (per unit).
        mask: float [B] of units.
        tables: from `resolve_tables`.
        noise_multiplier: z, the step's (the ledger's) noise multiplier.
        clip_stddev_of: sigma -> the noise std on the sum at multiplier sigma.
        dense_noise: (list of sums, std) -> list of noisy means (DP-SGD's
            draw, divided by b).
        seed: the step's noise seed.
        static_shapes: True under XLA (`noisy_rows`).
        divisor: b, the expected batch size (the sparse tables' mean).

    Returns:
        (noisy means aligned with `variables`, {variable index: selected [V] bool}).
    """
    settings = [setting for _, setting in tables.values()]
    stddev = clip_stddev_of(gradient_noise_multiplier(noise_multiplier, settings))
    sparse = [i for i, v in enumerate(variables) if id(v) in tables]
    dense = [i for i in range(len(variables)) if id(variables[i]) not in tables]
    out = [None] * len(variables)
    for i, noisy in zip(dense, dense_noise([sums[i] for i in dense], stddev)):
        out[i] = noisy
    selections = {}
    for n, i in enumerate(sparse):
        name, setting = tables[id(variables[i])]
        part = table_part(per_example, variables[i], name)
        counts = contribution_counts(part, mask, setting.max_rows_per_example,
                                     variables[i].shape[0])
        selected = selected_rows(counts, setting, fold_seed(fold_seed(seed, SELECTION_STREAM), n))
        out[i] = noisy_rows(sums[i], selected, stddev, fold_seed(fold_seed(seed, ROWS_STREAM), n),
                            static_shapes, divisor)
        selections[i] = selected
    return out, selections
