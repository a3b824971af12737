"""Private adaptation: each term of the bound, and crafted records.

DP partition selection's threshold (against scipy's independent quantile
and a brute-force frequency, with a negative control that forgets the k
tokens), the threshold's delta in the ledger (a test that fails when it is
dropped), the Gaussian part composed with DP-SGD, and for each layer a
crafted record whose raw value the adapted state must not reveal beyond
its noise.
"""

import json
import math

import dp_accounting
import keras
import mpmath
import numpy as np
import pytest
from scipy import stats

from tfdp import preprocessing
from tfdp.accounting import PrivacyLedger, _engine, dpsgd_event
from tfdp.preprocessing import partition_selection, provenance

DELTA = 1e-5


@pytest.mark.parametrize("noise_std,k,delta", [(1.0, 1, 1e-6), (3.5, 4, 1e-9), (20.0, 30, 1e-5)])
def test_the_threshold_is_the_gaussian_quantile_of_the_per_token_probability(noise_std, k, delta):
    with mpmath.workdps(50):  # p to 50 digits, then scipy's quantile: an independent route
        p = float(1 - (1 - mpmath.mpf(delta)) ** (mpmath.mpf(1) / k))
    expected = 1 + noise_std * stats.norm.isf(p - 2.0**-32)  # the generator's tail excess
    assert partition_selection.threshold(noise_std, k, delta) == pytest.approx(expected, rel=1e-9)


def lone_unit_pass_frequency(cut, noise_std, k, trials=200_000, seed=0):
    """How often any of one unit's k lone tokens (count 1) passes `cut`."""
    noise = np.random.default_rng(seed).normal(0.0, noise_std, size=(trials, k))
    return np.mean(np.any(1.0 + noise > cut, axis=1))


def test_a_lone_unit_passes_with_probability_delta_threshold_and_a_per_token_threshold_fails():
    noise_std, k, delta = 2.0, 3, 0.05  # large delta: measurable by counting
    cut = partition_selection.threshold(noise_std, k, delta)
    frequency = lone_unit_pass_frequency(cut, noise_std, k)
    assert abs(frequency - delta) < 4 * math.sqrt(delta * (1 - delta) / 200_000)
    # Negative control: a threshold that forgets the unit's k tokens (k = 1).
    naive = partition_selection.threshold(noise_std, 1, delta)
    assert lone_unit_pass_frequency(naive, noise_std, k) > 2.5 * delta


def test_each_unit_contributes_at_most_k_distinct_tokens():
    units = [["a", "a", "b", "c", "d"], ["a"], ["b", "e"]]
    counts = partition_selection.bounded_counts(
        [((i,), tokens) for i, tokens in enumerate(units)], 2, key=0)
    assert sum(counts.values()) == 2 + 1 + 2
    assert counts["a"] >= 1


def _samples(units, key):
    """Which tokens each unit contributes (k = 2), one unit at a time."""
    return {code: set(partition_selection.bounded_counts([(code, tokens)], 2, key))
            for code, tokens in units}


def test_removing_one_unit_leaves_the_other_units_samples_alone():
    units = [((i, 0), [f"t{i}-{j}" for j in range(6)]) for i in range(40)]
    counts = partition_selection.bounded_counts(units, 2, key=5)
    without_first = partition_selection.bounded_counts(units[1:], 2, key=5)
    assert set(without_first) == set(counts) - set(_samples(units[:1], 5)[(0, 0)])
    assert _samples(units[1:], 5) == {c: s for c, s in _samples(units, 5).items() if c != (0, 0)}
    # Negative control: another key draws other samples (the samples are random).
    assert _samples(units, 6) != _samples(units, 5)


