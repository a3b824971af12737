"""Tests for tfdp.accounting.PrivacyLedger against dp_accounting itself."""

import json
import math

import dp_accounting
import numpy as np
import pytest

from tfdp.accounting import PrivacyLedger, dpsgd_event
from tfdp.accounting import _engine

G = dp_accounting.GaussianDpEvent
TF_PRIVACY_GOLDEN = 0.7242234026109595  # tensorflow-privacy compute_dp_sgd_privacy_test, Test0


def ledger_with(event, steps):
    ledger = PrivacyLedger()
    ledger.begin_steps(event)
    ledger.advance(steps)
    return ledger


def mixed_ledger():
    """Three segments of different events, a repeated event, and one-off records."""
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(1.1, 0.01))
    ledger.advance(300)
    ledger.record(G(50.0))  # e.g. a noisy dataset size
    ledger.begin_steps(dpsgd_event(1.5, 0.02))
    ledger.advance(200)
    ledger.begin_steps(dpsgd_event(1.5, 0.02))  # same event: no new segment
    ledger.advance(100)
    ledger.record(dpsgd_event(3.0, 0.05), count=20)
    ledger.begin_steps(dpsgd_event(2.0, 0.01))
    ledger.advance(400)
    return ledger


def direct_events():
    """The same releases, written by hand for dp_accounting."""
    return [
        (dp_accounting.PoissonSampledDpEvent(0.01, G(1.1)), 300),
        (dp_accounting.PoissonSampledDpEvent(0.02, G(1.5)), 300),
        (G(50.0), 1),
        (dp_accounting.PoissonSampledDpEvent(0.05, G(3.0)), 20),
        (dp_accounting.PoissonSampledDpEvent(0.01, G(2.0)), 400),
    ]


class Counter:
    """Stands in for a model's step variable."""

    def __init__(self, value=0):
        self.value = value

    def __call__(self):
        return np.int64(self.value)


# -- epsilon against the reference --------------------------------------------


def test_golden_value_from_tensorflow_privacy():
    ledger = ledger_with(dpsgd_event(1.3, 150 / 60000), 6000)
    assert ledger.epsilon(1e-5) == pytest.approx(TF_PRIVACY_GOLDEN, rel=1e-9)


def test_rdp_epsilon_equals_rdp_accountant_on_the_same_events():
    ledger = mixed_ledger()
    assert ledger.steps == 1000
    accountant = dp_accounting.rdp.RdpAccountant()
    for event, count in direct_events():
        accountant.compose(event, count)
    for delta in (1e-5, 1e-7, 0.01):
        assert ledger.epsilon(delta) == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)
    composed = dp_accounting.rdp.RdpAccountant()
    composed.compose(ledger.composed_event())
    assert ledger.epsilon(1e-5) == composed.get_epsilon(1e-5)  # bit-identical
    assert ledger.delta(1.0) == pytest.approx(accountant.get_delta(1.0), rel=1e-12)


def test_pld_epsilon_equals_pld_accountant():
    ledger = mixed_ledger()  # has a one-off Gaussian record: general PLD path
    accountant = dp_accounting.pld.PLDAccountant()  # default interval 1e-4
    accountant.compose(ledger.composed_event())
    assert ledger.epsilon(1e-5, accountant="pld") == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert ledger.delta(1.0, accountant="pld") == pytest.approx(accountant.get_delta(1.0), rel=1e-12)


def test_pld_fast_path_equals_pld_accountant():
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(1.1, 0.01))
    ledger.advance(500)
    ledger.begin_steps(dpsgd_event(1.3, 0.02))
    ledger.advance(700)
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(0.01, G(1.1)), 500)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(0.02, G(1.3)), 700)
    pld = ledger.epsilon(1e-5, accountant="pld")
    assert pld == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert pld < ledger.epsilon(1e-5)  # PLD is the tighter bound here


