"""Privacy audits of every tfdp mechanism: longer and tighter than the tests.

    python benchmarks/audit.py                      # all audits, about 5 minutes on 2 cores
    python benchmarks/audit.py --steps 300 --canaries 256 --black-box-runs 40   # quick
    python benchmarks/audit.py --only dpsgd half_noise

White-box audits (`tfdp.auditing.audit_optimizer`): each step of the real
`DPModel.fit` path on the linear audit model is one trial per canary; the
lower bound on epsilon (Clopper-Pearson, stated confidence) is compared with
the epsilon of ONE step as tfdp's ledger reports it (RDP, tight conversion).
Negative controls (test doubles) must be caught: bound above the claim.
The black-box audit trains a logistic regression many times on D and D plus
a canary and uses the canary's loss as the attack; it is compared with the
whole run's epsilon (1), and a control without noise or clipping must be
caught. Prints a Markdown table (the README's "Auditing" figures).
"""

import argparse
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tfdp import auditing
from tfdp.mechanisms import dpsgd

SIGMA = 2.0


class HalfNoiseDPSGD(tfdp.optimizers.DPSGD):
    """Negative control: half the noise it claims."""

    def noise_stddev(self):
        return 0.5 * super().noise_stddev()


class UnclippedDPSGD(tfdp.optimizers.DPSGD):
    """Negative control: no clipping, noise calibrated to the claimed C."""

    def privatize(self, per_example, step_info):
        sums = per_example.weighted_sum(step_info["mask"])
        grads = dpsgd.noisy_mean(
            sums, self.noise_stddev(), step_info["expected_batch_size"], self.noise_seed()
        )
        return grads, {"nonfinite_examples": tf.constant(0.0)}


class HalfNoiseAdaDP(tfdp.optimizers.AdaDP):
    """Negative control: half the whitened noise it claims."""

    def whitened_noise_multiplier(self):
        return 0.5 * self.noise_multiplier


def dpsgd_maker(cls=tfdp.optimizers.DPSGD, **kwargs):
    return lambda seed: cls(1.0, l2_norm_clip=1.0, noise_multiplier=SIGMA, seed=seed, **kwargs)


def adadp_maker(cls=tfdp.optimizers.AdaDP, local_clipping="whitened_l2"):
    return lambda seed: cls(
        1.0, l2_norm_clip=1.0, noise_multiplier=SIGMA, adaptive_learning_rate=False,
        local_clip_threshold=0.0, local_clipping=local_clipping, seed=seed,
    )


def white_box_audits(k, steps):
    """(name, description, kwargs of audit_optimizer, expect caught)."""
    ordinary = 64
    return [
        ("dpsgd", "DP-SGD, q = 1", dict(make_optimizer=dpsgd_maker()), False),
        ("dpsgd_poisson", "DP-SGD, Poisson q = 0.5",
         dict(make_optimizer=dpsgd_maker(), num_examples=2 * k, batch_size=k), False),
        ("weight_decay", "DP-SGD, weight decay 0.05 before clipping",
         dict(make_optimizer=dpsgd_maker(weight_decay=0.05), num_examples=k + ordinary, absent="nan",
              normalizer=auditing.weight_decay_normalizer(ordinary)), False),
        ("sadpsgd", "SA-DPSGD (sound accounting: every candidate)",
         dict(make_optimizer=lambda seed: tfdp.optimizers.SADPSGD(
             1.0, l2_norm_clip=1.0, noise_multiplier=SIGMA, public_energy_data=None, seed=seed),
              public_energy_data=True, drop_unchanged_steps=True), False),
        ("dpis", "DPIS (K~ at its floor, 5 epochs)",
         dict(make_optimizer=lambda seed: tfdp.optimizers.DPIS(
             1.0, l2_norm_clip=1.0, target_epsilon=100.0, epochs=5, sigma_n=1.0, seed=seed),
              canaries=k // 4, num_examples=k, batch_size=k // 2, epochs=5,
              normalizer=auditing.dpis_normalizer), False),
        ("adadp", "AdaDP, adaptive phase, whitened L2 clipping",
         dict(make_optimizer=adadp_maker(), normalizer=auditing.adadp_normalizer), False),
        ("adadp_coordinate", "AdaDP, adaptive phase, per-coordinate clipping",
         dict(make_optimizer=adadp_maker(local_clipping="coordinate"),
              normalizer=auditing.adadp_normalizer), False),
        ("half_noise", "control: DP-SGD with half the noise", dict(make_optimizer=dpsgd_maker(HalfNoiseDPSGD)), True),
        ("no_clipping", "control: DP-SGD without clipping, q = 0.5",
         dict(make_optimizer=dpsgd_maker(UnclippedDPSGD), num_examples=2 * k, batch_size=k), True),
        ("adadp_half_noise", "control: AdaDP with half the whitened noise",
         dict(make_optimizer=adadp_maker(HalfNoiseAdaDP), normalizer=auditing.adadp_normalizer), True),
    ]


