"""Privacy settings are fixed once an optimizer is created (issue 14, item 1).

The compiled train step is traced once and keeps the settings it read as
Python numbers, while the ledger reads the optimizer's attributes at every
`fit`. Changing an attribute in between would make the ledger charge a noise
level the step no longer adds. These tests measure the noise the step adds
after an attempted change and compare it with what the ledger records.
"""

import dp_accounting
import keras
import numpy as np
import pytest

import tfdp

DIM, BATCH, LEARNING_RATE = 100, 16, 1.0
# x = 0: the kernel's per-example gradients are 0, so a step's update is its noise alone.
X_ZERO = np.zeros((BATCH, DIM), np.float32)
Y_ZERO = np.zeros((BATCH, DIM), np.float32)
X_PUBLIC = np.ones((8, DIM), np.float32)


def zero_gradient_model(optimizer):
    model = tfdp.DPSequential(
        [keras.Input((DIM,)), keras.layers.Dense(DIM, use_bias=False, kernel_initializer="zeros")]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def measured_noise_std(model):
    """One full-batch step (q = 1); the std of the noise it added to the sum."""
    kernel = model.layers[0].kernel
    before = kernel.numpy().copy()
    model.fit(X_ZERO, Y_ZERO, batch_size=BATCH, epochs=1, verbose=0)
    update = kernel.numpy() - before
    return float(np.std(update)) * BATCH / LEARNING_RATE


def ledger_noise_multiplier(model):
    """The noise multiplier of the ledger's latest step event (q = 1: Gaussian)."""
    latest = model.privacy.composed_event().events[-1]
    assert isinstance(latest.event, dp_accounting.GaussianDpEvent), latest
    return latest.event.noise_multiplier


MAKERS = {
    "dpsgd": lambda: tfdp.optimizers.DPSGD(LEARNING_RATE, l2_norm_clip=1.0, noise_multiplier=1.0, seed=3),
    # A tiny temperature accepts every candidate, so the update is the candidate's.
    "sadpsgd": lambda: tfdp.optimizers.SADPSGD(
        LEARNING_RATE, l2_norm_clip=1.0, noise_multiplier=1.0, seed=3, initial_temperature=1e-12,
        public_energy_data=(X_PUBLIC, np.zeros((8, DIM), np.float32)),
    ),
}


@pytest.fixture(scope="module")
def fitted():
    """One model per mechanism, fitted once (its step traced once) and shared:
    each test below tries its change on it and fits again. A refused change
    leaves the model as it was, so the tests do not depend on their order;
    on code that accepts a change, the test making it fails (and so may the
    ones after it: none passes wrongly)."""
    models = {}

    def get(mechanism):
        if mechanism not in models:
            model = zero_gradient_model(MAKERS[mechanism]())
            assert measured_noise_std(model) == pytest.approx(1.0, rel=0.05)
            models[mechanism] = model
        return models[mechanism]

    return get


@pytest.mark.parametrize("name", ["noise_multiplier", "l2_norm_clip"])
@pytest.mark.parametrize("mechanism", sorted(MAKERS))
def test_the_noise_the_step_adds_is_what_the_ledger_charges_after_a_change(
        fitted, mechanism, name):
    """Fit (the shared model: noise std 1), try to set `name` to 50, fit
    again: the measured noise std stays noise_multiplier * l2_norm_clip as
    the optimizer and the ledger report.

    Broken variant caught: settings that can be reassigned after the step was
    traced (the old code), where the ledger charged sigma = 50 (or the
    attribute said C = 50) while the step still added sigma * C = 1 (measured
    std 1.0 against the 50 claimed).
    """
    model = fitted(mechanism)
    optimizer = model.optimizer
    try:
        setattr(optimizer, name, 50.0)
        refusal = None
    except AttributeError as error:
        refusal = str(error)
    measured = measured_noise_std(model)
    claimed = ledger_noise_multiplier(model) * optimizer.l2_norm_clip
    assert measured == pytest.approx(claimed, rel=0.05), (measured, claimed)
    assert optimizer.noise_multiplier * optimizer.l2_norm_clip == pytest.approx(claimed)
    assert refusal is not None and f"`{name}`" in refusal and "new optimizer" in refusal, refusal


def test_a_new_optimizer_changes_the_noise_and_the_ledger_together():
    """The documented way to change the noise: compile with a new optimizer.

    Control for the measurement above: it sees a change of sigma (1 -> 50)
    when one really happens, and the ledger records the same 50.
    """
    model = zero_gradient_model(MAKERS["dpsgd"]())
    assert measured_noise_std(model) == pytest.approx(1.0, rel=0.05)
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(LEARNING_RATE, l2_norm_clip=1.0, noise_multiplier=50.0),
        loss="mse",
    )
    assert measured_noise_std(model) == pytest.approx(50.0, rel=0.05)
    assert ledger_noise_multiplier(model) == 50.0


