"""What PrivacyBudget and tfdp's ProgbarLogger put in front of the user.

Epsilon in the live progress bar (mid-epoch) and in TensorBoard, a budget
stop that tells the truth (stopped_for_budget, the epoch line's step count),
and the "nonfinite_examples" count logged only when there is something to
report.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
DELTA = 1e-5


def small_data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, size=n)


def compiled_model(sigma=1.0):
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=sigma, seed=0),
        loss=LOSS,
    )
    return model


def epsilon_after(steps, sigma, q):
    return tfdp.accounting.compute_epsilon(sigma, q, steps, DELTA)


def test_live_progress_bar_shows_the_epsilon_of_each_step(capsys):
    # 40 examples, batch 10: 4 steps an epoch at q = 0.25. Keras's bar prints
    # its first update (step 1 of 4) whatever the step time.
    x, y = small_data(40)
    model = compiled_model()
    budget = tfdp.callbacks.PrivacyBudget(epsilon=None, delta=DELTA)
    model.fit(x, y, batch_size=10, epochs=1, callbacks=[budget], verbose=1)
    text = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # the bar's colours
    lines = [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()]
    first_step = [line for line in lines if line.startswith("1/4")]
    assert first_step, lines
    shown = re.search(r"epsilon: ([0-9.e+-]+)", first_step[0])
    assert shown, first_step[0]  # before: epsilon appeared only when the epoch ended
    assert float(shown.group(1)) == pytest.approx(epsilon_after(1, 1.0, 0.25), abs=1e-4)


def test_tensorboard_event_files_hold_epsilon(tmp_path):
    x, y = small_data(40)
    model = compiled_model()
    history = model.fit(
        x, y, batch_size=10, epochs=2, verbose=0,
        callbacks=[keras.callbacks.TensorBoard(log_dir=str(tmp_path), update_freq="epoch")],
    )
    values = []
    for path in sorted((tmp_path / "train").glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag == "epoch_epsilon":
                    values.append((event.step, float(tf.make_ndarray(value.tensor))))
    assert [step for step, _ in sorted(values)] == [0, 1]
    np.testing.assert_allclose([v for _, v in sorted(values)], history.history["epsilon"], rtol=1e-6)


def exact_budget(steps, sigma, q):
    """A budget that leaves room for exactly `steps` steps."""
    budget = epsilon_after(steps, sigma, q)
    assert epsilon_after(steps + 1, sigma, q) > budget
    return tfdp.callbacks.PrivacyBudget(epsilon=budget, delta=DELTA)


def test_budget_used_up_by_the_last_planned_step_is_not_a_budget_stop():
    x, y = small_data(40)
    model = compiled_model()
    budget = exact_budget(8, 1.0, 0.25)  # 2 epochs of 4 steps: all planned steps fit
    history = model.fit(x, y, batch_size=10, epochs=2, callbacks=[budget], verbose=0)
    assert model.privacy.steps == 8 and len(history.epoch) == 2
    assert budget.stopped_for_budget is False  # before: True


@pytest.mark.parametrize("own_bar", [True, False])
def test_budget_stop_mid_epoch_tells_the_truth(capsys, own_bar):
    # With or without the user passing tfdp's bar: DPModel.fit uses it.
    x, y = small_data(40)
    model = compiled_model()
    budget = exact_budget(6, 1.0, 0.25)  # 3 epochs of 4 steps planned; room for 6
    bar = [tfdp.callbacks.ProgbarLogger()] if own_bar else []
    history = model.fit(x, y, batch_size=10, epochs=3, verbose=2, callbacks=[budget] + bar)
    assert model.privacy.steps == 6 and len(history.epoch) == 2
    assert budget.stopped_for_budget is True
    counts = re.findall(r"^(\d+/\d+) - ", capsys.readouterr().out, flags=re.M)
    assert counts == ["4/4", "2/4"]  # Keras's own bar says 4/4 for the cut epoch


def test_nonfinite_count_is_logged_only_when_not_zero(capsys):
    x, y = small_data(40)
    model = compiled_model()
    history = model.fit(x, y, batch_size=10, epochs=1, verbose=2)
    assert "nonfinite_examples" not in history.history
    assert "nonfinite_examples" not in capsys.readouterr().out
    # Control: with NaN rows the count appears (and is kept in History).
    x[:5] = np.nan
    history = model.fit(x, y, batch_size=40, epochs=1, steps_per_epoch=1, verbose=2)
    assert history.history["nonfinite_examples"][-1] > 0
    assert "nonfinite_examples" in capsys.readouterr().out
