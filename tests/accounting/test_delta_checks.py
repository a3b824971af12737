"""A delta that protects no one is refused (delta >= 1) or warned about
(delta > 1/N, where the dataset size N is known).

An (epsilon, delta) guarantee allows, with probability delta, anything: a
mechanism that publishes each record in full with probability delta meets
(0, delta)-DP, and at delta > 1/N it publishes more than one record on
average. Before, `tfdp epsilon --delta 0.5` printed "epsilon": 0.0 without a
word.
"""

import warnings

import dp_accounting
import keras
import numpy as np
import pytest

import tfdp
from tfdp import accounting
from tfdp.accounting import LargeDeltaWarning

N, BATCH, SIGMA, EPOCHS = 100, 25, 1.0, 2


def large_delta_warnings(function, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        function(*args, **kwargs)
    return [str(w.message) for w in caught if issubclass(w.category, LargeDeltaWarning)]


@pytest.mark.parametrize("function, args", [
    (accounting.compute_dpsgd_epsilon, (N, BATCH, SIGMA, EPOCHS)),
    (accounting.calibrate_dpsgd, (N, BATCH, EPOCHS, 8.0)),
])
def test_delta_above_one_over_n_warns_where_n_is_known(function, args):
    said = large_delta_warnings(function, *args, delta=0.5)
    assert len(said) == 1
    assert "1/N = 0.01" in said[0] and "Received: delta=0.5, num_examples=100" in said[0]
    # Controls: at 1/N (fit's default delta for N < 100,000) and below, nothing.
    assert large_delta_warnings(function, *args, delta=1 / N) == []
    assert large_delta_warnings(function, *args, delta=1e-5) == []


def _ledger():
    ledger = accounting.PrivacyLedger()
    ledger.begin_steps(accounting.dpsgd_event(SIGMA, BATCH / N))
    ledger.advance(8)
    return ledger


@pytest.mark.parametrize("delta", [1.0, 1.5])
@pytest.mark.parametrize("call", [
    lambda d: accounting.compute_epsilon(SIGMA, 0.25, 8, d),
    lambda d: accounting.compute_dpsgd_epsilon(N, BATCH, SIGMA, EPOCHS, d),
    lambda d: accounting.calibrate_noise_multiplier(8.0, d, 0.25, 8),
    lambda d: accounting.calibrate_dpsgd(N, BATCH, EPOCHS, 8.0, d),
    lambda d: _ledger().epsilon(d),
    lambda d: _ledger().steps_within_budget(8.0, d),
    lambda d: _ledger().statement(d),
    lambda d: accounting.privacy_statement(1.0, d, 8),
    lambda d: accounting.bandmf.fixed_order_epsilon(SIGMA, 8, 4, 2, d),
    lambda d: tfdp.callbacks.PrivacyBudget(epsilon=3.0, delta=d),
], ids=["compute_epsilon", "compute_dpsgd_epsilon", "calibrate_noise_multiplier",
        "calibrate_dpsgd", "ledger.epsilon", "ledger.steps_within_budget", "ledger.statement",
        "privacy_statement", "bandmf", "PrivacyBudget"])
def test_delta_of_one_or_more_is_refused_everywhere(call, delta):
    with pytest.raises(ValueError, match="delta"):
        call(delta)


def test_a_budget_with_delta_above_one_over_n_warns_before_the_first_step():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 4)).astype(np.float32), rng.integers(0, 3, 40)

    def fit(delta):
        model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        budget = tfdp.callbacks.PrivacyBudget(epsilon=None, delta=delta)
        return large_delta_warnings(model.fit, x, y, batch_size=10, epochs=1, verbose=0,
                                    callbacks=[budget])

    said = fit(0.1)
    assert len(said) == 1 and "num_examples=40" in said[0] and "1/N = 0.025" in said[0]
    assert fit(1e-5) == []  # control