def test_pld_stays_usable_for_small_noise():
    # At dp_accounting's default interval this takes minutes; tfdp coarsens
    # the (pessimistic, still valid) discretization for small noise.
    ledger = ledger_with(dpsgd_event(0.2, 0.01), 100)
    pld = ledger.epsilon(1e-5, accountant="pld")
    assert 0 < pld <= ledger.epsilon(1e-5) * 1.05
    # Full-batch Gaussian steps: PLDAccountant folds the count into the noise.
    with pytest.raises(ValueError, match="too small for the PLD accountant.*accountant='rdp'"):
        ledger_with(dpsgd_event(0.5, 1.0), 10**6).epsilon(1e-5, accountant="pld")
    with pytest.raises(ValueError, match="Too many releases for the PLD accountant.*accountant='rdp'"):
        ledger_with(dpsgd_event(1.0, 0.01), 10**6 + 1).epsilon(1e-5, accountant="pld")


def test_rdp_vector_accessor_matches_the_gaussian_closed_form():
    # dp_accounting keeps the RDP vector in a private attribute; pin it.
    sigma = 1.7
    orders = np.asarray(_engine.CLASSIC_ORDERS)
    accountant = dp_accounting.rdp.RdpAccountant(orders=list(orders))
    accountant.compose(G(sigma), 3)
    np.testing.assert_allclose(_engine._rdp_of(accountant), 3 * orders / (2 * sigma**2), rtol=1e-12)
    np.testing.assert_allclose(_engine.rdp_vector(G(sigma), _engine.CLASSIC_ORDERS), orders / (2 * sigma**2), rtol=1e-12)


@pytest.mark.parametrize("sigma, q, steps", [(1.3, 0.0025, 6000), (0.8, 0.01, 1000), (4.0, 1.0, 50), (1.0, 0.1, 30)])
@pytest.mark.parametrize("delta", [1e-5, 1e-8])
def test_classic_conversion_is_never_below_tight(sigma, q, steps, delta):
    ledger = ledger_with(dpsgd_event(sigma, q), steps)
    assert ledger.epsilon(delta, conversion="classic") >= ledger.epsilon(delta)


def test_classic_conversion_matches_hand_computation_for_a_gaussian():
    sigma, steps, delta = 5.0, 40, 1e-5
    ledger = ledger_with(dpsgd_event(sigma, 1.0), steps)
    by_hand = min(steps * a / (2 * sigma**2) + math.log(1 / delta) / (a - 1) for a in range(2, 65))
    assert ledger.epsilon(delta, conversion="classic") == pytest.approx(by_hand, rel=1e-12)
    with pytest.raises(ValueError, match="classic conversion.*accountant='rdp'"):
        ledger.epsilon(delta, accountant="pld", conversion="classic")


# -- recording -----------------------------------------------------------------


def test_empty_ledger_has_spent_nothing():
    ledger = PrivacyLedger()
    assert ledger.steps == 0
    assert ledger.epsilon(1e-5) == 0.0
    assert ledger.epsilon(1e-5, accountant="pld") == 0.0
    assert ledger.delta(0.0) == 0.0
    assert ledger.composed_event() == dp_accounting.ComposedDpEvent([])
    ledger.begin_steps(dpsgd_event(1.0, 0.1))
    assert ledger.epsilon(1e-5) == 0.0  # no step yet


def test_composed_event_structure_skips_empty_segments():
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(1.0, 0.1))
    ledger.begin_steps(dpsgd_event(2.0, 0.1))  # the first segment ran 0 steps
    ledger.advance(5)
    ledger.record(G(10.0))
    ledger.record(G(20.0), count=2)
    ledger.begin_steps(dpsgd_event(3.0, 0.1))
    ledger.advance(2)
    assert ledger.composed_event() == dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(dpsgd_event(2.0, 0.1), 5),
            G(10.0),
            dp_accounting.SelfComposedDpEvent(G(20.0), 2),
            dp_accounting.SelfComposedDpEvent(dpsgd_event(3.0, 0.1), 2),
        ]
    )
    assert repr(ledger) == "PrivacyLedger(steps=7, segments=2, records=2)"