def test_the_vocabulary_noise_does_not_depend_on_the_units_samples():
    """Removing a person with more than k tokens moves each count by what the person
    contributed (0 or 1), never the noise: the noise has its own stream."""
    tokens = ("a", "b", "c", "d")

    def noisy_counts(rows, people):
        layer = keras.layers.StringLookup(output_mode="tf_idf")
        preprocessing.adapt_privately(layer, np.array(rows), epsilon=1.0, delta=1e-6,
                                      max_tokens_per_record=2, seed=3, user_ids=people)
        idf = dict(zip(layer.get_vocabulary(), layer.idf_weights.numpy().astype(np.float64)))
        units = len(set(people))
        return np.array([units / np.expm1(idf[t]) - 1 for t in tokens])  # log1p(N / (1 + c))

    common, people = [["a", "b"], ["c", "d"]] * 100, list(range(200))
    many = [["a", "b"], ["c", "d"]]  # one more person: 4 distinct tokens, k = 2 sampled
    moved = noisy_counts(common + many, people + [200, 200]) - noisy_counts(common, people)
    assert np.allclose(moved, np.round(moved), atol=1e-3)
    assert set(np.round(moved)) <= {0.0, 1.0} and np.round(moved).sum() == 2


def private_entry(additive=2e-7):
    return dict(id="x", layer="lookup", state="00", kind="private", what="vocabulary",
                source="DP partition selection", unit="record", additive_delta=additive)


def trained_ledger(event=None, additive=0.0):
    ledger = PrivacyLedger()
    if event is not None:
        ledger.charge_preprocessing(private_entry(additive), event)
    ledger.begin_steps(dpsgd_event(1.1, 0.01))
    ledger.advance(500)
    return ledger


def test_the_adaptation_event_composes_with_the_steps_as_dp_accounting_does():
    gaussian = dp_accounting.GaussianDpEvent(4.0)
    plain, charged = trained_ledger(), trained_ledger(gaussian)
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(
        [gaussian, dp_accounting.SelfComposedDpEvent(dpsgd_event(1.1, 0.01), 500)]))
    assert charged.epsilon(DELTA) == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-12)
    assert charged.epsilon(DELTA) > plain.epsilon(DELTA)


def test_the_thresholds_delta_is_charged_and_the_bound_holds_at_the_reported_epsilon():
    gaussian = dp_accounting.GaussianDpEvent(4.0)
    without, with_threshold = trained_ledger(gaussian), trained_ledger(gaussian, additive=1e-6)
    eps = with_threshold.epsilon(DELTA)
    assert eps > without.epsilon(DELTA)  # fails if the threshold's delta is dropped
    # Independently: dp_accounting at delta - A, plus -log(1 - A) (tfdp.accounting.additive_delta).
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(
        [gaussian, dp_accounting.SelfComposedDpEvent(dpsgd_event(1.1, 0.01), 500)]))
    assert eps == pytest.approx(accountant.get_epsilon(DELTA - 1e-6) - math.log1p(-1e-6),
                                rel=1e-12)
    # Both directions' terms at the reported epsilon: delta_acc(eps - s) and delta_acc(eps) + A.
    parts = [(gaussian, 1), (dpsgd_event(1.1, 0.01), 500)]
    assert _engine.delta(parts, eps + math.log1p(-1e-6)) <= DELTA * (1 + 1e-9)
    assert _engine.delta(parts, eps) + 1e-6 <= DELTA * (1 + 1e-9)
    assert with_threshold.delta(eps) >= 1e-6
    assert with_threshold.epsilon(1e-6) == math.inf  # the threshold alone spends delta


def test_the_ledger_keeps_its_preprocessing_through_json_and_refuses_a_corrupt_entry():
    ledger = trained_ledger(dp_accounting.GaussianDpEvent(4.0), additive=2e-6)
    restored = PrivacyLedger.from_json(ledger.to_json())
    assert restored.preprocessing == ledger.preprocessing
    assert restored.epsilon(DELTA) == ledger.epsilon(DELTA)
    data = json.loads(ledger.to_json())
    data["preprocessing"][0]["additive_delta"] = -1.0
    with pytest.raises(ValueError, match="Corrupt privacy ledger.*additive_delta"):
        PrivacyLedger.from_json(json.dumps(data))
    del data["preprocessing"][0]["unit"]
    with pytest.raises(ValueError, match="Corrupt privacy ledger"):
        PrivacyLedger.from_json(json.dumps(data))


