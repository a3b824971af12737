"""dp_accounting's "_compute_log_a_frac failed to converge" warnings stay out of
tfdp's logs, and epsilon is still dp_accounting's own, bit for bit.

At sampling rates above about 0.06 (sigma near 1) dp_accounting cannot sum
the series of some fractional orders; it gives them infinite RDP (a valid,
unused bound) and logs one warning per order, at every epsilon query.
"""

import logging

import dp_accounting
import keras
import numpy as np
import pytest

import tfdp
from tfdp.accounting import _engine

DELTA = 1e-5


class Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def absl_warnings():
    handler = Records()
    logger = logging.getLogger("absl")
    logger.addHandler(handler)
    _engine._cached_rdp_vector.cache_clear()  # every query below reaches dp_accounting
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def dp_accounting_epsilon(sigma, q, steps):
    accountant = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("q", [0.0625, 0.25, 0.5])
def test_epsilon_is_dp_accountings_and_no_warning_is_logged(absl_warnings, q):
    epsilon = tfdp.accounting.compute_epsilon(1.0, q, 100, DELTA)
    assert absl_warnings == []
    # Negative control: dp_accounting itself warns at these settings...
    expected = dp_accounting_epsilon(1.0, q, 100)
    assert any("failed to converge" in r.getMessage() for r in absl_warnings)
    # ... and tfdp's epsilon is exactly the one it gives (the excluded orders included).
    assert epsilon == expected


def test_other_absl_warnings_still_pass(absl_warnings):
    with _engine._quiet_unconverged_orders():
        logging.getLogger("absl").warning("something else")
    assert [r.getMessage() for r in absl_warnings] == ["something else"]


def test_no_absl_warning_during_a_fit_at_q_one_quarter(absl_warnings):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype(np.float32), rng.integers(0, 3, size=32)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    budget = tfdp.callbacks.PrivacyBudget(epsilon=50.0, delta=DELTA)
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[budget], verbose=0)  # q = 8 / 32
    assert model.privacy.steps == 8
    assert absl_warnings == []
    assert model.privacy.epsilon(DELTA) == dp_accounting_epsilon(1.0, 0.25, 8)