def all_optimizers():
    public = (X_PUBLIC, np.zeros((8, DIM), np.float32))
    return {
        "dp_adam": tfdp.optimizers.DPOptimizer(keras.optimizers.Adam(1e-3), 1.0, 1.0),
        "dpsgd": MAKERS["dpsgd"](),
        "sadpsgd": tfdp.optimizers.SADPSGD(0.1, public_energy_data=public),
        "dpis": tfdp.optimizers.DPIS(0.1, target_epsilon=1.0, epochs=2, sigma_n=10.0),
        "adadp": tfdp.optimizers.AdaDP(0.01),
    }


# The settings each compiled step reads as Python values (besides the ones
# every DP optimizer has); each must be fixed.
STEP_SETTINGS = {
    "dp_adam": (),
    "dpsgd": (),
    "sadpsgd": ("initial_temperature", "rejection_threshold", "energy_batch_size"),
    "dpis": ("k", "gradient_floor", "log_sampling_stats", "target_epsilon", "epochs", "sigma_n"),
    "adadp": ("gamma_prime", "local_clip_threshold", "local_clip_factor", "local_clipping", "adaptive_noise"),
}
COMMON = ("l2_norm_clip", "noise_multiplier", "weight_decay", "weight_decay_placement", "seed")


@pytest.mark.parametrize("mechanism", sorted(STEP_SETTINGS))
def test_every_setting_the_step_reads_is_refused_after_creation(mechanism):
    """Each setting raises an error naming it and the fix, and keeps its value.

    Broken variant caught: a setting left out of the guard (the old code
    guarded none; DPIS only its noise multiplier).
    """
    optimizer = all_optimizers()[mechanism]
    for name in COMMON + STEP_SETTINGS[mechanism]:
        before = getattr(optimizer, name)
        with pytest.raises(AttributeError, match=f"`{name}`.*(new optimizer|cannot be set)"):
            setattr(optimizer, name, 0.5)
        assert getattr(optimizer, name) == before, name


def test_assigning_model_optimizer_after_a_fit_cannot_change_the_charged_noise(fitted):
    """`model.optimizer = new` after a fit: the noise the step adds and the
    noise the ledger charges stay equal, and the assignment is refused with
    an error saying to compile again (issue 25, item 3).

    Broken variant caught: an assignment Keras accepts (the old code), which
    kept the traced step (measured std 1.0) while the ledger charged 50.
    """
    model = fitted("dpsgd")  # fitted once: noise std 1
    new = tfdp.optimizers.DPSGD(LEARNING_RATE, l2_norm_clip=1.0, noise_multiplier=50.0)
    try:
        model.optimizer = new
        refusal = None
    except AttributeError as error:
        refusal = str(error)
    measured = measured_noise_std(model)
    claimed = ledger_noise_multiplier(model) * model.optimizer.l2_norm_clip
    assert measured == pytest.approx(claimed, rel=0.05), (measured, claimed)
    assert refusal is not None and "compile" in refusal and "DPSGD" in refusal, refusal