def test_state_declared_public_takes_no_event():
    entry = dict(private_entry(0.0), kind="public", unit="")
    with pytest.raises(ValueError, match="declared public releases nothing private"):
        PrivacyLedger().charge_preprocessing(entry, dp_accounting.GaussianDpEvent(1.0))


# -- the layers, with crafted records -----------------------------------------------


def test_a_token_of_one_person_is_dropped_where_per_record_counting_keeps_it():
    common = np.repeat(np.arange(1, 6), 200)
    ids = np.append(common, [99950] * 100)  # one person, 100 records holding 99950
    users = np.append(np.arange(len(common)), [10**6] * 100)
    per_record = keras.layers.IntegerLookup()
    preprocessing.adapt_privately(per_record, ids, epsilon=1.0, delta=1e-6, seed=0)
    per_person = keras.layers.IntegerLookup()
    entry = preprocessing.adapt_privately(per_person, ids, epsilon=1.0, delta=1e-6,
                                          user_ids=users, seed=0)
    assert 99950 in per_record.get_vocabulary()  # 100 records: a frequent token per record
    assert 99950 not in per_person.get_vocabulary()
    assert set(range(1, 6)) <= set(per_person.get_vocabulary())
    assert entry["unit"] == "person" and "per person" in entry["source"]


def test_float_user_ids_are_refused_as_fit_refuses_them():
    with pytest.raises(ValueError, match="NaN != NaN would split one person"):
        preprocessing.adapt_privately(keras.layers.IntegerLookup(), np.array([1, 2]),
                                      epsilon=1.0, delta=1e-6, user_ids=np.array([0.0, np.nan]))


def test_text_vectorization_gets_a_private_vocabulary_and_idf_from_noisy_counts():
    texts = np.array(["the cat sat", "the dog sat", "a cat ran"] * 300 + ["zyzzyva unique"])
    layer = keras.layers.TextVectorization(output_mode="tf_idf", name="text")
    entry = preprocessing.adapt_privately(layer, texts, epsilon=2.0, delta=1e-6,
                                          max_tokens_per_record=3, seed=0)
    vocabulary = layer.get_vocabulary()
    assert "zyzzyva" not in vocabulary and "unique" not in vocabulary
    assert {"the", "cat", "sat", "dog", "a", "ran"} <= set(vocabulary)
    idf = dict(zip(vocabulary, layer._lookup_layer.idf_weights.numpy()))
    assert idf["the"] == pytest.approx(math.log1p(901 / 601), abs=0.02)  # df 600 of 901
    assert entry["what"] == "vocabulary and TF-IDF weights"
    assert provenance.data_state(layer)[0] == entry["what"]


def test_a_vocabulary_with_no_token_over_the_threshold_is_refused_with_the_fixes():
    with pytest.raises(ValueError, match="No token of 'few' passed .* Raise epsilon") as caught:
        preprocessing.adapt_privately(keras.layers.IntegerLookup(name="few"),
                                      np.array([3, 3, 99950]), epsilon=1.0, delta=1e-6, seed=0)
    assert "99950" not in str(caught.value)


def test_text_vectorization_needs_k():
    with pytest.raises(ValueError, match="needs `max_tokens_per_record`"):
        preprocessing.adapt_privately(keras.layers.TextVectorization(), np.array(["a b"]),
                                      epsilon=1.0, delta=1e-6)


