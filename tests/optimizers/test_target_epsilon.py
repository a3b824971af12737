"""A target epsilon in the optimizer: `fit` calibrates sigma from N (or the
number of people), the batch size and the planned epochs, says which sigma
it chose, ends within the target, and refuses a later fit that would pass
it; `calibrate_dpsgd` takes the number of users."""

import keras
import numpy as np
import pytest

import tfdp
from tfdp.accounting import calibrate_dpsgd, compute_dpsgd_epsilon

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(n=400, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def _model(optimizer):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


@pytest.mark.parametrize("make", [
    lambda **t: tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, **t),
    lambda **t: tfdp.optimizers.DPOptimizer(keras.optimizers.Adam(1e-2), 1.0, **t),
    lambda **t: tfdp.optimizers.AdaDP(l2_norm_clip=1.0, **t),
])
def test_fit_calibrates_sigma_for_the_planned_steps_and_ends_within_the_target(make, capsys):
    x, y = _data()
    optimizer = make(target_epsilon=2.0, target_delta=1e-5)
    assert optimizer.noise_multiplier is None
    model = _model(optimizer)
    model.fit(x, y, batch_size=20, epochs=3, verbose=2)
    sigma = optimizer.noise_multiplier
    assert sigma == pytest.approx(calibrate_dpsgd(400, 20, 3, 2.0, 1e-5), rel=1e-9)
    assert f"noise_multiplier={sigma:.4g} calibrated for epsilon=2" in capsys.readouterr().out
    assert model.privacy.steps == 60
    epsilon = model.privacy.epsilon(1e-5)
    assert epsilon <= 2.0
    # Not merely below: within the calibration's tolerance of the target.
    assert epsilon > 1.99
    # Negative control: 1% less noise would have passed the target.
    assert compute_dpsgd_epsilon(400, 20, sigma * 0.99, 3, 1e-5) > 2.0


def test_a_second_fit_that_would_overspend_is_refused_before_a_step():
    x, y = _data()
    model = _model(tfdp.optimizers.DPSGD(0.5, target_epsilon=2.0, target_delta=1e-5))
    model.fit(x, y, batch_size=20, epochs=2, verbose=0)
    steps, weights = model.privacy.steps, [w.numpy().copy() for w in model.weights]
    with pytest.raises(ValueError, match="would overspend.*target_epsilon=2.*Nothing was trained"):
        model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    assert model.privacy.steps == steps
    assert all(np.array_equal(w.numpy(), v) for w, v in zip(model.weights, weights))


def test_a_fit_refused_before_its_first_step_leaves_sigma_open():
    """Sigma is fixed when the fit starts releasing: a fit refused after the
    plan (labels out of range) does not bind the next fit's plan."""
    x, y = _data()
    model = _model(tfdp.optimizers.DPSGD(0.5, target_epsilon=2.0, target_delta=1e-5))
    with pytest.raises(ValueError, match="label"):
        model.fit(x, np.full_like(y, 7), batch_size=20, epochs=3, verbose=0)
    model.fit(x, y, batch_size=20, epochs=5, verbose=0)
    assert model.optimizer.noise_multiplier == pytest.approx(
        calibrate_dpsgd(400, 20, 5, 2.0, 1e-5), rel=1e-9)
    assert model.privacy.epsilon(1e-5) <= 2.0
    with pytest.raises(AttributeError, match="fixed"):
        model.optimizer.noise_multiplier = 3.0


def test_sigma_is_calibrated_for_people_with_user_level_dp(capsys):
    x, y = _data()
    owners = np.arange(400) // 4  # 100 people of 4 records
    model = _model(tfdp.optimizers.DPSGD(0.5, target_epsilon=3.0, target_delta=1e-5))
    model.fit(x, y, user_ids=owners, examples_per_user=2, batch_size=10, epochs=2, verbose=1)
    assert model.optimizer.noise_multiplier == pytest.approx(
        calibrate_dpsgd(num_users=100, batch_size=10, epochs=2, target_epsilon=3.0, delta=1e-5),
        rel=1e-9)
    assert "of 100 people" in capsys.readouterr().out
    assert model.privacy.epsilon(1e-5) <= 3.0


