"""DPIS releases only what it accounts (issue 14, items 4 and 5).

Logs hold released values by default, the padded batch length comes from
released values, a float32 underflow cannot push a weighted term above
K~ / N~, and a `PrivacyBudget` is never overrun by DPIS's own releases.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.accounting import PrivacyLedger
from tfdp.mechanisms import importance_sampling as isp
from tfdp.per_example import MaterializedGrads, PerExampleGradients

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
N, B, DELTA = 240, 16, 1e-5


def data(scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    return scale * x, y


def model_with(optimizer, use_bias=True):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2, use_bias=use_bias)])
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


def dpis(**overrides):
    settings = dict(learning_rate=0.5, l2_norm_clip=1.0, target_epsilon=4.0, epochs=3,
                    sigma_n=5.0, seed=1)
    settings.update(overrides)
    return tfdp.optimizers.DPIS(**settings)


PRIVATE_LOGS = ("batch_size", "stage1_rate", "stage2_rate")


def test_default_logs_and_padding_hold_released_values_only(monkeypatch):
    """Two datasets with very different private gradient norms and the same
    released N~ and K~ (the K' release is fixed here) get the same padded
    batch length, and by default no un-noised statistic reaches History.

    Broken variants caught: `log_sampling_stats=True` by default (History
    held the realised batch size and stage rates), and a padded length read
    from the un-noised sum of the ghat table (it differed between the two
    datasets: 16 against 176).
    """
    monkeypatch.setattr(isp, "noisy_norm_sum", lambda *args, **kwargs: 100.0)
    padded, released = [], []
    for scale in (1e-3, 10.0):  # gradients far below, and at, the clip bound
        optimizer = dpis()
        model = model_with(optimizer, use_bias=False)  # gradients scale with x
        history = model.fit(*data(scale), batch_size=B, epochs=1, verbose=0)
        for key in PRIVATE_LOGS:
            assert key not in history.history, key
        assert "sigma_g" in history.history and "k_tilde" in history.history
        epoch = optimizer.epoch_history[0]
        padded.append(epoch["padded_size"])
        released.append((epoch["n_tilde"], epoch["k_tilde"]))
    assert released[0] == released[1]
    assert padded[0] == padded[1]
    opted_in = model_with(dpis(log_sampling_stats=True))
    history = opted_in.fit(*data(), batch_size=B, epochs=1, verbose=0)
    for key in PRIVATE_LOGS:
        assert key in history.history, key


def test_an_underflowing_norm_cannot_raise_a_term_above_k_tilde_over_n_tilde():
    """One coordinate at 1e-18 and ten thousand at 3e-20: float32 squares of
    the small ones underflow, and the computed norm (1e-18) is a third of the
    true one (3.16e-18).

    Broken variant caught: weighting by the underflowed norm, which gave the
    accepted term a norm of 3.16 K~/N~. Control: an ordinary gradient's term
    still has norm K~/N~.
    """
    k_tilde, n_tilde = 40.0, 1000.0
    tiny = np.full(10001, 3e-20, np.float32)
    tiny[0] = 1e-18
    ordinary = np.linspace(-1.0, 1.0, 10001).astype(np.float32)
    grads = np.stack([tiny, ordinary])
    variable = tf.Variable(tf.zeros([10001]))
    per_example = PerExampleGradients([variable], [MaterializedGrads([variable], [tf.constant(grads)])])
    stage = isp.second_stage(
        per_example.sq_norms(), ghat=tf.constant([1e-20, 1.0]), clip=1.0,
        uniform=tf.zeros([2]), mask=tf.ones([2]),
    )
    assert stage["accepted"].numpy().all()
    weights = isp.importance_weights(stage["norms"], stage["accepted"], k_tilde, n_tilde).numpy()
    terms = np.linalg.norm(weights[:, None].astype(np.float64) * grads.astype(np.float64), axis=1)
    bound = k_tilde / n_tilde
    assert terms[0] <= bound * (1 + 1e-6), terms[0] / bound
    assert terms[1] == pytest.approx(bound, rel=1e-5)


def test_a_privacy_budget_is_never_overrun_by_dpis_releases():
    """The budget sits between the epsilon after the first epoch and that
    plus the second epoch's K~ release; a budget below the first releases
    refuses to start.

    Broken variant caught: releasing K~ (and N~) before checking the budget,
    which ended above the budget (the K~ release of the second epoch, or N~
    and K~ of a fit that then refused to start, were charged anyway).
    """
    x, y = data()
    first = model_with(dpis(sigma_k=0.6, target_epsilon=8.0))
    first.fit(x, y, batch_size=B, epochs=1, verbose=0)
    after_epoch = first.privacy.epsilon(DELTA)
    n_tilde = first.optimizer.n_tilde
    projected = PrivacyLedger.from_json(first.privacy.to_json())
    projected.record(isp.norm_sum_event(0.6, B / n_tilde))
    with_release = projected.epsilon(DELTA)
    budget_value = (after_epoch + with_release) / 2
    # Room for several more steps of the first epoch's event: only the K~
    # release of the second epoch does not fit.
    assert first.privacy.epsilon(DELTA, extra_steps=3) < budget_value

    model = model_with(dpis(sigma_k=0.6, target_epsilon=8.0))
    budget = tfdp.callbacks.PrivacyBudget(epsilon=budget_value, delta=DELTA)
    model.fit(x, y, batch_size=B, epochs=3, callbacks=[budget], verbose=0)
    assert model.privacy.epsilon(DELTA) <= budget_value
    assert model.privacy.steps == N // B  # it stopped after the first epoch

    tight = model_with(dpis())
    with pytest.raises(ValueError, match="budget"):
        tight.fit(x, y, batch_size=B, epochs=3, verbose=0,
                  callbacks=[tfdp.callbacks.PrivacyBudget(epsilon=0.01, delta=DELTA)])
    assert tight.privacy.epsilon(DELTA) <= 0.01
    assert tight.privacy.steps == 0
