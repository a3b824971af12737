"""Epsilon per step only when something reads step logs; the stop stays exact.

With nothing reading step logs (verbose=0, no batch callback) PrivacyBudget
computes epsilon once per epoch, and a budget without `epsilon` lets Keras
run step callbacks off the training thread. Any reader gets the exact
epsilon of each step, and a budget with `epsilon` stops at its step limit.
"""

import keras
import numpy as np
import pytest

import tfdp
from tfdp.accounting import PrivacyLedger

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
DELTA = 1e-5


def _fit(callbacks, verbose=0, epochs=2):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 4)).astype(np.float32), rng.integers(0, 3, 40)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
                  loss=LOSS)
    history = model.fit(x, y, batch_size=10, epochs=epochs, callbacks=callbacks, verbose=verbose)
    return model, history


def _count_epsilon_queries(monkeypatch):
    calls = []
    original = PrivacyLedger.epsilon

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("extra_steps", 0))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PrivacyLedger, "epsilon", counted)
    return calls


def test_no_epsilon_per_step_when_nothing_reads_step_logs(monkeypatch):
    calls = _count_epsilon_queries(monkeypatch)
    budget = tfdp.callbacks.PrivacyBudget(delta=DELTA)
    model, history = _fit([budget])
    assert model.privacy.steps == 8
    assert len(calls) == 2  # one per epoch end (before: one per step, 10)
    assert budget.async_safe and not budget.step_logs_read
    assert history.history["epsilon"][-1] == pytest.approx(
        tfdp.accounting.compute_epsilon(1.0, 0.25, 8, DELTA), rel=1e-9)


class StepLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epsilons = []

    def on_train_batch_end(self, batch, logs=None):
        self.epsilons.append(logs["epsilon"])


def test_a_step_log_reader_gets_the_exact_epsilon_of_every_step():
    budget, reader = tfdp.callbacks.PrivacyBudget(delta=DELTA), StepLogs()
    _fit([budget, reader])
    assert budget.step_logs_read and not budget.async_safe
    expected = [tfdp.accounting.compute_epsilon(1.0, 0.25, k, DELTA) for k in range(1, 9)]
    np.testing.assert_allclose(reader.epsilons, expected, rtol=1e-9)


@pytest.mark.parametrize("verbose", [0, 2])
def test_a_budget_still_stops_before_the_step_that_would_exceed_it(verbose):
    limit = tfdp.accounting.compute_epsilon(1.0, 0.25, 5, DELTA)
    budget = tfdp.callbacks.PrivacyBudget(epsilon=limit * (1 + 1e-9), delta=DELTA)
    model, _ = _fit([budget], verbose=verbose, epochs=3)
    assert not budget.async_safe  # the stop check runs on the training thread
    assert model.privacy.steps == 5 and budget.stopped_for_budget
    assert model.privacy.epsilon(DELTA) <= budget.epsilon


def test_progress_bar_reads_step_logs_only_with_verbose_1():
    budget = tfdp.callbacks.PrivacyBudget()
    bar = tfdp.callbacks.ProgbarLogger()
    tfdp.callbacks.mark_step_log_readers([budget, bar], verbose=2)
    assert not budget.step_logs_read
    tfdp.callbacks.mark_step_log_readers([budget, bar], verbose=1)
    assert budget.step_logs_read