def test_the_calibrated_optimizer_round_trips_and_keeps_guarding(tmp_path):
    x, y = _data()
    model = _model(tfdp.optimizers.DPSGD(0.5, target_epsilon=2.0, target_delta=1e-5))
    model.fit(x, y, batch_size=20, epochs=2, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.noise_multiplier == model.optimizer.noise_multiplier
    assert loaded.optimizer.noise_target.epsilon == 2.0
    with pytest.raises(ValueError, match="would overspend"):
        loaded.fit(x, y, batch_size=20, epochs=1, verbose=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(noise_multiplier=None), "needs `noise_multiplier`.*or `target_epsilon`"),
    (dict(noise_multiplier=None, target_epsilon=3.0), "needs `target_delta`"),
    (dict(noise_multiplier=1.0, target_delta=1e-5), "`target_delta` goes with `target_epsilon`"),
    (dict(noise_multiplier=None, target_epsilon=-1.0, target_delta=1e-5), "target_epsilon"),
    (dict(noise_multiplier=None, target_epsilon=3.0, target_delta=2.0), "delta"),
])
def test_bad_targets_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfdp.optimizers.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, **kwargs)


def test_a_target_no_noise_reaches_is_refused_before_a_step():
    x, y = _data(40)
    model = _model(tfdp.optimizers.DPSGD(0.5, target_epsilon=1e-6, target_delta=1e-5))
    with pytest.raises(ValueError, match="No noise_multiplier reaches target_epsilon=1e-06"):
        model.fit(x, y, batch_size=40, epochs=50, verbose=0)
    assert model.privacy.steps == 0


def test_dp_bandmf_refuses_a_target_and_points_to_its_accounting():
    with pytest.raises(ValueError, match="cannot calibrate its noise from a target epsilon"):
        tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.1), 1.0, 1.0, bands=2,
                                 target_epsilon=3.0, target_delta=1e-5)


def test_the_default_sigma_is_unchanged_without_a_target():
    assert tfdp.optimizers.DPSGD(0.1).noise_multiplier == 1.0
    assert tfdp.optimizers.AdaDP().noise_multiplier == 1.0


@pytest.mark.parametrize("user_budget", [False, True])
def test_a_resumed_run_calibrates_after_its_backup_is_restored(tmp_path, user_budget):
    """BackupAndRestore brings back the ledger and the epoch inside fit:
    sigma is planned after that, for the epochs left and on top of what the
    killed run spent. Before, it was calibrated on an empty ledger and the
    run ended at epsilon 2.31 for a target of 2 when the user passed a
    PrivacyBudget of their own (found by review)."""
    x, y = _data(256)
    backup = str(tmp_path / "backup")

    class Crash(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("killed")

    def target_model():
        return _model(tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, target_epsilon=2.0,
                                            target_delta=1e-5))

    first = target_model()
    with pytest.raises(RuntimeError, match="killed"):
        first.fit(x, y, batch_size=32, epochs=4, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup), Crash()])
    resumed = target_model()
    callbacks = [keras.callbacks.BackupAndRestore(backup)]
    if user_budget:
        callbacks.append(tfdp.callbacks.PrivacyBudget(epsilon=None, delta=1e-5))
    resumed.fit(x, y, batch_size=32, epochs=12, verbose=0, callbacks=callbacks)
    assert resumed.privacy.steps == 12 * 8           # every planned step ran
    assert 1.99 < resumed.privacy.epsilon(1e-5) <= 2.0


def test_sa_dpsgd_takes_a_target_too():
    """SA-DPSGD charges every candidate step as DP-SGD's: the same plan."""
    x, y = _data()
    public_x, public_y = _data(32, seed=9)   # disjoint from the training data
    optimizer = tfdp.optimizers.SADPSGD(0.5, l2_norm_clip=1.0, target_epsilon=2.0,
                                        target_delta=1e-5, public_energy_data=(public_x, public_y))
    model = _model(optimizer)
    model.fit(x, y, batch_size=20, epochs=2, verbose=0)
    assert optimizer.noise_multiplier == pytest.approx(calibrate_dpsgd(400, 20, 2, 2.0, 1e-5),
                                                       rel=1e-9)
    assert model.privacy.steps == 40 and model.privacy.epsilon(1e-5) <= 2.0
