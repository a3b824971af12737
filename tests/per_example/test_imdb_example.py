"""examples/dpsgd_imdb.py offline: its preprocessing and one private epoch on
a small generated sample (no network)."""

import numpy as np
import pytest

import tfdp
from tests.example_scripts import load_example


def _example():
    return load_example("dpsgd_imdb")


def _fake_imdb(n=48, seed=0):
    """Reviews in keras.datasets.imdb's form: 1, then word ids, any length;
    positive reviews contain word 4."""
    rng = np.random.default_rng(seed)

    def split():
        labels = rng.integers(0, 2, n)
        reviews = []
        for label in labels:
            words = list(rng.integers(5, 400, rng.integers(3, 40)))
            if label:
                words[rng.integers(len(words))] = 4
            reviews.append([1] + [int(w) for w in words])
        return reviews, labels

    return lambda: (split(), split())


def test_load_imdb_maps_rare_words_truncates_and_pads():
    example = _example()
    (x, y), (x_test, _) = example.load_imdb(num_words=100, maxlen=20, loader=_fake_imdb(), sample=30)
    assert x.shape == (30, 20) and x.dtype == np.int32 and x_test.shape == (30, 20)
    assert x.max() < 100 and set(np.unique(y)) <= {0, 1}
    assert np.any(x == example.OOV)  # ids >= num_words became OOV
    # Zero padding only at the end of a row: masked steps follow the review.
    for row in x:
        nonzero = np.flatnonzero(row)
        assert np.all(row[: nonzero[-1] + 1] != 0)


def test_example_trains_privately_on_a_generated_sample(capsys):
    example = _example()
    model, accuracy = example.main(
        ["--epochs", "1", "--batch-size", "16", "--num-words", "400", "--maxlen", "24",
         "--bidirectional"],
        loader=_fake_imdb(),
    )
    out = capsys.readouterr().out
    assert "batched pass with per-layer rules" in out and "fallback" not in out
    assert "test accuracy" in out and "epsilon" in out.lower()
    assert model.privacy.steps == 3
    # The printed accuracy is the trained model's on the test split.
    _, (x_test, y_test) = example.load_imdb(400, 24, loader=_fake_imdb())
    logits = model.predict(x_test, verbose=0).reshape(-1)
    assert accuracy == pytest.approx(np.mean((logits > 0) == (y_test == 1)), abs=1e-6)
    assert f"test accuracy     {accuracy:.4f}" in out
    # The ledger charges what ran: 3 Poisson steps (q = 16 / 48) at the
    # optimizer's noise, and the calibration spent the target epsilon 3.
    sigma = model.optimizer.noise_multiplier
    expected = tfdp.accounting.compute_epsilon(sigma, 16 / 48, 3, 1e-5)
    assert model.privacy.epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
    assert 2.97 <= expected <= 3.0
