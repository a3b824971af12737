"""`calibrate_dpsgd` counts the steps `fit` runs (issue 14, item 5)."""

import keras
import numpy as np

import tfdp
from tfdp.data import PoissonSampler

N, BATCH, EPOCHS, TARGET, DELTA = 1000, 280, 3, 1.0, 1e-5


def test_a_calibrated_fit_ends_within_the_target():
    """N = 1000, b = 280, 3 epochs: fit runs 3 * round(1000 / 280) = 12 steps.

    Broken variant caught: calibrating for tensorflow-privacy's
    ceil(E N / b) = 11 steps, after which the 12 steps fit runs end at
    epsilon 1.044 > 1 (at 10 epochs: 36 steps for 40, 1.058; 3 epochs
    check the same count with fewer steps).
    """
    sigma = tfdp.accounting.calibrate_dpsgd(N, BATCH, EPOCHS, target_epsilon=TARGET, delta=DELTA)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    y = rng.integers(0, 2, size=N)
    model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=sigma),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
    assert model.privacy.steps == 12
    spent = model.privacy.epsilon(DELTA)
    assert 0.99 * TARGET < spent <= TARGET
    assert tfdp.accounting.compute_dpsgd_epsilon(N, BATCH, sigma, EPOCHS, DELTA) == spent


def test_the_samplers_and_calibration_share_one_epoch_length():
    from tfdp.accounting.calibration import steps_per_epoch

    for n, b in [(1000, 280), (1000, 300), (60000, 256), (10, 10), (7, 5)]:
        assert PoissonSampler(n, b).steps_per_epoch == steps_per_epoch(n, b)
        assert tfdp.accounting.calibration.dpsgd_steps(n, b, 3) == 3 * steps_per_epoch(n, b)
