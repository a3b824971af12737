"""Tests for tfdp.accounting.calibration: epsilon of settings, noise for a target."""

import math

import dp_accounting
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfdp.accounting import (
    PrivacyLedger,
    calibrate_dpsgd,
    calibrate_noise_multiplier,
    compute_dpsgd_epsilon,
    compute_epsilon,
    dpsgd_event,
)
from tfdp.accounting.calibration import SIGMA_MAX, SIGMA_MIN, dpsgd_steps


def test_golden_values_from_tensorflow_privacy():
    # tensorflow-privacy compute_dp_sgd_privacy_test: (N, batch, sigma, epochs, delta) -> eps
    assert compute_dpsgd_epsilon(60000, 150, 1.3, 15, 1e-5) == pytest.approx(0.7242234026109595, rel=1e-9)
    assert compute_dpsgd_epsilon(100000, 100, 1.0, 30, 1e-7) == pytest.approx(1.4154988495444845, rel=1e-9)
    assert compute_epsilon(1.3, 150 / 60000, 6000, 1e-5) == compute_dpsgd_epsilon(60000, 150, 1.3, 15, 1e-5)


def test_compute_epsilon_matches_dp_accounting():
    for accountant, reference in [
        ("rdp", dp_accounting.rdp.RdpAccountant()),
        ("pld", dp_accounting.pld.PLDAccountant()),
    ]:
        reference.compose(dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.2)), 800)
        assert compute_epsilon(1.2, 0.02, 800, 1e-6, accountant=accountant) == pytest.approx(
            reference.get_epsilon(1e-6), rel=1e-12
        )
    assert compute_epsilon(1.2, 0.02, 0, 1e-6) == 0.0
    assert compute_epsilon(1.2, 0.02, 800, 1e-6, conversion="classic") > compute_epsilon(1.2, 0.02, 800, 1e-6)


def test_dpsgd_steps_convention():
    assert dpsgd_steps(60000, 150, 15) == 6000
    assert dpsgd_steps(1000, 300, 1) == 3  # fit's epoch: round(1000 / 300) steps
    assert dpsgd_steps(1000, 280, 10) == 40  # not ceil(10 * 1000 / 280) = 36
    assert dpsgd_steps(1000, 300, 0.5) == 2  # a partial epoch's last step counts
    assert dpsgd_steps(30, 10, 0.1 * 3) == 1  # float noise does not add a step
    assert dpsgd_steps(100, 100, 0) == 0
    with pytest.raises(ValueError, match="batch is larger than the dataset. Received: batch_size=101"):
        dpsgd_steps(100, 101, 1)
    with pytest.raises(ValueError, match="batch is larger than the dataset"):
        compute_dpsgd_epsilon(100, 101, 1.0, 1, 1e-5)
    with pytest.raises(ValueError, match="Received: num_examples=0"):
        dpsgd_steps(0, 1, 1)
    with pytest.raises(ValueError, match="Received: epochs=-1"):
        dpsgd_steps(100, 10, -1)
    with pytest.raises(ValueError, match="Received: epochs=1e\\+300"):
        dpsgd_steps(100, 10, 1e300)


def _check_calibration(target, delta, q, steps, tolerance=1e-4, accountant="rdp"):
    sigma = calibrate_noise_multiplier(target, delta, q, steps, accountant=accountant, tolerance=tolerance)
    assert SIGMA_MIN <= sigma <= SIGMA_MAX
    assert compute_epsilon(sigma, q, steps, delta, accountant=accountant) <= target
    if sigma > SIGMA_MIN:
        # Negative control: a sigma just below the answer must exceed the target.
        smaller = sigma / (1 + tolerance)
        assert compute_epsilon(smaller, q, steps, delta, accountant=accountant) > target
    return sigma


@pytest.mark.parametrize(
    "target, delta, q, steps",
    [
        (0.7242234026109595, 1e-5, 0.0025, 6000),
        (3.0, 1e-5, 256 / 60000, 14040),
        (1.0, 1e-5, 0.01, 1000),
        (8.0, 1e-6, 0.1, 100),
        (0.5, 1e-5, 1.0, 10),
        (50.0, 1e-5, 0.5, 5),
    ],
)
def test_calibration_never_exceeds_the_target_and_is_tight(target, delta, q, steps):
    _check_calibration(target, delta, q, steps)