def black_box_audit(runs, delta, seed, private=True):
    """Logistic regression, DP-SGD, canary's loss as the attack (whole runs).

    Two full-batch steps from zero weights (so sampling and noise are the
    runs' only randomness) with the noise that claims epsilon 1; with
    `private=False` the control trains without noise or clipping under the
    same claim, and must be caught.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32)[:, None]
    canary = (np.full(8, 3.0, np.float32), np.zeros(1, np.float32))  # a mislabelled outlier
    batch, epochs = 64, 2
    sigma = tfdp.accounting.calibrate_dpsgd(64, batch, epochs, target_epsilon=1.0, delta=delta)
    noise_multiplier, clip = (sigma, 1.0) if private else (1e-9, 1e3)

    def train_fn(x, y, run_seed):
        model = tfdp.DPSequential([
            keras.Input((8,)),
            keras.layers.Dense(1, activation="sigmoid", kernel_initializer="zeros"),
        ])
        model.compile(
            optimizer=tfdp.optimizers.DPSGD(
                2.0, l2_norm_clip=clip, noise_multiplier=noise_multiplier, seed=run_seed
            ),
            loss="binary_crossentropy",
        )
        model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0)
        return model

    claimed = tfdp.accounting.compute_dpsgd_epsilon(64, batch, sigma, epochs, delta)
    description = (
        f"logistic regression, {epochs} steps q = 1, sigma {sigma:.2f}, canary's loss"
        if private else "control: the same runs without noise or clipping"
    )
    result = auditing.audit_training(
        train_fn, auditing.loss_score("binary_crossentropy"), (x, y), canary, runs=runs,
        delta=delta, seed=seed, claimed_epsilon=claimed, mechanism="DP-SGD logistic regression",
    )
    return result, description


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps per white-box run")
    parser.add_argument("--canaries", type=int, default=1024)
    parser.add_argument("--black-box-runs", type=int, default=100, help="0 skips the black-box audit")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=None, help="names of the audits to run")
    args = parser.parse_args(argv)
    print(f"command: python benchmarks/audit.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(f"sigma = {SIGMA}, delta = {args.delta}, confidence = {args.confidence}\n")
    print("| audit | mechanism | trials per side | claimed epsilon | audited lower bound | expected | result | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    failures = 0
    rows = white_box_audits(args.canaries, args.steps)
    for name, description, kwargs, expect_caught in rows:
        if args.only and name not in args.only:
            continue
        kwargs = dict(kwargs)
        kwargs.setdefault("canaries", args.canaries)
        started = time.time()
        result = auditing.audit_optimizer(
            steps=args.steps, delta=args.delta, confidence=args.confidence, seed=args.seed, **kwargs
        )
        ok = result.violates_claim == expect_caught
        failures += not ok
        trials = (result.negatives + result.positives + result.selection_trials) // 2
        print(
            f"| {name} | {description} | {trials:,} | {result.claimed_epsilon:.3f} | "
            f"{result.epsilon_lower_bound:.3f} | {'caught' if expect_caught else 'bound <= claim'} | "
            f"{'ok' if ok else 'FAILED'} | {time.time() - started:.0f} |",
            flush=True,
        )
    black_box_rows = [("black_box", True), ("black_box_no_noise", False)]
    for name, private in black_box_rows:
        if not args.black_box_runs or (args.only and name not in args.only):
            continue
        started = time.time()
        result, description = black_box_audit(args.black_box_runs, args.delta, args.seed, private)
        ok = result.violates_claim != private
        failures += not ok
        print(
            f"| {name} | {description} | {args.black_box_runs} runs | {result.claimed_epsilon:.3f} | "
            f"{result.epsilon_lower_bound:.3f} | {'bound <= claim' if private else 'caught'} | "
            f"{'ok' if ok else 'FAILED'} | {time.time() - started:.0f} |",
            flush=True,
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
