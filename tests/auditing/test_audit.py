"""The audit runner: scores to bounds, black-box runs, argument checks."""

import math

import dp_accounting
import keras
import numpy as np
import pytest

import tfdp
from tfdp import auditing
from tfdp.accounting import PrivacyLedger, compute_epsilon, dpsgd_event


def gaussian_epsilon(sigma, delta):
    """Exact epsilon of the Gaussian mechanism (sensitivity 1), via PLD."""
    return compute_epsilon(sigma, 1.0, 1, delta, accountant="pld")


def test_gaussian_scores_give_a_bound_between_zero_and_the_truth():
    truth = gaussian_epsilon(1.0, 1e-5)  # N(0, 1) against N(1, 1): 4.38
    bounds = []
    for seed in range(5):
        rng = np.random.default_rng(seed)
        result = auditing.epsilon_from_scores(
            rng.normal(0, 1, 50000), rng.normal(1, 1, 50000), delta=1e-5, seed=seed,
            claimed_epsilon=truth,
        )
        assert result.direction == "greater"
        assert result.negatives == result.positives == 25000
        assert result.selection_trials == 50000
        assert not result.violates_claim
        bounds.append(result.epsilon_lower_bound)
    assert 1.5 < min(bounds) and max(bounds) < truth


def test_direction_is_chosen_on_the_selection_half():
    rng = np.random.default_rng(0)
    result = auditing.epsilon_from_scores(rng.normal(0, 1, 20000), rng.normal(-1, 1, 20000), delta=1e-5)
    assert result.direction == "less" and result.epsilon_lower_bound > 1.0


def test_a_claim_below_what_the_scores_prove_is_flagged():
    rng = np.random.default_rng(0)
    result = auditing.epsilon_from_scores(
        rng.normal(0, 1, 20000), rng.normal(3, 1, 20000), delta=1e-5, claimed_epsilon=1.0,
        mechanism="leaky",
    )
    assert result.violates_claim
    data = result.to_dict()
    assert data["violates_claim"] is True and data["mechanism"] == "leaky"
    assert "leaky: epsilon >= " in result.summary() and "claimed 1.000" in result.summary()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(scores_out=[0.0, 1.0, float("nan"), 2.0, 3.0]), ValueError, "`scores_out` to be finite numbers; 1 of 5"),
        (dict(scores_in=[1.0, 2.0]), ValueError, "`scores_in` to hold at least 4 scores"),
        (dict(scores_in="abc"), TypeError, "`scores_in` to be an array of numbers"),
        (dict(delta=1.0), ValueError, "Received: delta=1.0"),
        (dict(confidence=0.0), ValueError, "Received: confidence=0.0"),
        (dict(selection_fraction=1.0), ValueError, "Received: selection_fraction=1.0"),
        (dict(claimed_epsilon=-1.0), ValueError, "Received: claimed_epsilon=-1.0"),
        (dict(seed=-3), ValueError, "Received: seed=-3"),
    ],
)
def test_bad_scores_and_settings_get_clear_errors(kwargs, error, message):
    args = dict(scores_out=np.zeros(10), scores_in=np.ones(10), delta=1e-5)
    args.update(kwargs)
    with pytest.raises(error, match=message.replace("(", r"\(").replace("[", r"\[")):
        auditing.epsilon_from_scores(**args)


def test_one_step_epsilon_ignores_one_off_records_and_takes_the_worst_step():
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(2.0, 0.1))
    ledger.advance(10)
    ledger.record(dp_accounting.GaussianDpEvent(0.1), count=3)  # a one-off release, not a step
    ledger.begin_steps(dpsgd_event(1.0, 0.1))
    ledger.advance(5)
    ledger.begin_steps(dpsgd_event(5.0, 0.1))  # open, no step yet
    assert auditing.one_step_epsilon(ledger, 1e-5) == pytest.approx(compute_epsilon(1.0, 0.1, 1, 1e-5))
    assert auditing.one_step_epsilon(PrivacyLedger(), 1e-5) == 0.0


def test_audit_training_runs_d_and_d_prime_with_distinct_seeds():
    """A Gaussian mechanism on the sum of clipped records, audited black-box."""
    seeds = []
    x = np.zeros((20, 3), np.float32)
    y = np.zeros(20, np.int64)

    def train_fn(x, y, seed):
        seeds.append((seed, len(x)))
        rng = np.random.default_rng(seed)
        norms = np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1.0)
        return (x / norms).sum(0) + rng.normal(0.0, 0.5, size=3)  # clip 1, sigma 0.5

    def score_fn(release, canary_x, canary_y):
        return float(release @ canary_x / np.linalg.norm(canary_x))

    result = auditing.audit_training(
        train_fn, score_fn, (x, y), (np.array([30.0, 0, 0], np.float32), 1), runs=400,
        delta=1e-5, seed=7, claimed_epsilon=gaussian_epsilon(0.5, 1e-5),
    )
    assert [n for _, n in seeds] == [20, 21] * 400
    assert len({s for s, _ in seeds}) == 800
    assert 1.0 < result.epsilon_lower_bound <= result.claimed_epsilon


