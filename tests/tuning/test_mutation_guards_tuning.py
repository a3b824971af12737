"""Guards found missing by a mutation test of the private search (issue 55, item 8).

Each mutant below passed every relevant test and the modules' docstring
examples:

* the Poisson law of the number of trials drawn as max(1, K) (the law test
  checked only the mean, where P(K = 0) = e^-5 hides);
* the score's noise halved while the event keeps sigma;
* per-example scores not clipped to [0, 1] (one record would move the sum by
  more than the sensitivity 1 the event assumes);
* the noisy score divided by the realised validation size (which depends on
  every record's draw) instead of the public expected size;
* a seeded optimizer accepted (the same noise in every trial);
* the held-out split taken as a fixed prefix (the leak test's N 40 -> 41
  left round(0.3 N) unchanged): each record is held out on its own draw,
  fresh for every trial.
"""

import math

import keras
import numpy as np
import pytest

keras_tuner = pytest.importorskip("keras_tuner")

import tfdp  # noqa: E402
from tfdp.accounting.search import draw_trial_count, trial_count_shape  # noqa: E402
from tfdp.tuning import PrivateRandomSearch, scores, search, settings  # noqa: E402
from tfdp.tuning.hiding import Refusal  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_the_poisson_number_of_trials_is_zero_with_probability_exp_minus_mean():
    """P(K = k) = e^-1 / k! at mean 1, K = 0 included (a search that draws
    no trial releases nothing: the accountant's law counts it)."""
    shape = trial_count_shape("poisson", None)
    rng = np.random.default_rng(5)
    counts = np.array([draw_trial_count(rng, 1.0, shape) for _ in range(4000)])
    for k in range(4):
        expected = math.exp(-1.0) / math.factorial(k)
        assert np.mean(counts == k) == pytest.approx(expected, abs=0.03), k
    # control: the geometric law never draws 0
    geometric = trial_count_shape("geometric", None)
    assert min(draw_trial_count(rng, 1.5, geometric) for _ in range(500)) == 1


def test_the_score_noise_has_the_sigma_of_its_event():
    """The event says GaussianDpEvent(10): the noise on the sum of scores
    must have standard deviation 10 (a count of 1 leaves the sum as is)."""
    rng = np.random.default_rng(2)
    draws = []
    for _ in range(3000):
        score, event = scores.release_score(np.zeros(5), 1.0, 10.0, rng)
        draws.append(score)
    assert event.noise_multiplier == 10.0
    assert float(np.std(draws)) == pytest.approx(10.0, rel=0.06)
    assert abs(float(np.mean(draws))) < 0.6


@pytest.mark.parametrize("raw, clipped", [
    (7.0, 1.0), (-3.0, 0.0), (1.5, 1.0), (float("nan"), 0.0), (float("inf"), 1.0),
    (float("-inf"), 0.0), (0.25, 0.25)])
def test_a_record_adds_a_score_within_0_and_1(raw, clipped):
    """The score's sensitivity is 1 because each record adds a value in
    [0, 1]: a score returning 7 must count as 1."""
    values = scores.per_example(lambda y_true, y_pred: np.full(len(y_pred), raw),
                                np.zeros(3), np.zeros((3, 2)))
    assert values.tolist() == [clipped] * 3


def test_the_score_is_divided_by_the_public_count_not_the_realised_one():
    values = np.ones(7)  # 7 records held out by this trial's draw
    score, _ = scores.release_score(values, 20.2, None, np.random.default_rng(0))
    assert score == 7 / 20.2
    noisy, _ = scores.release_score(values, 20.2, 1e-12, np.random.default_rng(0))
    assert noisy == pytest.approx(7 / 20.2, rel=1e-9)


def _data(n):
    x = np.arange(n, dtype="float32")[:, None] * np.ones((1, 3), "float32")
    return x, (np.arange(n) % 2).astype("int32")


def _build(seed=None):
    def build(hp):
        model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=tfdp.optimizers.DPSGD(
            hp.Float("learning_rate", 0.05, 0.5, sampling="log"), l2_norm_clip=1.0,
            noise_multiplier=1.5, seed=seed), loss=LOSS)
        return model
    return build


class _Scored(Exception):
    """Stops the search at its first score (nothing trains or is released)."""


def test_a_trial_scores_over_the_splits_expected_size(trials, monkeypatch):
    """N = 101 at split 0.2: the public count is 20.2, which no realised
    held-out size (an integer) equals."""
    trials(1)
    seen = []

    def spy(values, count, noise_multiplier, rng):
        seen.append((len(values), count, noise_multiplier))
        raise _Scored("scored")

    monkeypatch.setattr(tfdp.DPSequential, "fit", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(scores, "release_score", spy)
    tuner = PrivateRandomSearch(_build(), mean_trials=2)
    with pytest.raises(_Scored):
        tuner.search(*_data(101), batch_size=20, epochs=1, validation_split=0.2)
    [(held_out, count, noise)] = seen
    assert count == pytest.approx(20.2, rel=1e-12) and held_out != count
    assert noise == 10.0


def test_a_seeded_optimizer_is_refused_before_the_draw():
    model = _build(seed=3)(keras_tuner.HyperParameters())
    with pytest.raises(Refusal, match="seeded optimizer.*Received: seed=3"):
        settings.privacy_setting(model, 100, 20)
    tuner = PrivateRandomSearch(_build(seed=3), mean_trials=3)
    with pytest.raises(ValueError, match="same noise in every trial"):
        tuner.search(*_data(100), batch_size=20, epochs=1, validation_split=0.2)
    with pytest.raises(ValueError, match="call search"):  # not spent: refused before the draw
        tuner.get_best_models()
    # control: unseeded, the setting is accepted
    assert settings.privacy_setting(_build()(keras_tuner.HyperParameters()),
                                    100, 20).startswith("DPSGD")


def test_each_record_is_held_out_on_its_own_draw_fresh_for_every_trial():
    """At split 0.3 over 40 records and 400 trials' draws, every record is
    held out about 30% of the time, whatever its position, and the held-out
    count varies (a fixed prefix of round(0.3 N) records holds out records
    0..11 always and the others never)."""
    x, y = _data(40)
    validation = search._Validation(x, y, 0.3, None, False, 10.0)
    assert validation.count == pytest.approx(12.0)
    rng = np.random.default_rng(4)
    held = np.zeros(40)
    sizes = set()
    for _ in range(400):
        (x_train, y_train, weights), (x_val, _) = validation.split(rng)
        assert len(x_train) == 40  # every trial samples from all N rows
        ids = x_val[:, 0].astype(int)
        np.testing.assert_array_equal(np.flatnonzero(weights == 0.0), ids)
        held[ids] += 1
        sizes.add(len(ids))
    assert np.all((held / 400 > 0.2) & (held / 400 < 0.4)), held / 400
    assert len(sizes) > 5
