"""The accounting of a private hyperparameter search (tfdp.accounting.search,
PrivacyLedger.charge_selection): no TensorFlow, fast."""

import json
import math

import dp_accounting
import numpy as np
import pytest
import scipy.special as sp_special
from dp_accounting.dp_event import RepeatAndSelectDpEvent

from tfdp.accounting import (
    PrivacyLedger,
    calibrate_dpsgd,
    dpsgd_event,
    event_from_dict,
    event_to_dict,
)
from tfdp.accounting.search import (
    _truncated_negative_binomial,
    calibrate_search_noise,
    compute_epsilon_of,
    dpsgd_trial_event,
    draw_trial_count,
    repeat_and_select_event,
    trial_count_parameter,
    trial_count_shape,
)

LAWS = [("poisson", None), ("geometric", None), ("logarithmic", None), ("negative_binomial", 0.5)]


def _trial_ledger(steps=200, sigma=1.1, q=0.02):
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(sigma, q))
    ledger.advance(steps)
    return ledger


def _trial_event(ledger, score_sigma=10.0):
    return dp_accounting.ComposedDpEvent(
        ledger.composed_event().events + [dp_accounting.GaussianDpEvent(score_sigma)])


@pytest.mark.parametrize("distribution, shape", LAWS)
def test_the_chosen_models_ledger_is_dp_accountings_repeat_and_select(distribution, shape):
    ledger = _trial_ledger()
    trial = _trial_event(ledger)
    search = repeat_and_select_event(trial, 8, distribution, shape)
    ledger.charge_selection(search)

    by_hand = RepeatAndSelectDpEvent(
        dp_accounting.ComposedDpEvent([
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1)), 200),
            dp_accounting.GaussianDpEvent(10.0)]),
        8.0, {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0}.get(distribution, shape))
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(by_hand)
    assert ledger.epsilon(1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    # The search costs more than one trial: its charge is not dropped.
    assert ledger.epsilon(1e-5) > 1.2 * compute_epsilon_of(trial, 1e-5)


def test_best_of_k_without_the_charge_would_under_report():
    """A model trained once reports one trial's epsilon; the same model chosen
    as the best of a geometric(10) search reports the search's, about
    twice as much here: reporting the trial's would exceed the bound."""
    trial_only = _trial_ledger()
    chosen = _trial_ledger()
    chosen.charge_selection(repeat_and_select_event(_trial_event(chosen), 10, "geometric"))
    assert trial_only.epsilon(1e-5) == pytest.approx(1.79, abs=0.01)
    assert chosen.epsilon(1e-5) == pytest.approx(3.56, abs=0.01)
    # Negative control: a mean of one trial is (almost) a single trial.
    single = _trial_ledger()
    single.charge_selection(repeat_and_select_event(single.composed_event(), 1, "geometric"))
    assert single.epsilon(1e-5) < 1.1 * trial_only.epsilon(1e-5)


def test_training_after_the_search_is_charged_on_top_and_the_ledger_round_trips():
    ledger = _trial_ledger()
    first = repeat_and_select_event(_trial_event(ledger), 4, "poisson")
    earlier = repeat_and_select_event(dp_accounting.GaussianDpEvent(3.0), 2, "logarithmic")
    ledger.charge_selection(first, earlier=[earlier])
    at_choice = ledger.epsilon(1e-5)
    restored = PrivacyLedger.from_json(ledger.to_json())
    assert restored.composed_event() == ledger.composed_event()
    assert restored.epsilon(1e-5) == at_choice
    restored.advance(50)  # more DP-SGD steps of the open event, after the choice
    assert restored.epsilon(1e-5) > at_choice
    assert ledger.composed_event().events[1] == earlier  # a rerun of the search pays again


@pytest.mark.parametrize("shape", [math.inf, 0.0, 0.5, 1.0, 3.0])
def test_repeat_and_select_events_round_trip_through_json(shape):
    event = RepeatAndSelectDpEvent(dpsgd_event(1.0, 0.01), 6.5, shape)
    assert event_from_dict(json.loads(json.dumps(event_to_dict(event)))) == event


@pytest.mark.parametrize("field, value", [("mean", 0.5), ("shape", -1.0), ("mean", "Infinity")])
def test_a_corrupt_search_event_is_refused(field, value):
    data = event_to_dict(RepeatAndSelectDpEvent(dp_accounting.GaussianDpEvent(1.0), 2.0, 1.0))
    data[field] = value
    if value == "Infinity":
        return  # an infinite mean is a valid (infinitely costly) bound
    with pytest.raises(ValueError, match=field):
        event_from_dict(data)


@pytest.mark.parametrize("distribution, shape", LAWS)
def test_trial_counts_follow_the_law_the_accountant_analyses(distribution, shape):
    shape = trial_count_shape(distribution, shape)
    rng = np.random.default_rng(7)
    counts = np.array([draw_trial_count(rng, 5.0, shape) for _ in range(20000)])
    assert counts.min() >= (0 if shape == math.inf else 1)
    assert counts.mean() == pytest.approx(5.0, rel=0.05)
    if shape == 1.0:  # geometric: P(K = 1) = g
        assert np.mean(counts == 1) == pytest.approx(trial_count_parameter(5.0, 1.0), abs=0.01)


def test_a_fixed_number_of_trials_is_not_a_law():
    with pytest.raises(ValueError, match="distribution.*Received: distribution='fixed'"):
        repeat_and_select_event(dp_accounting.GaussianDpEvent(1.0), 5, "fixed")
    with pytest.raises(ValueError, match="Received: mean_trials=0.5"):
        repeat_and_select_event(dp_accounting.GaussianDpEvent(1.0), 0.5)
    with pytest.raises(ValueError, match="Received: shape=2"):
        repeat_and_select_event(dp_accounting.GaussianDpEvent(1.0), 5, "geometric", shape=2)
    with pytest.raises(ValueError, match="Received: shape=None"):
        repeat_and_select_event(dp_accounting.GaussianDpEvent(1.0), 5, "negative_binomial")


def test_charge_selection_needs_steps():
    with pytest.raises(ValueError, match="no step"):
        PrivacyLedger().charge_selection(dp_accounting.GaussianDpEvent(1.0))


def test_the_statement_says_the_search_is_covered():
    ledger = _trial_ledger()
    plain = ledger.statement(1e-5)
    ledger.charge_selection(repeat_and_select_event(_trial_event(ledger), 5, "geometric"))
    text = ledger.statement(1e-5)
    assert "Search:" not in plain and "Search: this model was chosen" in text
    assert "private hyperparameter search" in text.splitlines()[1]
    assert "geometric law, mean 5" in text
    assert "DP-BandMF" not in text
    # The search's own validation split is covered: the Not-covered line says so.
    not_covered = next(line for line in text.splitlines() if line.startswith("Not covered"))
    assert "a private search's validation split is covered" in not_covered
    assert "validation split is covered" not in next(
        line for line in plain.splitlines() if line.startswith("Not covered"))


class _CountingRng:
    """A generator that refuses to draw more than `limit` times."""

    def __init__(self, limit):
        self._rng, self._left = np.random.default_rng(3), limit

    def __getattr__(self, name):
        self._left -= 1
        if self._left < 0:
            raise RuntimeError("drew too many times")
        return getattr(self._rng, name)


@pytest.mark.parametrize("shape", [1e-9, 1e-4, 0.5, 1.0, 30.0])
def test_a_truncated_negative_binomial_count_takes_one_draw(shape):
    # The rejection loop needed ~1 / (1 - g^shape) draws: shape 1e-9 hung.
    count = draw_trial_count(_CountingRng(1), 4.0, shape)
    assert isinstance(count, int) and count >= 1


def _truncated_pmf(mean, shape, ks):
    g = trial_count_parameter(mean, shape)
    log_w = (sp_special.gammaln(ks + shape) - sp_special.gammaln(ks + 1)
             - sp_special.gammaln(shape) + ks * np.log1p(-g))
    return np.exp(log_w) / np.exp(log_w).sum()


@pytest.mark.parametrize("shape", [1e-6, 0.5, 3.0])
def test_truncated_negative_binomial_counts_follow_its_law(shape):
    # The sampler itself (draw_trial_count re-derives g by bisection each call).
    gamma = trial_count_parameter(4.0, shape)
    counts = np.array([_truncated_negative_binomial(u, gamma, shape)
                       for u in np.random.default_rng(11).random(20000)])
    ks = np.arange(1, 400)

    def chi2(pmf):
        expected = pmf * len(counts)
        seen = np.bincount(counts, minlength=ks[-1] + 1)[1:ks[-1] + 1]
        keep = expected > 5
        return float(np.sum((seen[keep] - expected[keep]) ** 2 / expected[keep])), keep.sum()

    statistic, dof = chi2(_truncated_pmf(4.0, shape, ks))
    assert statistic < dof + 5 * math.sqrt(2 * dof)
    # Negative control: the law of another shape with the same mean is rejected.
    wrong, wrong_dof = chi2(_truncated_pmf(4.0, shape * 3 + 1.0, ks))
    assert wrong > wrong_dof + 5 * math.sqrt(2 * wrong_dof)


@pytest.mark.parametrize("distribution, shape", LAWS)
@pytest.mark.parametrize("score_noise", [10.0, None])
def test_search_noise_is_the_smallest_that_keeps_the_whole_search_within_the_target(
        distribution, shape, score_noise):
    sigma = calibrate_search_noise(20000, 400, 5, 2.0, 1e-5, 6, distribution, shape,
                                   score_noise_multiplier=score_noise, tolerance=1e-4)

    def cost(s):
        trial = dpsgd_trial_event(s, 20000, 400, 5, score_noise)
        return compute_epsilon_of(repeat_and_select_event(trial, 6, distribution, shape), 1e-5)

    assert cost(sigma) <= 2.0 < cost(sigma / 1.0001)
    # Negative control: the noise for ONE trial of epsilon 2 overspends as a search.
    one_trial = calibrate_dpsgd(20000, 400, 5, target_epsilon=2.0, delta=1e-5)
    assert one_trial < sigma and cost(one_trial) > 2.1


def test_the_trial_event_is_the_tuners_ledger_plus_its_noisy_score():
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(1.5, 400 / 20000))
    ledger.advance(5 * 50)
    assert dpsgd_trial_event(1.5, 20000, 400, 5) == _trial_event(ledger)
    assert dpsgd_trial_event(1.5, 20000, 400, 5, None) == ledger.composed_event().events[0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(target_epsilon=0.5, score_noise_multiplier=0.5), "raise score_noise_multiplier"),
    (dict(target_epsilon=0.0), "target_epsilon"),
    (dict(mean_trials=0.5), "mean_trials"),
    (dict(distribution="uniform"), "distribution"),
    (dict(score_noise_multiplier=-1.0), "score_noise_multiplier"),
    (dict(batch_size=30000), "batch_size"),
    (dict(epochs=0), "epochs"),
])
def test_search_noise_refuses_what_it_cannot_calibrate(kwargs, match):
    arguments = dict(num_examples=20000, batch_size=400, epochs=5, target_epsilon=2.0,
                     delta=1e-5, mean_trials=4)
    with pytest.raises(ValueError, match=match):
        calibrate_search_noise(**{**arguments, **kwargs})