def test_extra_steps_projects_the_open_event():
    ledger = ledger_with(dpsgd_event(1.1, 0.01), 100)
    projected = ledger.epsilon(1e-5, extra_steps=250)
    ledger.advance(250)
    assert ledger.epsilon(1e-5) == projected
    with pytest.raises(ValueError, match="begin_steps"):
        PrivacyLedger().epsilon(1e-5, extra_steps=1)


def test_non_private_release_gives_infinite_epsilon():
    ledger = ledger_with(dpsgd_event(1.0, 0.01), 10)
    ledger.record(dp_accounting.NonPrivateDpEvent())
    assert ledger.epsilon(1e-5) == math.inf
    assert "NO finite differential privacy guarantee" in ledger.statement(1e-5)


def test_unsupported_event_is_a_clear_error():
    ledger = PrivacyLedger()
    ledger.record(dp_accounting.UnsupportedDpEvent())
    with pytest.raises(ValueError, match="RDP accountant cannot account for this event"):
        ledger.epsilon(1e-5)
    with pytest.raises(ValueError, match="PLD accountant cannot account for this event"):
        ledger.epsilon(1e-5, accountant="pld")


def test_advance_rules():
    with pytest.raises(ValueError, match="begin_steps"):
        PrivacyLedger().advance(3)  # steps with no declared event
    PrivacyLedger().advance(0)
    ledger = ledger_with(dpsgd_event(1.0, 0.1), 1)
    for bad, error in [(-1, ValueError), (1.5, ValueError), ("2", TypeError), (None, TypeError)]:
        with pytest.raises(error, match="Received: n="):
            ledger.advance(bad)
    with pytest.raises(ValueError, match="advance\\(\\) is only"):
        PrivacyLedger(step_counter=Counter()).advance(1)


def test_step_counter_is_the_truth():
    counter = Counter()
    ledger = PrivacyLedger(step_counter=counter)
    event = dpsgd_event(1.0, 0.1)
    ledger.begin_steps(event)
    counter.value = 30
    assert ledger.steps == 30
    assert ledger.epsilon(1e-5) == ledger_with(event, 30).epsilon(1e-5)
    ledger.begin_steps(dpsgd_event(2.0, 0.1))
    counter.value = 45
    assert ledger.composed_event().events[0] == dp_accounting.SelfComposedDpEvent(event, 30)
    assert ledger.composed_event().events[1].count == 15
    counter.value = 40  # went backwards
    with pytest.raises(ValueError, match="went backwards: it reads 40.*already counted 45"):
        ledger.epsilon(1e-5)
    with pytest.raises(ValueError, match="went backwards"):
        ledger.begin_steps(event)


def test_steps_before_any_event_are_refused():
    counter = Counter(12)
    ledger = PrivacyLedger(step_counter=counter)
    with pytest.raises(ValueError, match="reads 12, but no step event was ever declared"):
        ledger.begin_steps(dpsgd_event(1.0, 0.1))
    with pytest.raises(ValueError, match="no step event was ever declared"):
        ledger.epsilon(1e-5)


def test_bad_step_counter():
    with pytest.raises(TypeError, match="step_counter"):
        PrivacyLedger(step_counter=5)
    with pytest.raises(ValueError, match="step_counter must return an integer"):
        PrivacyLedger(step_counter=lambda: -1).steps
    with pytest.raises(ValueError, match="step_counter must return an integer"):
        PrivacyLedger(step_counter=lambda: 2.5).steps


def test_begin_steps_and_record_refuse_non_events():
    ledger = PrivacyLedger()
    with pytest.raises(TypeError, match="Expected `event` to be a dp_accounting DpEvent"):
        ledger.begin_steps("gaussian")
    with pytest.raises(TypeError, match="Expected `event`"):
        ledger.record(1.0)
    with pytest.raises(ValueError, match="Received: count=0"):
        ledger.record(G(1.0), count=0)


# -- cache -------------------------------------------------------------------


