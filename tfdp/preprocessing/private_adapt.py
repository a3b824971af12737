"""`adapt_privately`: a preprocessing layer's state from the private data, with DP.

One call replaces Keras's `layer.adapt(data)`; each layer gets a Gaussian
mechanism calibrated to (epsilon, delta) with dp_accounting's RDP
accountant (`calibrate_noise_multiplier`, one release):

- `StringLookup`, `IntegerLookup`, `TextVectorization`: the vocabulary by
  DP partition selection (`tfdp.preprocessing.partition_selection`): each
  record (or person, with `user_ids`) contributes at most
  `max_tokens_per_record` distinct tokens, each token's count gets
  Gaussian noise, and a token is kept above a threshold. delta is split in
  two: delta / 2 for the Gaussian part, and delta / 2 for the threshold
  (the probability that a token of one record alone passes), so that the
  adaptation alone is (epsilon, delta)-DP (`tfdp.accounting.additive_delta`
  derives the bound; the Gaussian part is calibrated to epsilon minus
  -log(1 - delta / 2)). TF-IDF weights come from
  the noisy counts: idf = log(1 + N / (1 + noisy count)), Keras's formula.
- `Normalization`: the mean and variance of each feature clipped to
  `value_range`, from one noisy sum of the clipped values and of their
  squares (N, the number of records or people, is public as in DP-SGD).
- `Discretization`: quantiles of a noisy histogram of the values clipped to
  `value_range` (`bins` equal bins), its `num_bins - 1` boundaries.

The release is recorded on the layer and charged to the privacy ledger of
the `DPModel` that trains it, once, at its first `fit`; the statement names
it. With `user_ids` the unit is the person (each person's records count as
one unit: their tokens pooled, or their values averaged), for a `fit` with
the same `user_ids`.

Example:

>>> import keras, numpy as np
>>> ids = np.repeat(np.arange(20), 50)            # 20 common ids, 50 records each
>>> lookup = keras.layers.IntegerLookup(name="item")
>>> entry = adapt_privately(lookup, np.append(ids, 99950), epsilon=1.0, delta=1e-6)
>>> 99950 in lookup.get_vocabulary(), len(lookup.get_vocabulary())
(False, 21)
"""

import math

import dp_accounting
import keras
import numpy as np

from tfdp.accounting import additive_delta
from tfdp.accounting.calibration import calibrate_noise_multiplier
from tfdp.data.users import UserRecords, user_codes
from tfdp.mechanisms.gaussian import numpy_normal
from tfdp.preprocessing import partition_selection, provenance
from tfdp.preprocessing.provenance import _text

_DEFAULT_HISTOGRAM_BINS = 256


def _noise_multiplier(epsilon, delta):
    """sigma of one Gaussian release (sensitivity 1) at (epsilon, delta), RDP-calibrated."""
    return calibrate_noise_multiplier(epsilon, delta, sampling_probability=1.0, steps=1)