def test_calibration_recovers_the_golden_sigma():
    sigma = calibrate_dpsgd(60000, 150, 15, target_epsilon=0.7242234026109595, delta=1e-5)
    assert sigma == pytest.approx(1.3, rel=1e-4)
    assert sigma >= 1.3 * (1 - 1e-12) or compute_dpsgd_epsilon(60000, 150, sigma, 15, 1e-5) <= 0.7242234026109595


def test_calibration_with_pld():
    sigma = _check_calibration(0.5, 1e-5, 0.01, 500, tolerance=1e-2, accountant="pld")
    assert sigma <= calibrate_noise_multiplier(0.5, 1e-5, 0.01, 500, tolerance=1e-2) * 1.02


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(
    target=st.floats(0.2, 30.0),
    log_delta=st.floats(-9.0, -3.0),
    q=st.floats(1e-3, 1.0),
    steps=st.integers(1, 20000),
)
def test_calibration_property(target, log_delta, q, steps):
    _check_calibration(target, 10.0**log_delta, q, steps, tolerance=1e-3)


def test_unreachable_target_raises():
    with pytest.raises(ValueError, match=r"cannot be reached.*Received: target_epsilon=0\.001"):
        calibrate_noise_multiplier(0.001, 1e-5, 1.0, 10**6)


def test_easy_target_returns_the_bottom_of_the_bracket():
    assert calibrate_noise_multiplier(1e6, 1e-5, 0.01, 10) == SIGMA_MIN


def test_calibration_on_top_of_a_ledger():
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(1.0, 0.01))
    ledger.advance(2000)
    spent = ledger.epsilon(1e-5)
    target = spent + 1.0
    sigma = calibrate_noise_multiplier(target, 1e-5, 0.02, 1000, tolerance=1e-3, ledger=ledger)
    ledger.begin_steps(dpsgd_event(sigma, 0.02))
    assert ledger.epsilon(1e-5, extra_steps=1000) <= target
    # What was already spent costs noise: more than for the same target from scratch.
    assert sigma > calibrate_noise_multiplier(target, 1e-5, 0.02, 1000, tolerance=1e-3)
    with pytest.raises(ValueError, match="already spent epsilon"):
        calibrate_noise_multiplier(spent / 2, 1e-5, 0.02, 1000, ledger=ledger)


def test_calibrate_dpsgd_is_calibrate_noise_multiplier():
    assert calibrate_dpsgd(50000, 500, 10, 2.0, 1e-5) == calibrate_noise_multiplier(2.0, 1e-5, 0.01, 1000)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"target_epsilon": 0}, "target_epsilon"),
        ({"target_epsilon": -1}, "target_epsilon"),
        ({"target_epsilon": math.inf}, "target_epsilon"),
        ({"target_epsilon": math.nan}, "target_epsilon"),
        ({"target_epsilon": "3"}, "target_epsilon"),
        ({"delta": 0}, "delta"),
        ({"delta": 1.5}, "delta"),
        ({"sampling_probability": 0}, "sampling_probability"),
        ({"sampling_probability": 1.01}, "sampling_probability"),
        ({"steps": 0}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"steps": None}, "steps"),
        ({"tolerance": 0}, "tolerance"),
        ({"tolerance": 1}, "tolerance"),
        ({"accountant": "RDP"}, "accountant"),
    ],
)
def test_calibration_refuses_bad_arguments(kwargs, name):
    arguments = {"target_epsilon": 1.0, "delta": 1e-5, "sampling_probability": 0.01, "steps": 100}
    arguments.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=f"`{name}`.*Received: {name}="):
        calibrate_noise_multiplier(**arguments)


def test_pld_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="Too many releases for the PLD accountant"):
        calibrate_noise_multiplier(1.0, 1e-5, 0.01, 2 * 10**6, accountant="pld")