def test_epsilon_is_cached_until_the_ledger_changes(monkeypatch):
    ledger = ledger_with(dpsgd_event(1.1, 0.01), 100)
    calls = []
    real = _engine.epsilon
    monkeypatch.setattr(_engine, "epsilon", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = ledger.epsilon(1e-5)
    assert ledger.epsilon(1e-5) == first
    assert len(calls) == 1
    ledger.advance(1)
    assert ledger.epsilon(1e-5) > first
    ledger.record(G(30.0))
    ledger.epsilon(1e-5)
    ledger.epsilon(1e-6)
    assert len(calls) == 4


# -- budget ------------------------------------------------------------------


@pytest.mark.parametrize(
    "sigma, q, done, budget",
    [(1.1, 0.01, 0, 2.0), (1.3, 0.0025, 6000, 1.0), (0.9, 0.05, 10, 8.0), (5.0, 1.0, 0, 3.0)],
)
def test_steps_within_budget_is_the_exact_boundary(sigma, q, done, budget):
    ledger = ledger_with(dpsgd_event(sigma, q), done)
    k = ledger.steps_within_budget(budget, 1e-5)
    assert k > 0
    assert ledger.epsilon(1e-5, extra_steps=k) <= budget < ledger.epsilon(1e-5, extra_steps=k + 1)


def test_steps_within_budget_with_pld():
    ledger = ledger_with(dpsgd_event(2.0, 0.01), 100)
    k = ledger.steps_within_budget(0.5, 1e-5, accountant="pld")
    assert ledger.epsilon(1e-5, "pld", extra_steps=k) <= 0.5 < ledger.epsilon(1e-5, "pld", extra_steps=k + 1)
    assert k >= ledger.steps_within_budget(0.5, 1e-5)  # PLD is tighter than RDP here


def test_steps_within_budget_edges():
    ledger = ledger_with(dpsgd_event(1.0, 0.1), 500)
    spent = ledger.epsilon(1e-5)
    assert ledger.steps_within_budget(spent / 2, 1e-5) == 0  # already over
    assert ledger.steps_within_budget(spent, 1e-5) == 0  # exactly spent
    assert ledger.steps_within_budget(1e6, 1e-5, max_steps=1234) == 1234
    assert ledger.steps_within_budget(1e6, 1e-5, max_steps=0) == 0
    with pytest.raises(ValueError, match="begin_steps"):
        PrivacyLedger().steps_within_budget(1.0, 1e-5)
    with pytest.raises(ValueError, match="Received: epsilon=-1"):
        ledger.steps_within_budget(-1, 1e-5)


# -- persistence ---------------------------------------------------------------


def test_json_round_trip_keeps_everything():
    ledger = mixed_ledger()
    text = ledger.to_json()
    json.loads(text)  # strict JSON
    restored = PrivacyLedger.from_json(text)
    assert restored.steps == ledger.steps == 1000
    assert restored.composed_event() == ledger.composed_event()
    assert restored.epsilon(1e-5) == ledger.epsilon(1e-5)
    assert restored.to_json() == text
    assert PrivacyLedger.from_json(text.encode("utf-8")).epsilon(1e-5) == ledger.epsilon(1e-5)
    # The restored ledger keeps counting the open event.
    restored.advance(10)
    ledger.advance(10)
    assert restored.epsilon(1e-5) == ledger.epsilon(1e-5)
    assert PrivacyLedger.from_json(PrivacyLedger().to_json()).epsilon(1e-5) == 0.0


def test_from_json_with_a_step_counter():
    ledger = mixed_ledger()  # last segment opened at step 600, now at 1000
    text = ledger.to_json()
    restored = PrivacyLedger.from_json(text, step_counter=Counter(1000))
    assert restored.epsilon(1e-5) == ledger.epsilon(1e-5)
    # The counter is trusted for the open segment...
    assert PrivacyLedger.from_json(text, step_counter=Counter(1200)).steps == 1200
    assert PrivacyLedger.from_json(text, step_counter=Counter(600)).steps == 600
    # ...but not below the closed segments.
    with pytest.raises(ValueError, match="Mismatched checkpoint: the step counter reads 599.*600"):
        PrivacyLedger.from_json(text, step_counter=Counter(599))
    with pytest.raises(ValueError, match="Mismatched checkpoint.*declares no step event"):
        PrivacyLedger.from_json(PrivacyLedger().to_json(), step_counter=Counter(5))


def _tamper(edit):
    data = json.loads(mixed_ledger().to_json())
    edit(data)
    return json.dumps(data)


CORRUPT = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected the ledger to be an object"),
    (b"\xff\xfe", "not UTF-8"),
    (_tamper(lambda d: d.update(format="something.else")), "expected format"),
    (_tamper(lambda d: d.update(version=99)), "unsupported version 99"),
    (_tamper(lambda d: d.pop("segments")), "has no 'segments'"),
    (_tamper(lambda d: d.update(steps=-4)), r"the ledger.steps to be an integer >= 0, got -4"),
    (_tamper(lambda d: d.update(steps="many")), "the ledger.steps to be an integer"),
    (_tamper(lambda d: d.update(steps=10)), "10 steps, but the open segment starts at step 600"),
    (_tamper(lambda d: d["segments"][1].update(start=250)), r"segments\[1\] covers steps \[250, 600\)"),
    (_tamper(lambda d: d["segments"][0].update(end=0)), r"segments\[0\] covers steps \[0, 0\)"),
    (_tamper(lambda d: d["open"].update(start=700)), "open segment starts at step 700, expected 600"),
    (_tamper(lambda d: d.update(open=None)), "closed segments but no open segment"),
    (_tamper(lambda d: d["records"][0].update(count=0)), r"records\[0\].count to be an integer >= 1"),
    (_tamper(lambda d: d["records"][0]["event"].update(type="Evil")), r"bad event at records\[0\].event: Unknown"),
    (
        _tamper(lambda d: d["segments"][0]["event"].update(sampling_probability=3)),
        r"bad event at segments\[0\].event.*sampling_probability in",
    ),
    (_tamper(lambda d: d["open"].pop("event")), "open has no 'event'"),
]


