"""A budget stop says so once: on the progress output (a line after the
bar, as EarlyStopping's "Epoch 5: early stopping"), in the logger "tfdp"
and in the stopping epoch's logs (History), with the epsilon spent.

Before, training ended at "Epoch 2/3" without a word.
"""

import logging
import re

import pytest

import tfdp
from tests.callbacks.test_budget_logs import DELTA, compiled_model, epsilon_after, exact_budget, small_data

STOP_LINE = re.compile(
    r"^Epoch (\d+): the privacy budget stopped training after step (\d+): epsilon=([0-9.]+) "
    r"\(delta=1e-05\) of the budget epsilon=([0-9.]+); one more step would spend epsilon=([0-9.]+)\."
    r"( The noise multiplier is too small for this fit's plan: the budget affords \d+ of its "
    r"\d+ steps at noise_multiplier=[0-9.]+\. Calibrate the noise for the plan .*)?$",
    flags=re.M,
)


@pytest.mark.parametrize("verbose", [1, 2])
def test_a_budget_stop_is_said_once_with_the_epsilon_spent(capsys, caplog, verbose):
    x, y = small_data(40)
    model = compiled_model()
    budget = exact_budget(6, 1.0, 0.25)  # 3 epochs of 4 steps planned; room for 6
    with caplog.at_level(logging.INFO, logger="tfdp"):
        history = model.fit(x, y, batch_size=10, epochs=3, verbose=verbose, callbacks=[budget])
    assert model.privacy.steps == 6 and budget.stopped_for_budget
    out = capsys.readouterr().out
    said = STOP_LINE.findall(out)
    assert len(said) == 1, out
    epoch, step, spent, limit, next_step, short_plan = said[0]
    assert (epoch, step) == ("2", "6")
    # The stop cut the plan short: 6 of the 12 planned steps, and it says why.
    assert "the budget affords 6 of its 12 steps at noise_multiplier=1." in short_plan
    assert float(spent) == pytest.approx(epsilon_after(6, 1.0, 0.25), abs=1e-4)
    assert float(limit) == pytest.approx(budget.epsilon, abs=1e-4)
    assert float(next_step) == pytest.approx(epsilon_after(7, 1.0, 0.25), abs=1e-4)
    assert float(next_step) > budget.epsilon
    logged = [r.getMessage() for r in caplog.records if "privacy budget stopped" in r.getMessage()]
    assert len(logged) == 1 and STOP_LINE.match(logged[0])
    # History: the stopping epoch's logs say it, next to its epsilon.
    assert history.history["stopped_for_budget"] == [1.0]
    assert history.history["epsilon"][-1] == pytest.approx(float(spent), abs=1e-4)
    assert budget.stop_message == logged[0]


def test_verbose_0_prints_nothing_but_logs_and_history_say_it(capsys, caplog):
    x, y = small_data(40)
    model = compiled_model()
    budget = exact_budget(6, 1.0, 0.25)
    with caplog.at_level(logging.INFO, logger="tfdp"):
        history = model.fit(x, y, batch_size=10, epochs=3, verbose=0, callbacks=[budget])
    assert capsys.readouterr().out == ""
    assert [r for r in caplog.records if "privacy budget stopped" in r.getMessage()]
    assert history.history["stopped_for_budget"] == [1.0]


def test_no_word_when_the_budget_did_not_cut_training(capsys, caplog):
    """Controls: the last planned step used the budget up; no budget at all."""
    x, y = small_data(40)
    for budget in (exact_budget(8, 1.0, 0.25), tfdp.callbacks.PrivacyBudget(delta=DELTA)):
        model = compiled_model()
        with caplog.at_level(logging.INFO, logger="tfdp"):
            history = model.fit(x, y, batch_size=10, epochs=2, verbose=2, callbacks=[budget])
        assert "privacy budget" not in capsys.readouterr().out
        assert not [r for r in caplog.records if "privacy budget stopped" in r.getMessage()]
        assert "stopped_for_budget" not in history.history
        assert budget.stop_message is None
