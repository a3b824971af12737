"""Restoring earlier weights never un-counts the steps that ran.

`keras.callbacks.EarlyStopping(restore_best_weights=True)` and any
`model.set_weights(earlier)` write every model weight back, the private step
counter included. The steps after those weights still ran and released
their updates (logs, the weights they led to), so the ledger must keep
counting them, in memory and in a saved file.
"""

import keras
import numpy as np
import pytest

import tfdp
from tfdp.accounting import PrivacyLedger, dpsgd_event

N, BATCH, DELTA = 64, 16, 1e-5


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 4)).astype(np.float32), rng.integers(0, 3, N)


def build():
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=2.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def expected_epsilon(steps):
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(2.0, BATCH / N))
    ledger.advance(steps)
    return ledger.epsilon(DELTA)


def test_set_weights_to_earlier_weights_keeps_every_step_counted(tmp_path):
    """Broken variant caught: the old code, where set_weights wound the step
    counter back to 4: the ledger then refused every query, and a model saved
    and loaded reported the epsilon of 4 steps after 8 had run."""
    x, y = data()
    model = build()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    earlier, kernel = model.get_weights(), model.layers[0].kernel.numpy().copy()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    model.set_weights(earlier)
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), kernel)
    assert model.privacy.steps == 8
    assert model.privacy.epsilon(DELTA) == pytest.approx(expected_epsilon(8))
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert loaded.privacy.steps == 8
    assert loaded.privacy.epsilon(DELTA) == pytest.approx(expected_epsilon(8))


def test_early_stopping_with_restore_best_weights_keeps_every_step_counted():
    """The loss rises from the first epoch on (lr 1e3), so EarlyStopping
    stops after epoch 2 and restores epoch 1's weights; all 8 steps count.
    Control: the weights are epoch 1's (the restore did happen)."""
    x, y = data()
    model = build()
    model.optimizer.inner_optimizer.learning_rate = 1e3
    snapshots = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: snapshots.append(model.layers[0].kernel.numpy().copy())
    )
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=1, restore_best_weights=True)
    history = model.fit(x, y, batch_size=BATCH, epochs=10, callbacks=[record, stop], verbose=0)
    losses = history.history["loss"]
    best = int(np.argmin(losses))
    assert len(losses) < 10 and best < len(losses) - 1, losses
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), snapshots[best])
    assert model.privacy.steps == 4 * len(losses)
    assert model.privacy.epsilon(DELTA) == pytest.approx(expected_epsilon(4 * len(losses)))