class _RestartEveryRun(keras.callbacks.Callback):
    """Within one `fit`: zero weights before each run's first step, the
    weights kept after its last step."""

    def __init__(self, steps_per_run, zeros, kept):
        super().__init__()
        self.steps_per_run, self.zeros, self.kept = steps_per_run, zeros, kept

    def on_train_batch_begin(self, batch, logs=None):
        if batch % self.steps_per_run == 0:
            self.model.set_weights(self.zeros)

    def on_train_batch_end(self, batch, logs=None):
        if batch % self.steps_per_run == self.steps_per_run - 1:
            self.kept.append(self.model.get_weights())


class LogisticRegressionTrainer:
    """`train_fn` for `audit_training`: two full-batch tfdp DP-SGD steps from
    zero weights, so sampling and noise are the runs' only randomness.

    One model is compiled once. A run is two Poisson-sampled steps (q =
    32 / n, n the records of D or D') of a real `fit`, from zero weights;
    one `fit` trains `RUNS_PER_FIT` runs of one data set back to back (a
    callback zeroes the weights before each run's first step and keeps them
    after its second), and the runs are handed out in order. Plain SGD
    without momentum keeps no optimizer state, so each run is exactly two
    steps from zero, the same as a `fit(epochs=2)` of its own: the same
    train step, sampler and noise. Every step draws a fresh batch and fresh
    noise (the keys fold in the step, and each `fit` draws a fresh stream),
    so the runs are independent as before, within a fit and across the
    fits of a side (measured: the canary's scores at sigma / 12 over 48 runs a
    side have the same means and spreads within 2 standard errors as with a
    `fit` a run). One `fit` per 64 runs instead of one per run: the Poisson
    pipeline and Keras' fit set-up are built 4 times in an audit, not 256
    (16 with the 16 runs a fit used before: measured, the two audits here
    took 11.0 s with 16 runs a fit, 8.3 s with 64). The runs' independence
    does not depend on how many share a fit: each step's keys fold in its
    step. The sequence of runs, hence the audit, is reproducible.
    """

    RUNS_PER_FIT = 64
    STEPS_PER_RUN = 2  # full batch, 2 epochs of one step

    def __init__(self, noise_multiplier):
        self.model = tfdp.DPSequential([
            keras.Input((4,)),
            keras.layers.Dense(1, activation="sigmoid", kernel_initializer="zeros"),
        ])
        self.model.compile(
            optimizer=tfdp.optimizers.DPSGD(
                0.5, l2_norm_clip=1.0, noise_multiplier=noise_multiplier, seed=0
            ),
            loss="binary_crossentropy",
        )
        self.zeros = [np.zeros_like(w) for w in self.model.get_weights()]
        self.pending = {}  # data set -> weights of its runs trained, not yet handed out

    def __call__(self, x, y, seed):
        pending = self.pending.setdefault((x.tobytes(), y.tobytes()), [])
        if not pending:
            restart = _RestartEveryRun(self.STEPS_PER_RUN, self.zeros, pending)
            self.model.fit(x, y, batch_size=32, epochs=1,
                           steps_per_epoch=self.STEPS_PER_RUN * self.RUNS_PER_FIT,
                           callbacks=[restart], verbose=0)
            assert len(pending) == self.RUNS_PER_FIT
        self.model.set_weights(pending.pop(0))
        return self.model


# 128 runs a side (64 evaluated) can show at most this epsilon: perfect separation.
BLACK_BOX_RUNS = 128
PERFECT_SEPARATION = auditing.epsilon_lower_bound(0, 64, 0, 64, 1e-5)  # 2.82


