"""DP-BandMF's accounting: ledger segments counted in rounds, the events
against a dense sensitivity computation, one band against DP-SGD, and
jax-privacy's published numbers."""

import itertools
import json
import math

import dp_accounting
import numpy as np
import pytest

from tfdp.accounting import PrivacyLedger, _engine, bandmf, compute_epsilon, dpsgd_event
from tfdp.mechanisms.bandmf import optimal_coefficients

DELTA = 1e-5


def rounds_ledger(sigma=2.0, per_round=10, relation="zero_out"):
    ledger = PrivacyLedger()
    ledger.begin_steps(dp_accounting.GaussianDpEvent(sigma), steps_per_round=per_round,
                       relation=relation)
    return ledger


@pytest.mark.parametrize("steps,rounds", [(1, 1), (10, 1), (11, 2), (25, 3), (30, 3)])
def test_a_rounds_segment_counts_started_rounds(steps, rounds):
    ledger = rounds_ledger()
    ledger.advance(steps)
    assert ledger.composed_event().events[0].count == rounds
    expected = _engine.epsilon([(dp_accounting.GaussianDpEvent(2.0), rounds)], DELTA)
    assert ledger.epsilon(DELTA) == expected


def test_steps_within_budget_stops_at_the_end_of_a_round():
    ledger = rounds_ledger(sigma=3.0)
    ledger.advance(3)
    budget = bandmf.fixed_order_epsilon(3.0, 40, 10, 4, DELTA)  # exactly 4 rounds
    k = ledger.steps_within_budget(budget, DELTA)
    assert k == 37  # to the end of round 4; step 41 would start a 5th participation
    assert ledger.epsilon(DELTA, extra_steps=k) <= budget < ledger.epsilon(DELTA, extra_steps=k + 1)


def test_new_segment_counts_two_streams_apart():
    merged, split = rounds_ledger(), rounds_ledger()
    merged.advance(15)
    split.advance(15)
    event = dp_accounting.GaussianDpEvent(2.0)
    merged.begin_steps(event, steps_per_round=10, relation="zero_out")  # same stream: no-op
    split.begin_steps(event, steps_per_round=10, relation="zero_out", new_segment=True)
    merged.advance(15)
    split.advance(15)
    assert [e.count for e in merged.composed_event().events] == [3]
    assert [e.count for e in split.composed_event().events] == [2, 2]


def test_rounds_survive_json_and_old_ledgers_are_written_as_before():
    ledger = rounds_ledger()
    ledger.advance(25)
    text = ledger.to_json()
    data = json.loads(text)
    assert data["version"] == 2
    assert data["open"]["steps_per_round"] == 10 and data["open"]["relation"] == "zero_out"
    restored = PrivacyLedger.from_json(text)
    assert restored.epsilon(DELTA) == ledger.epsilon(DELTA)
    assert restored.relation == "zero_out"
    assert restored.open_segment == ledger.open_segment

    plain = PrivacyLedger()
    plain.begin_steps(dpsgd_event(1.1, 0.01))
    plain.advance(7)
    assert plain.to_json().startswith(  # then its checksum (tfdp.accounting.integrity)
        '{"format": "tfdp.PrivacyLedger", "version": 1, "steps": 7, "segments": [], '
        '"open": {"event": {"type": "PoissonSampledDpEvent", "sampling_probability": 0.01, '
        '"event": {"type": "GaussianDpEvent", "noise_multiplier": 1.1}}, "start": 0}, '
        '"records": [], "sha256": "'
    )


def test_a_version_1_ledger_ignores_round_fields_and_bad_rounds_are_corrupt():
    ledger = rounds_ledger()
    ledger.advance(25)
    data = json.loads(ledger.to_json())
    del data["sha256"]  # a ledger saved before checksums
    data["version"] = 1  # a version-1 reader never counted rounds: per step
    with pytest.warns(UserWarning, match="without a checksum"):
        assert PrivacyLedger.from_json(json.dumps(data)).composed_event().events[0].count == 25
    data["version"] = 2
    data["open"]["steps_per_round"] = 0
    with pytest.raises(ValueError, match="Corrupt privacy ledger.*steps_per_round"):
        PrivacyLedger.from_json(json.dumps(data))


def test_relation_and_statement_name_the_zero_out_relation():
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(1.0, 0.01))
    ledger.advance(5)
    assert ledger.relation == "add_or_remove"
    assert "adding or removing any one training record" in ledger.statement(DELTA)
    ledger.begin_steps(dp_accounting.GaussianDpEvent(2.0), steps_per_round=10,
                       relation="zero_out")
    assert ledger.relation == "add_or_remove"  # no step ran under it yet
    ledger.advance(1)
    assert ledger.relation == "zero_out"
    text = ledger.statement(DELTA)
    assert "replacing any one training record by one that contributes nothing" in text
    assert "adding or removing" not in text
    assert "at most once every 10 steps (a fixed data order): 1 round(s)" in text
    amplified = PrivacyLedger()
    amplified.begin_steps(bandmf.amplified_round_event(1.0, 0.1), steps_per_round=4)
    amplified.advance(9)
    text = amplified.statement(DELTA)
    assert "adding or removing" in text
    assert "sampled at most once every 4 steps (cyclic Poisson sampling): 3 round(s)" in text