# Ids by position: a ledger's text holds its random lineage id, and xdist's
# workers must collect the same names.
@pytest.mark.parametrize("text, message", CORRUPT, ids=[f"case{i}" for i in range(len(CORRUPT))])
def test_corrupt_json_is_refused_with_a_clear_message(text, message):
    with pytest.raises(ValueError, match="Corrupt privacy ledger: .*" + message):
        PrivacyLedger.from_json(text)


def test_from_json_refuses_non_text():
    with pytest.raises(TypeError, match="Expected `text` to be a JSON string"):
        PrivacyLedger.from_json({"steps": 0})


# -- arguments and statement ----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"delta": 0}, "delta"),
        ({"delta": 1}, "delta"),
        ({"delta": 2}, "delta"),
        ({"delta": math.nan}, "delta"),
        ({"delta": "1e-5"}, "delta"),
        ({"delta": 1e-5, "accountant": "moments"}, "accountant"),
        ({"delta": 1e-5, "conversion": "loose"}, "conversion"),
        ({"delta": 1e-5, "extra_steps": -1}, "extra_steps"),
        ({"delta": 1e-5, "extra_steps": 0.5}, "extra_steps"),
    ],
)
def test_epsilon_refuses_bad_arguments(kwargs, name):
    ledger = ledger_with(dpsgd_event(1.0, 0.1), 3)
    with pytest.raises((ValueError, TypeError), match=f"`{name}`.*Received: {name}="):
        ledger.epsilon(**kwargs)


def test_delta_refuses_bad_epsilon():
    ledger = ledger_with(dpsgd_event(1.0, 0.1), 3)
    for bad in (-0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match="Received: epsilon="):
            ledger.delta(bad)
    assert ledger.delta(ledger.epsilon(1e-5)) <= 1e-5 * (1 + 1e-9)


def test_statement():
    ledger = ledger_with(dpsgd_event(1.3, 150 / 60000), 6000)
    text = ledger.statement(1e-5)
    assert text.startswith("This model was trained with (epsilon=0.725, delta=1e-05)-differential privacy")
    assert "6000 private training steps" in text
    assert "6000 x Poisson-sampled Gaussian (sampling probability 0.0025, noise multiplier 1.3)" in text
    assert "RDP accountant" in text
    assert "PLD" in ledger.statement(1e-5, accountant="pld")