def test_normalization_of_clipped_features_moves_at_most_its_sensitivity_for_an_outlier():
    x = np.random.default_rng(0).uniform(20, 60, size=(500, 2))
    crafted = np.vstack([x[:-1], [[1e9, -1e9]]])  # one record's extreme values
    means = []
    for data in (x, crafted):
        layer = keras.layers.Normalization()
        preprocessing.adapt_privately(layer, data, epsilon=1.0, delta=1e-6,
                                      value_range=(0, 100), seed=3)  # same noise
        means.append(layer.adapt_mean.numpy())
    assert np.all(np.abs(means[0] - x.mean(0)) < 3)
    assert np.max(np.abs(means[1] - means[0])) <= 100 / 500 + 1e-4  # clipped: range / N
    assert np.all(np.abs(means[1]) < 100)


def test_a_nan_record_moves_normalization_by_at_most_its_sensitivity_and_never_to_nan():
    x = np.random.default_rng(0).uniform(20, 60, size=(500, 1))
    crafted = np.vstack([x[:-1], [[np.nan]]])
    means = []
    for data in (x, crafted):
        layer = keras.layers.Normalization()
        preprocessing.adapt_privately(layer, data, epsilon=1.0, delta=1e-6,
                                      value_range=(0, 100), seed=3)
        means.append(layer.adapt_mean.numpy())
        assert np.all(np.isfinite(layer.adapt_variance.numpy()))
    assert np.max(np.abs(means[1] - means[0])) <= 100 / 500 + 1e-4


def test_data_of_the_wrong_kind_is_refused_without_showing_a_value():
    with pytest.raises(TypeError, match="integer ids") as caught:
        preprocessing.adapt_privately(keras.layers.IntegerLookup(), np.array([1.5, 99950.0]),
                                      epsilon=1.0, delta=1e-6)
    assert "99950" not in str(caught.value)
    with pytest.raises(TypeError, match="takes numbers") as caught:
        preprocessing.adapt_privately(keras.layers.Normalization(), np.array([["secret"]]),
                                      epsilon=1.0, delta=1e-6, value_range=(0, 1))
    assert "secret" not in str(caught.value)


def test_normalization_refuses_a_missing_range_and_constants():
    with pytest.raises(ValueError, match="needs `value_range"):
        preprocessing.adapt_privately(keras.layers.Normalization(), np.ones((5, 1)),
                                      epsilon=1.0, delta=1e-6)
    with pytest.raises(ValueError, match="built with a mean and variance"):
        preprocessing.adapt_privately(keras.layers.Normalization(mean=0.0, variance=1.0),
                                      np.ones((5, 1)), epsilon=1.0, delta=1e-6,
                                      value_range=(0, 1))


def test_discretization_finds_the_quantiles_and_clips_an_outlier():
    values = np.random.default_rng(0).uniform(0, 10, size=2000)
    layer = keras.layers.Discretization(num_bins=4)
    preprocessing.adapt_privately(layer, np.append(values, 1e12), epsilon=1.0, delta=1e-6,
                                  value_range=(0, 10), seed=0)
    assert np.allclose(layer.bin_boundaries, [2.5, 5.0, 7.5], atol=0.2)
    assert max(layer.bin_boundaries) <= 10


def test_other_layers_are_refused_with_the_declaration_named():
    with pytest.raises(TypeError, match="declare_public"):
        preprocessing.adapt_privately(keras.layers.Dense(2), np.ones((3, 2)), epsilon=1.0,
                                      delta=1e-6)


def test_the_adaptation_alone_is_within_its_epsilon_with_its_threshold_delta_charged():
    layer = keras.layers.IntegerLookup()
    entry = preprocessing.adapt_privately(layer, np.repeat(np.arange(5), 100), epsilon=1.0,
                                          delta=1e-6, seed=0)
    event = provenance._PENDING[layer][1]
    assert entry["additive_delta"] == 1e-6 / 2  # the threshold's half of delta
    ledger = PrivacyLedger()
    ledger.charge_preprocessing(entry, event)
    assert 0.9 < ledger.epsilon(1e-6) <= 1.0 + 1e-3  # calibrated to (1, delta / 2) by RDP