def test_begin_steps_refuses_bad_counting():
    ledger = PrivacyLedger()
    with pytest.raises(ValueError, match="steps_per_round"):
        ledger.begin_steps(dp_accounting.GaussianDpEvent(1.0), steps_per_round=0)
    with pytest.raises(ValueError, match="relation"):
        ledger.begin_steps(dp_accounting.GaussianDpEvent(1.0), relation="replace_one")


# -- one band is DP-SGD --------------------------------------------------------


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_one_band_amplified_equals_dp_sgd_exactly(accountant):
    sigma, q, steps = 1.1, 0.01, 700
    dpsgd = compute_epsilon(sigma, q, steps, DELTA, accountant)
    assert bandmf.amplified_epsilon(sigma, steps, 1, q, DELTA, accountant) == dpsgd
    ledger = PrivacyLedger()
    ledger.begin_steps(bandmf.amplified_round_event(sigma, q), steps_per_round=1)
    ledger.advance(steps)
    assert ledger.epsilon(DELTA, accountant) == dpsgd


def test_b_bands_amplified_is_dp_sgd_over_rounds():
    assert bandmf.amplified_epsilon(1.1, 4 * 300, 4, 0.01, DELTA) == compute_epsilon(
        1.1, 0.01, 300, DELTA)
    assert bandmf.amplified_event(1.1, 4 * 300 + 1, 4, 0.01).count == 301


# -- fixed order against a dense sensitivity computation --------------------------


def dense_strategy(c, n):
    matrix = np.zeros((n, n))
    for lag, value in enumerate(c):
        matrix += value * np.eye(n, k=-lag)
    return matrix


def max_sensitivity(c, n, separation):
    """max ||C u|| over 0/1 participation vectors u whose ones are at least
    `separation` apart (brute force over all 2^n patterns), and the most
    participations such a pattern has."""
    strategy = dense_strategy(c, n)
    best, most = 0.0, 0
    for pattern in itertools.product([0, 1], repeat=n):
        steps = np.flatnonzero(pattern)
        if len(steps) > 1 and np.min(np.diff(steps)) < separation:
            continue
        best = max(best, float(np.linalg.norm(strategy @ np.array(pattern, float))))
        most = max(most, len(steps))
    return best, most


@pytest.mark.parametrize("bands,separation,n", [(2, 2, 12), (3, 3, 12), (3, 5, 13), (4, 4, 12)])
def test_sensitivity_is_sqrt_participations_when_separation_is_at_least_the_bands(
        bands, separation, n):
    # n is chosen so that the last participation's band fits in the run
    # (a participation in the last b - 1 steps touches fewer rows: less).
    c = optimal_coefficients(bands, n)
    sensitivity, most = max_sensitivity(c, n, separation)
    assert most == math.ceil(n / separation)
    assert sensitivity == pytest.approx(math.sqrt(most), rel=1e-12)
    assert max_sensitivity(c, n - 1, separation)[0] <= math.sqrt(most) * (1 + 1e-12)
    # so the run is one Gaussian mechanism of multiplier sigma / sqrt(k), as counted
    sigma = 3.0
    dense = _engine.epsilon(
        [(dp_accounting.GaussianDpEvent(bandmf.noise_multiplier_of_sensitivity(sigma, sensitivity)), 1)],
        DELTA)
    assert bandmf.fixed_order_epsilon(sigma, n, separation, bands, DELTA) == pytest.approx(
        dense, rel=1e-9)


@pytest.mark.parametrize("bands", [2, 3, 4])
def test_closer_participations_exceed_sqrt_participations_and_are_refused(bands):
    n, separation = 12, bands - 1
    c = optimal_coefficients(bands, n)
    sensitivity, most = max_sensitivity(c, n, separation)
    assert sensitivity > math.sqrt(most) * (1 + 1e-3)
    with pytest.raises(ValueError, match="at least `bands`"):
        bandmf.fixed_order_epsilon(3.0, n, separation, bands, DELTA)
    with pytest.raises(ValueError, match="at least `bands`"):
        bandmf.calibrate_fixed_order(1.0, DELTA, n, separation, bands)


def test_calibration_meets_the_target():
    sigma = bandmf.calibrate_fixed_order(2.0, DELTA, 600, 30, 16)
    assert bandmf.fixed_order_epsilon(sigma, 600, 30, 16, DELTA) <= 2.0
    assert bandmf.fixed_order_epsilon(sigma / 1.001, 600, 30, 16, DELTA) > 2.0


# -- jax-privacy's published numbers -------------------------------------------------


def test_jax_privacy_published_numbers():
    """jax_privacy/experimental/accounting.py documents, for DP-SGD (its
    amplified_bandmf_event with num_bands=1 is that event, and with b bands
    it is DP-SGD over ceil(iterations / b) rounds): noise 3, 512 iterations,
    sampling probability 0.1 -> PLD epsilon 3.77 at delta 1e-6; calibrated
    for epsilon 1 -> noise multiplier 9.66."""
    for bands in (1, 4):
        epsilon = bandmf.amplified_epsilon(3.0, 512 * bands, bands, 0.1, 1e-6, accountant="pld")
        assert round(epsilon, 2) == 3.77
    sigma = bandmf.calibrate_amplified(1.0, 1e-6, 512, 1, 0.1, accountant="pld")
    assert round(sigma, 2) == 9.66
