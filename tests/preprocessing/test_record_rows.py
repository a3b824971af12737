"""A row of `data` is one record, whatever its shape (review 7, F3).

`adapt_privately(TextVectorization, texts of shape (N, 2))` (a title and a
body) counted each text as a unit: one crafted record moved the counts the
partition selection sees by L2 sqrt(6) where sqrt(k) = sqrt(2) is
accounted. A record's texts are pooled before the k-bound.
"""

import keras
import numpy as np
import pytest

from tfdp.preprocessing import adapt_privately, partition_selection

K = 2


@pytest.fixture
def seen_counts(monkeypatch):
    """The counts each adaptation hands to the partition selection."""
    seen = []
    original = partition_selection.select

    def spy(counts, noise_std, threshold, rng):
        seen.append(dict(counts))
        return original(counts, noise_std, threshold, rng)

    monkeypatch.setattr(partition_selection, "select", spy)
    return seen


def count_shift(seen_counts, make_layer, base, crafted, **kwargs):
    """L2 distance of the counts with and without the crafted record."""
    for data in (base, base + [crafted]):
        adapt_privately(make_layer(), np.array(data), epsilon=1.0, delta=1e-6, **kwargs)
    without, with_record = seen_counts[-2:]
    tokens = set(without) | set(with_record)
    return np.sqrt(sum((with_record.get(t, 0) - without.get(t, 0)) ** 2 for t in tokens))


def test_a_record_of_two_texts_moves_the_counts_by_at_most_sqrt_k(seen_counts):
    shift = count_shift(
        seen_counts, lambda: keras.layers.TextVectorization(name="tv"),
        [["common title", "common body"]] * 300, ["common zqsecretone", "common zqsecrettwo"],
        max_tokens_per_record=K, seed=0)
    assert shift <= np.sqrt(K) + 1e-12


def test_a_record_of_two_values_moves_a_lookups_counts_by_at_most_sqrt_k(seen_counts):
    shift = count_shift(
        seen_counts, lambda: keras.layers.StringLookup(name="tags", output_mode="multi_hot"),
        [["red", "blue"]] * 300, ["zqsecretone", "zqsecrettwo"], seed=0)
    assert shift <= np.sqrt(K) + 1e-12


def test_people_of_multi_text_records_take_one_id_per_row(seen_counts):
    texts = np.array([["common", "common"]] * 300)
    layer = keras.layers.TextVectorization(name="tv")
    adapt_privately(layer, texts, epsilon=1.0, delta=1e-6, max_tokens_per_record=K,
                    user_ids=np.arange(300) // 3, seed=0)
    assert seen_counts[-1]["common"] == 100  # 100 people, each counted once