def _check_budget(epsilon, delta):
    for name, value in (("epsilon", epsilon), ("delta", delta)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
            raise TypeError(f"Expected `{name}` to be a number. Received: {name} of type "
                            f"{type(value).__name__}")
    if not (0 < epsilon < math.inf):
        raise ValueError(
            f"Expected `epsilon` to be a finite number > 0. Received: epsilon={epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"Expected `delta` in (0, 1). Received: delta={delta}")


def _people(num_records, user_ids):
    """`UserRecords` of `user_ids` (None without), one id per record."""
    if user_ids is None:
        return None
    users = UserRecords(user_ids)  # fit's rules for ids: no float (NaN) ids, no mixed types
    if users.num_records != num_records:
        raise ValueError(
            f"Expected one user id per record ({num_records}). Received: user_ids with "
            f"{users.num_records} entries")
    return users


def _unit_codes(num_records, user_ids):
    """uint32 [units, 4]: each unit's code (`user_codes`), in `_units`' order."""
    users = _people(num_records, user_ids)
    return user_codes(np.arange(num_records)) if users is None else users.codes


def _units(num_records, user_ids):
    """Lists of record indices, one per unit (record or person)."""
    users = _people(num_records, user_ids)
    if users is None:
        return [[i] for i in range(num_records)]
    return [users.order[start:start + count].tolist()
            for start, count in zip(users.starts, users.counts)]


# -- vocabularies ------------------------------------------------------------------


def _record_tokens(layer, data):
    """Each record's tokens, as a list of lists of strings (or ints).

    A record is a row of `data`: all its values (or the tokens of all its
    texts, a title and a body) are pooled before the k-bound, so one record
    is one unit whatever its shape.
    """
    array = np.asarray(data, dtype=object if isinstance(
        layer, keras.layers.TextVectorization) else None)
    if array.ndim == 0 or not len(array):
        raise ValueError(
            f"Expected `data` to hold one row per record (shape (N,) or (N, values)). "
            f"Received: data of shape {array.shape}")
    if isinstance(layer, keras.layers.TextVectorization):
        texts = array.reshape(len(array), -1)  # (records, texts of a record)
        tokens = layer._preprocess(texts.reshape(-1))  # pylint: disable=protected-access  # Keras's split
        rows = tokens.to_list() if hasattr(tokens, "to_list") else np.asarray(tokens).tolist()
        rows = [row if isinstance(row, list) else [row] for row in rows]
        per_text = [[_text(t) for t in _flatten(row)] for row in rows]
        width = texts.shape[1]
        return [[t for text in per_text[i * width:(i + 1) * width] for t in text]
                for i in range(len(texts))]
    rows = array.reshape(len(array), -1).tolist()
    if isinstance(layer, keras.layers.StringLookup):
        return [[_text(v) for v in row] for row in rows]
    if array.dtype.kind not in "iu":
        raise TypeError(
            f"adapt_privately({layer.name!r}) takes integer ids for an IntegerLookup. "
            f"Received: data of dtype {array.dtype}")
    return [[int(v) for v in row] for row in rows]


def _flatten(row):
    for item in row:
        if isinstance(item, list):
            yield from _flatten(item)
        else:
            yield item


def _special_tokens(layer):
    lookup = getattr(layer, "_lookup_layer", layer)
    special = {lookup.oov_token, lookup.mask_token}
    if isinstance(layer, keras.layers.TextVectorization):
        special.add("")
    return {t for t in special if t is not None}


def _vocabulary(layer, data, epsilon, delta, max_tokens_per_record, user_ids, rng):
    records = _record_tokens(layer, data)
    if max_tokens_per_record is None and not isinstance(layer, keras.layers.TextVectorization):
        max_tokens_per_record = max(1, np.asarray(data).reshape(len(records), -1).shape[1])
    if max_tokens_per_record is None:
        raise ValueError(
            f"adapt_privately({layer.name!r}) needs `max_tokens_per_record`, k: each record "
            "(or person) contributes at most k distinct tokens to the vocabulary (the noise "
            "grows as sqrt(k)). Received: max_tokens_per_record=None")
    k = max_tokens_per_record
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"Expected `max_tokens_per_record` to be an int >= 1. "
                         f"Received: max_tokens_per_record={k!r}")
    units = _units(len(records), user_ids)
    special = _special_tokens(layer)
    unit_tokens = [[t for i in unit for t in records[i] if t not in special] for unit in units]
    delta_threshold = delta / 2
    # eps_acc(delta / 2) + additive_delta.shift(delta / 2) <= epsilon: alone, (epsilon, delta)-DP.
    sigma = _noise_multiplier(epsilon - additive_delta.shift(delta_threshold), delta / 2)
    noise_std = sigma * math.sqrt(k)
    cut = partition_selection.threshold(noise_std, k, delta_threshold)
    # Each unit's k-sample from its own stream, keyed by the fresh secret key and the unit's
    # code (a record's: its position in `data`, not a stable id, so removing record 0 moves
    # every later key; a person's: its id), the noise from another stream. The law is the
    # same either way: under a fresh key each unit's sample is uniform and independent of
    # the others', whichever code it gets (docs/guides/private-preprocessing.md).
    sample_key = int(rng.integers(2**63))
    noise_rng = np.random.default_rng(rng.integers(2**63))
    codes = _unit_codes(len(records), user_ids)
    counts = partition_selection.bounded_counts(zip(codes.tolist(), unit_tokens), k, sample_key)
    kept = partition_selection.select(counts, noise_std, cut, noise_rng)
    lookup = getattr(layer, "_lookup_layer", layer)
    limit = lookup.max_tokens
    vocabulary = list(kept)
    if limit is not None:
        special = lookup._token_start_index()  # pylint: disable=protected-access
        vocabulary = vocabulary[:max(0, limit - special)]
    if not vocabulary:  # Keras cannot hold an empty vocabulary
        provenance.note_release(layer, dp_accounting.GaussianDpEvent(sigma), delta_threshold,
                                "record" if user_ids is None else "person")
        raise ValueError(
            f"No token of {layer.name!r} passed the partition selection threshold "
            f"({cut:.4g} records or people; the largest count is below it with this noise): "
            f"the data is too small for epsilon={epsilon:g}, delta={delta:g}, k={k}. This "
            "attempt's release waits on the layer and is charged, with the layer's next "
            "adaptation or declaration, to the model that trains it: a second attempt on the "
            "same data spends its budget again. Raise epsilon, lower max_tokens_per_record, "
            "or adapt the layer on public data and declare it with "
            "tfdp.preprocessing.declare_public.")
    idf = None
    if lookup.output_mode == "tf_idf":
        noisy = np.asarray([kept[t] for t in vocabulary], np.float64)
        idf = np.log1p(len(units) / (1.0 + noisy))
    layer.set_vocabulary(vocabulary, idf_weights=idf)
    source = (
        f"DP partition selection: at most {k} distinct token(s) per "
        f"{'person' if user_ids is not None else 'record'}, Gaussian noise of standard "
        f"deviation {noise_std:.4g} on the counts (noise multiplier {sigma:.4g}), threshold "
        f"{cut:.4g} (delta {delta_threshold:.3g} that a token of one "
        f"{'person' if user_ids is not None else 'record'} alone passes)"
        + ("; TF-IDF weights from the noisy counts" if idf is not None else ""))
    return sigma, delta_threshold, source


# -- numbers -------------------------------------------------------------------------


def _value_range(layer, value_range, features):
    if value_range is None:
        raise ValueError(
            f"adapt_privately({layer.name!r}) needs `value_range=(low, high)`: values are "
            "clipped to it, which bounds one record's effect (declare it from what the "
            "feature means, not from the private data). Received: value_range=None")
    try:
        low, high = (np.broadcast_to(np.asarray(v, np.float64), (features,)) for v in value_range)
    except (TypeError, ValueError):
        raise ValueError(
            "Expected `value_range` to be (low, high), numbers or one per feature "
            f"({features}). Received: value_range={value_range!r}") from None
    if not (np.all(np.isfinite(low)) and np.all(np.isfinite(high)) and np.all(high > low)):
        raise ValueError(f"Expected finite `value_range` with high > low. "
                         f"Received: value_range={value_range!r}")
    return low, high


def _numbers(layer, data):
    """`data` as float64 (N, features); never shows a value in an error."""
    try:
        array = np.asarray(data, np.float64)
    except (TypeError, ValueError):
        raise TypeError(
            f"adapt_privately({layer.name!r}) takes numbers. Received: data of dtype "
            f"{np.asarray(data).dtype}") from None
    if array.ndim == 1:
        array = array[:, None]
    if array.ndim != 2 or not len(array):
        raise ValueError(
            f"adapt_privately({layer.name!r}) takes a table of shape (N,) or (N, features). "
            f"Received: data of shape {array.shape}")
    return array


def _normalization(layer, data, epsilon, delta, value_range, user_ids, rng):
    if layer.input_mean is not None:
        raise ValueError(
            f"Layer {layer.name!r} was built with a mean and variance, so there is nothing to "
            "adapt: build it as keras.layers.Normalization() to adapt it privately, or declare "
            "its constants public with tfdp.preprocessing.declare_public(layer, source=...).")
    if tuple(layer.axis) not in ((-1,), (1,)):
        raise ValueError(
            f"adapt_privately adapts a Normalization over the last axis of (N, features) "
            f"data. Received: axis={layer.axis}")
    x = _numbers(layer, data)
    low, high = _value_range(layer, value_range, x.shape[1])
    center, radius = (low + high) / 2, (high - low) / 2
    x = np.where(np.isnan(x), center, x)                     # NaN: the centre, never NaN out
    z = (np.clip(x, low, high) - center) / radius            # in [-1, 1]
    units = _units(len(x), user_ids)
    parts = np.stack([np.concatenate([z[u].mean(0), (2 * z[u] ** 2 - 1).mean(0)]) for u in units])
    sigma = _noise_multiplier(epsilon, delta)
    sensitivity = math.sqrt(parts.shape[1])                   # 2d coordinates in [-1, 1]
    noisy = (parts.sum(0) + numpy_normal(rng, sigma * sensitivity, parts.shape[1])) / len(units)
    features = x.shape[1]
    mean_z = np.clip(noisy[:features], -1.0, 1.0)
    square_z = np.clip((noisy[features:] + 1) / 2, 0.0, 1.0)
    variance = np.maximum(square_z - mean_z ** 2, 1e-6) * radius ** 2
    if not layer.built:
        layer.build((None, features))
    layer.adapt_mean.assign(center + radius * mean_z)
    layer.adapt_variance.assign(variance)
    layer.finalize_state()
    source = (f"Gaussian mechanism on the sums of features clipped to the declared range and "
              f"of their squares (noise multiplier {sigma:.4g}, L2 sensitivity "
              f"{sensitivity:.4g})")
    return sigma, 0.0, source


def _discretization(layer, data, epsilon, delta, value_range, user_ids, rng, bins):
    if layer.num_bins is None:
        raise ValueError(
            f"Layer {layer.name!r} was built with bin_boundaries, so there is nothing to adapt: "
            "build it with num_bins=... to adapt it privately, or declare its boundaries "
            "public with tfdp.preprocessing.declare_public(layer, source=...).")
    x = _numbers(layer, data)
    low, high = _value_range(layer, value_range, 1)
    edges = np.linspace(low[0], high[0], bins + 1)
    index = np.clip(np.searchsorted(edges, np.clip(x, low[0], high[0]), side="right") - 1, 0,
                    bins - 1)
    histogram = np.zeros(bins)
    for unit in _units(len(x), user_ids):
        np.add.at(histogram, index[unit].ravel(), 1.0 / len(unit))
    per_unit = x.shape[1]                                     # values a unit adds, in all
    sigma = _noise_multiplier(epsilon, delta)
    noisy = np.maximum(histogram + numpy_normal(rng, sigma * per_unit, bins), 0.0)
    cumulative = np.cumsum(noisy)
    quantiles = np.arange(1, layer.num_bins) / layer.num_bins
    if cumulative[-1] <= 0:
        boundaries = low[0] + quantiles * (high[0] - low[0])
    else:
        boundaries = edges[1:][np.searchsorted(cumulative, quantiles * cumulative[-1])]
    layer.bin_boundaries = [float(b) for b in boundaries]
    source = (f"quantiles of a noisy histogram ({bins} bins over the declared range, Gaussian "
              f"noise multiplier {sigma:.4g}, L2 sensitivity {per_unit})")
    return sigma, 0.0, source


def adapt_privately(layer, data, epsilon, delta, max_tokens_per_record=None, value_range=None,
                    user_ids=None, bins=_DEFAULT_HISTOGRAM_BINS, seed=None):
    """Adapts a preprocessing layer on private data with (epsilon, delta)-DP.

    Use it instead of `layer.adapt(data)`: the layer's state is set from
    a Gaussian mechanism (see the module docstring for each layer), and the
    release is charged to the privacy ledger of the `tfdp.DPModel` that
    holds the layer at its first `fit` (its statement names it).

    Args:
        layer: a `StringLookup`, `IntegerLookup`, `TextVectorization`,
            `Normalization` or `Discretization` layer.
        data: the private records, one row per record: texts (N,) or
            (N, texts) for `TextVectorization` (a record's texts, a title
            and a body, pooled into one unit); values (N,) or (N, values)
            for the lookups; numbers (N,) or (N, features) otherwise.
        epsilon: the adaptation's epsilon, a finite number > 0.
        delta: its delta, in (0, 1).
        max_tokens_per_record: k, for vocabularies: the most distinct
            tokens a record (or person) contributes (a unit with more
            contributes a random k of them). Required for
            `TextVectorization`; for a lookup it defaults to the number of
            values per record (1 for data of shape (N,)).
        value_range: (low, high), for `Normalization` (numbers or one per
            feature) and `Discretization`: values are clipped to it.
            Declare it from what the feature means, not from the data.
        user_ids: optional, one id per record: protect people instead of
            records, for a `fit` with the same user_ids (the same grouping
            of records into people: `fit` refuses another; a `fit`
            without user_ids accepts it, since a person-level guarantee
            protects each record too).
        bins: `Discretization`'s histogram resolution (default 256).
        seed: optional int for the noise, for tests and reproductions
            only (default: fresh randomness). A known seed makes the noise
            known: the released state then gives the exact counts back and
            reveals membership, whatever epsilon. The statement names a
            seeded adaptation.

    Returns:
        The provenance entry (a dict) that `fit` writes in the ledger.

    Raises:
        TypeError, ValueError: for an unsupported layer or an argument out
            of range, naming it.

    Example:

    >>> import keras, numpy as np
    >>> age = keras.layers.Normalization(name="age")
    >>> ages = np.random.default_rng(0).uniform(20, 60, size=(1000, 1))
    >>> entry = adapt_privately(age, ages, epsilon=1.0, delta=1e-6, value_range=(0, 100))
    >>> bool(abs(age.adapt_mean.numpy()[0] - 40) < 2)
    True
    """
    provenance.refuse_inside_search(layer)  # before any noise is drawn
    _check_budget(epsilon, delta)
    rng = np.random.default_rng(seed)
    unit = "record" if user_ids is None else "person"
    if isinstance(layer, provenance._VOCABULARY_LAYERS):  # pylint: disable=protected-access
        sigma, additive, source = _vocabulary(
            layer, data, epsilon, delta, max_tokens_per_record, user_ids, rng)
    elif isinstance(layer, keras.layers.Normalization):
        sigma, additive, source = _normalization(
            layer, data, epsilon, delta, value_range, user_ids, rng)
    elif isinstance(layer, keras.layers.Discretization):
        sigma, additive, source = _discretization(
            layer, data, epsilon, delta, value_range, user_ids, rng, bins)
    else:
        raise TypeError(
            "adapt_privately adapts StringLookup, IntegerLookup, TextVectorization, "
            f"Normalization and Discretization layers. Received: layer {layer.name!r} of type "
            f"{type(layer).__name__} (declare its state public with "
            "tfdp.preprocessing.declare_public if it came from public data)")
    source += f"; epsilon {epsilon:g}, delta {delta:g} for this adaptation alone"
    if seed is not None:  # the statement says so: the guarantee holds only if it stays secret
        source += (". Seeded (seed= given): reproducible, its noise known to anyone who knows "
                   "the seed, so private only while the seed stays secret")
    partition = None if user_ids is None else provenance.partition_digest(UserRecords(user_ids))
    return provenance.register_private(
        layer, source, unit, dp_accounting.GaussianDpEvent(sigma), additive,
        partition=partition)