@pytest.fixture(scope="module")
def logistic_audit_setting():
    """32 records, a far-out canary, and noise that claims epsilon 1 for two steps."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32)[:, None]
    canary = (np.full(4, 5.0, np.float32), np.zeros(1, np.float32))
    sigma = tfdp.accounting.calibrate_dpsgd(32, 32, epochs=2, target_epsilon=1.0, delta=1e-5)
    claimed = tfdp.accounting.compute_dpsgd_epsilon(32, 32, sigma, epochs=2, delta=1e-5)
    return (x, y), canary, sigma, claimed


def _audit_logistic(setting, noise_multiplier):
    data, canary, _, claimed = setting
    return auditing.audit_training(
        LogisticRegressionTrainer(noise_multiplier), auditing.loss_score("binary_crossentropy"),
        data, canary, runs=BLACK_BOX_RUNS, delta=1e-5, claimed_epsilon=claimed,
    )


def test_audit_training_with_real_tfdp_runs_and_the_loss_attack(logistic_audit_setting):
    """Real tfdp trainings stay within their claim of 1, where these runs can
    show up to 2.82 (the control below is caught at 1.57 without perfect separation)."""
    _, _, sigma, claimed = logistic_audit_setting
    result = _audit_logistic(logistic_audit_setting, sigma)
    print(result.summary())
    assert result.negatives + result.positives + result.selection_trials == 2 * BLACK_BOX_RUNS
    assert claimed == pytest.approx(1.0, abs=0.01)
    assert result.epsilon_lower_bound <= result.claimed_epsilon


def test_black_box_audit_catches_a_twelfth_of_the_noise(logistic_audit_setting):
    """Negative control: the same runs with sigma / 12 (each step's canary
    shift is then 3 noise standard deviations), under the same claim.

    The black-box attack sees one score per whole run, so catching half the
    noise at delta 1e-5 takes far more runs than a test can afford (at the
    expected counts of a Gaussian shift, 512 evaluated runs a side show 0.34
    and 4,096 show 0.75 against the claim of 1); the white-box audits
    (test_mechanism_audits.py) catch half the noise. Measured with this
    seed: 1.57 with 64 runs a fit (2.19 with 16 runs a fit, 1.20 with a fit
    a run: other draws), below the 2.82 of perfect separation, so the
    audit's statistic, not a degenerate run, catches it. The runs per side
    (128) and each run's distribution are unchanged, so the audit's power
    is too. Its spread at 64 runs a fit, measured: over the optimizer's
    seed (the noise and the batches; seeds 1-8) 1.64 to 2.49, over the
    audit's seed (the selection/evaluation split; seeds 1-7) 1.30 to 1.79
    (1.44 to 1.81 at 16 runs a fit, seeds 1-3); every one is above the
    claim + 0.1 = 1.10 asked here."""
    _, _, sigma, claimed = logistic_audit_setting
    result = _audit_logistic(logistic_audit_setting, sigma / 12)
    print(result.summary())
    assert result.epsilon_lower_bound > result.claimed_epsilon + 0.1
    assert result.epsilon_lower_bound < PERFECT_SEPARATION


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(runs=3), ValueError, "Received: runs=3"),
        (dict(train_fn=None), TypeError, "`train_fn` and `score_fn` to be callables"),
        (dict(canary=(np.zeros(5), 1)), ValueError, r"shape \(3,\) .* Received: canary_x of shape \(5,\)"),
    ],
)
def test_audit_training_argument_errors(kwargs, error, message):
    args = dict(
        train_fn=lambda x, y, seed: None, score_fn=lambda m, cx, cy: 0.0,
        data=(np.zeros((4, 3)), np.zeros(4)), canary=(np.zeros(3), 1), runs=4, delta=1e-5,
    )
    args.update(kwargs)
    with pytest.raises(error, match=message):
        auditing.audit_training(**args)


@pytest.mark.parametrize(
    "maker, kwargs, error, message",
    [
        (lambda s: tfdp.optimizers.DPSGD(1.0, momentum=0.9, seed=s), {}, ValueError, "plain SGD without momentum"),
        (lambda s: tfdp.optimizers.DPOptimizer(keras.optimizers.Adam(), 1.0, 1.0, seed=s), {}, ValueError, "Adam"),
        (lambda s: keras.optimizers.SGD(), {}, TypeError, "tfdp optimizer"),
        (lambda s: tfdp.optimizers.DPSGD(1.0, seed=s), dict(steps=10, epochs=3), ValueError, "multiple of epochs"),
        (lambda s: tfdp.optimizers.DPSGD(1.0, seed=s), dict(absent="none"), ValueError, "Received: absent='none'"),
        (lambda s: tfdp.optimizers.DPSGD(1.0, seed=s), dict(num_examples=2, canaries=4), ValueError, "num_examples=2"),
        (lambda s: tfdp.optimizers.DPSGD(1.0, seed=s), dict(canary_scale=math.inf), ValueError, "canary_scale=inf"),
    ],
)
def test_audit_optimizer_argument_errors(maker, kwargs, error, message):
    args = dict(steps=4, canaries=4)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        auditing.audit_optimizer(maker, **args)
