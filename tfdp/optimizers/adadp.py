"""`AdaDP` (Xu et al., seed 004): adaptive learning rate and adaptive noise.

See MECHANISMS.md section 5 and `tfdp.mechanisms.adaptive_noise` for the
math and why it is private.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from tfdp import accounting, distribute
from tfdp.mechanisms import adaptive_noise as ada
from tfdp.optimizers.dp_optimizer import DPOptimizer, check_positive

PAPER_BOUNDS = ("theorem1", "poisson_rdp")

# `tfdp train --mechanism adadp` settings per built-in dataset (RMSprop-sized
# learning rates; a large batch on digits keeps beta^2 sigma*^2 d / b^2 < 1,
# see the class docstring). Measured by examples/adadp_*.py.
RECIPE_DEFAULTS = {
    "digits": dict(batch_size=512, learning_rate=0.05),
    "fashion_mnist": dict(batch_size=2048, learning_rate=0.002),
}


def _check_fraction(name, value, low_open, high_open):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"Expected `{name}` to be a number. Received: {name}={value!r}")
    value = float(value)
    low_ok = value > 0 if low_open else value >= 0
    high_ok = value < 1 if high_open else value <= 1
    if not (math.isfinite(value) and low_ok and high_ok):
        interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
        raise ValueError(f"Expected `{name}` in {interval}. Received: {name}={value}")
    return value


def _check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"Expected `{name}` to be a bool. Received: {name}={value!r}")
    return bool(value)


@keras.saving.register_keras_serializable(package="tfdp")
class AdaDP(DPOptimizer):
    """AdaDP: DP training with an adaptive learning rate and adaptive noise.

    Per parameter coordinate j it keeps two statistics of the released noisy
    gradient g~ (never of raw gradients, MECHANISMS.md section 5):

    * v_j <- (1 - gamma) v_j + gamma g~_j^2 (adaptive learning rate); the step
      is theta <- theta - learning_rate * g~ / sqrt(v + epsilon), which is
      exactly `keras.optimizers.RMSprop(rho=1 - gamma, epsilon=epsilon)`:
      AdaDP runs one as its inner optimizer, and v is its "velocity" slot.
    * s_j <- gamma_prime s_j + (1 - gamma_prime) g~_j^2 (noise shape), an
      optimizer variable of AdaDP ("noise_second_moment").

    Both are optimizer variables, saved with `model.save` and restored.

    Noise: while Var_j(sqrt(s_j)) <= `local_clip_threshold` (G; warm-up) a
    step is DP-SGD (global L2 clipping to `l2_norm_clip`, noise
    N(0, (noise_multiplier * l2_norm_clip)^2)). After that (adaptive phase)
    every per-example gradient is clipped per coordinate to
    [-c_j, c_j], c_j = min(local_clip_factor * sqrt(s_j), l2_norm_clip) (s_j
    floored at 1e-6 x its mean, so c_j > 0), and the sum gets
    N(0, sigma_j^2), sigma_j = noise_multiplier * sqrt(d) * c_j (d = number of
    trainable parameters). The phase is decided each step inside the compiled
    step (`tf.cond`) from the noisy statistic s alone. G is in
    squared-gradient units: the paper's 1e-6 suits its C = 4, lot 600; with
    small C or large batches Var(sqrt(s)) can stay below it and AdaDP never
    leaves warm-up (it is then ADAL).

    Behaviour of this sound version (fed by released gradients only): the
    released gradient's scale is set by the bounds themselves, so on average
    s_j <- s_j (gamma' + (1 - gamma') (beta^2 a_j^2 + kappa)), where a_j is
    the examples' sign agreement on coordinate j and
    kappa = beta^2 noise_multiplier^2 d / b^2 (b the expected batch size).
    s has no scale of its own: it shrinks geometrically on coordinates with
    beta^2 a_j^2 + kappa < 1 and grows (up to the cap C) when kappa > 1, where
    the noise feeds on itself. The cap keeps it finite; the shrinkage slows
    training (README, "AdaDP", has measurements).

    Privacy: in the whitened space (coordinate j divided by sqrt(d) c_j) every
    clipped example has L2 norm <= 1 and the noise is
    N(0, noise_multiplier^2 I), so each step, in either phase, is the event
    `dpsgd_event(noise_multiplier, q)` that the ledger charges (tight Poisson
    sampled-Gaussian RDP). `paper_epsilon` reproduces the paper's own
    accounting and is not the guarantee.

    Memory: the adaptive phase materializes per-example gradients, a
    [B, *shape] tensor per variable: B x d floats for padded batch size B
    (about 4 * B * d bytes, e.g. 230 MB for the 26,010-parameter CNN at
    B = 2200), where DP-SGD's path keeps only per-layer factors. This bounds
    the batch size on large models.

    Ablations of the paper's section IV-E: `adaptive_noise=False` is ADAL
    (DP-SGD noise with the RMSprop step); `adaptive_learning_rate=False` is
    ADAN (adaptive noise with a plain SGD step, theta -= learning_rate * g~).

    Args:
        learning_rate: float or schedule (default 0.002, the paper's MNIST
            setting; ADAN needs a larger one, the paper used 0.1).
        l2_norm_clip: C > 0, the warm-up's global clipping bound.
        noise_multiplier: sigma* > 0, the noise multiplier in both phases.
        gamma: weight of the new g~^2 in v, in (0, 1] (default 0.1).
        gamma_prime: weight of the OLD value in s, in [0, 1) (default 0.9).
        local_clip_threshold: G >= 0 (default 1e-6); local clipping starts
            once Var(sqrt(s)) > G.
        local_clip_factor: beta > 0 (default 1.2).
        epsilon: the RMSprop smoothing term epsilon_0 > 0 (default 1e-7, as
            Keras; not a privacy parameter).
        local_clipping: "coordinate" (default, the paper: clip each
            coordinate to [-c_j, c_j]) or "whitened_l2" (scale each example so
            that its whitened L2 norm is <= 1: the same privacy, keeps each
            example's direction).
        adaptive_learning_rate: bool (default True); False gives ADAN.
        adaptive_noise: bool (default True); False gives ADAL.
        weight_decay, weight_decay_placement, seed, name: see `DPOptimizer`.

    Example:

    >>> import tfdp
    >>> opt = tfdp.optimizers.AdaDP(learning_rate=0.002, l2_norm_clip=4.0,
    ...                             noise_multiplier=3.0)
    >>> opt.local_clip_factor, opt.gamma_prime
    (1.2, 0.9)
    >>> round(opt.paper_epsilon(1e-5, sampling_probability=0.01, steps=1800), 3)
    1.465
    """

    _fixed_settings = DPOptimizer._fixed_settings + (
        "gamma", "gamma_prime", "local_clip_threshold", "local_clip_factor", "epsilon",
        "local_clipping", "adaptive_learning_rate", "adaptive_noise",
    )

    def __init__(
        self,
        learning_rate=0.002,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        gamma=0.1,
        gamma_prime=0.9,
        local_clip_threshold=1e-6,
        local_clip_factor=1.2,
        epsilon=1e-7,
        local_clipping="coordinate",
        adaptive_learning_rate=True,
        adaptive_noise=True,
        weight_decay=0.0,
        weight_decay_placement="before_clip",
        seed=None,
        name=None,
        **kwargs,
    ):
        gamma = _check_fraction("gamma", gamma, low_open=True, high_open=False)
        gamma_prime = _check_fraction("gamma_prime", gamma_prime, low_open=False, high_open=True)
        if isinstance(local_clip_threshold, bool) or not isinstance(
            local_clip_threshold, (int, float, np.number)
        ) or not math.isfinite(local_clip_threshold) or local_clip_threshold < 0:
            raise ValueError(
                "Expected `local_clip_threshold` to be a finite number >= 0. "
                f"Received: local_clip_threshold={local_clip_threshold!r}"
            )
        local_clip_factor = check_positive("local_clip_factor", local_clip_factor)
        epsilon = check_positive("epsilon", epsilon)
        if local_clipping not in ada.LOCAL_CLIPPING_MODES:
            raise ValueError(
                f"Expected `local_clipping` in {ada.LOCAL_CLIPPING_MODES}. "
                f"Received: local_clipping={local_clipping!r}"
            )
        adaptive_learning_rate = _check_bool("adaptive_learning_rate", adaptive_learning_rate)
        adaptive_noise_on = _check_bool("adaptive_noise", adaptive_noise)
        if adaptive_learning_rate:
            inner = keras.optimizers.RMSprop(
                learning_rate=learning_rate, rho=1.0 - gamma, epsilon=epsilon
            )
        else:
            inner = keras.optimizers.SGD(learning_rate=learning_rate)
        super().__init__(
            inner,
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier,
            weight_decay=weight_decay,
            weight_decay_placement=weight_decay_placement,
            seed=seed,
            name=name,
            **kwargs,
        )
        self.gamma = gamma
        self.gamma_prime = gamma_prime
        self.local_clip_threshold = float(local_clip_threshold)
        self.local_clip_factor = local_clip_factor
        self.epsilon = epsilon
        self.local_clipping = local_clipping
        self.adaptive_learning_rate = adaptive_learning_rate
        self.adaptive_noise = adaptive_noise_on

    # -- state ----------------------------------------------------------------

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        # s of the paper (E'[g~^2]): one slot per trainable variable.
        self._second_moments = self.add_optimizer_variables(var_list, "noise_second_moment")

    def second_moments(self, variables):
        """The noise-shape statistic s for `variables` (optimizer variables)."""
        return [self._second_moments[self._get_variable_index(v)] for v in variables]

    def velocities(self, variables):
        """The learning-rate statistic v (the inner RMSprop's velocity slots)."""
        if not self.adaptive_learning_rate:
            raise ValueError(
                "This AdaDP has no adaptive learning rate (ADAN), so no v. "
                "Received: adaptive_learning_rate=False"
            )
        inner = self.inner_optimizer
        return [inner._velocities[inner._get_variable_index(v)] for v in variables]

    # -- noise scales (overridden by test doubles only) -----------------------

    def whitened_noise_multiplier(self):
        """Noise std in the whitened space, sigma* (adaptive phase)."""
        return self.noise_multiplier

    # -- the private step -----------------------------------------------------

    def privatize(self, per_example, step_info):
        """Warm-up: DP-SGD. Adaptive phase: local clipping and adaptive noise.

        The adaptive branch materializes per-example gradients (memory
        B x d, see the class docstring). The phase is a `tf.cond` on the
        noisy statistic s.
        """
        if not self.adaptive_noise:
            return super().privatize(per_example, step_info)
        variables = per_example.variables
        moments = [tf.convert_to_tensor(m) for m in self.second_moments(variables)]
        adaptive = ada.is_adaptive_phase(moments, self.local_clip_threshold)
        # Materialized outside the cond: per-example gradient objects may cache
        # tensors, and a tensor made inside one branch cannot be used by the
        # other. Warm-up steps (a handful) pay for it too.
        materialized = per_example.materialize()

        def warm_up():
            grads, stats = super(AdaDP, self).privatize(per_example, step_info)
            return grads, stats["nonfinite_examples"]

        def local():
            return self._local_step(materialized, variables, step_info, moments)

        grads, nonfinite = tf.cond(adaptive, local, warm_up)
        return list(grads), {"nonfinite_examples": nonfinite}

    def _local_step(self, materialized, variables, step_info, moments):
        if self.weight_decay and self.weight_decay_placement == "before_clip":
            offsets = self._decay_offsets(variables)
            materialized = [g + o[None] for g, o in zip(materialized, offsets)]
        d = ada.num_parameters(variables)
        bounds = ada.clip_bounds(moments, self.local_clip_factor, self.l2_norm_clip)
        sums, nonfinite = ada.local_clipped_sum(
            materialized, bounds, d, weights=step_info["mask"], mode=self.local_clipping
        )
        # Under tf.distribute: 1/R of the noise variance and decay per replica.
        grads = ada.adaptive_noisy_mean(
            sums, bounds, d, self.whitened_noise_multiplier() * distribute.noise_scale(),
            step_info["expected_batch_size"], self.noise_seed(),
        )
        if self.weight_decay and self.weight_decay_placement == "after_noise":
            share = distribute.replica_share()
            grads = [g + o * share for g, o in zip(grads, self._decay_offsets(variables))]
        return grads, nonfinite

    def apply_private_gradients(self, grads, trainable_variables, model=None):
        """Logs this step's phase and noise, updates s from g~, steps.

        Logs (computed from s before the update, i.e. the values this step's
        `privatize` used): "adadp_phase" (0 warm-up, 1 adaptive),
        "adadp_noise_std_mean" and "adadp_noise_std_spread" (mean and
        standard deviation over coordinates of the noise std sigma_j on the
        clipped sum).
        """
        if not self.adaptive_noise:
            constant = tf.constant(self.noise_stddev(), tf.float32)
            logs = {
                "adadp_phase": tf.constant(0.0),
                "adadp_noise_std_mean": constant,
                "adadp_noise_std_spread": tf.constant(0.0),
            }
            self.inner_optimizer.apply(grads, trainable_variables)
            return logs
        slots = self.second_moments(trainable_variables)
        moments = [tf.convert_to_tensor(m) for m in slots]
        adaptive = ada.is_adaptive_phase(moments, self.local_clip_threshold)
        mean, spread = ada.noise_std_summary(
            moments, self.local_clip_factor, self.whitened_noise_multiplier(),
            ada.num_parameters(trainable_variables), self.l2_norm_clip,
        )
        logs = {
            "adadp_phase": tf.cast(adaptive, tf.float32),
            "adadp_noise_std_mean": tf.where(adaptive, mean, float(self.noise_stddev())),
            "adadp_noise_std_spread": tf.where(adaptive, spread, 0.0),
        }
        # s reads the global g~ (one replica's part has too little noise).
        global_grads = distribute.sum_over_replicas(grads)
        updated = ada.update_second_moments(moments, global_grads, self.gamma_prime)
        for slot, value in zip(slots, updated):
            slot.assign(value)
        self.inner_optimizer.apply(grads, trainable_variables)
        return logs

    # -- accounting -----------------------------------------------------------

    def step_event(self, sampling_probability):
        """DP-SGD's event with noise multiplier sigma*, in both phases.

        In the adaptive phase the step is DP-SGD in the whitened space
        (clip 1, noise sigma*), see `tfdp.mechanisms.adaptive_noise`.
        """
        return accounting.dpsgd_event(self.noise_multiplier, sampling_probability)

    def paper_epsilon(self, delta, sampling_probability, steps, bound="theorem1"):
        """The PAPER's epsilon for these settings: a reproduction, not a guarantee.

        tfdp's guarantee is `model.privacy.epsilon(delta)` (tight Poisson
        sampled-Gaussian RDP over everything released). This reports what the
        paper's accounting says, so its numbers can be compared:

        * bound="theorem1" (default): the paper's Theorem 1, i.e. Wang,
          Balle and Kasiviswanathan's (2018) subsampled-RDP bound with the
          classic conversion over integer orders 2..64
          (`adaptive_noise.paper_theorem1_epsilon`). That bound is for
          fixed-size lots sampled WITHOUT replacement (replace-one
          neighbours); tfdp and the paper's Algorithm 1 sample Poisson, so
          the number does not describe a tfdp run. It is implemented as the
          paper states it, because reproducing the paper is its only use.
        * bound="poisson_rdp": the Poisson sampled-Gaussian RDP with the same
          classic conversion. The paper's worked example (L = 600,
          N = 60000, sigma* = 0.9, 1800 steps) prints (4.0, 1e-5) at order
          6, which is this computation (4.015), not Theorem 1 (6.92 at
          order 4).

        Args:
            delta: target delta in (0, 1).
            sampling_probability: q = L / N.
            steps: number of steps T.
            bound: "theorem1" or "poisson_rdp".

        Returns:
            float epsilon.
        """
        if bound not in PAPER_BOUNDS:
            raise ValueError(f"Expected `bound` in {PAPER_BOUNDS}. Received: bound={bound!r}")
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
            raise ValueError(f"Expected `delta` in (0, 1). Received: delta={delta!r}")
        if not 0 < sampling_probability <= 1:
            raise ValueError(
                "Expected `sampling_probability` in (0, 1]. Received: "
                f"sampling_probability={sampling_probability!r}"
            )
        if isinstance(steps, bool) or int(steps) != steps or steps < 0:
            raise ValueError(f"Expected `steps` to be an int >= 0. Received: steps={steps!r}")
        if steps == 0:
            return 0.0
        if bound == "poisson_rdp":
            return accounting.compute_epsilon(
                self.noise_multiplier, sampling_probability, int(steps), delta,
                conversion="classic",
            )
        epsilon, _ = ada.paper_theorem1_epsilon(
            self.noise_multiplier, sampling_probability, int(steps), delta
        )
        return epsilon

    # -- serialization --------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        inner = config.pop("inner_optimizer")["config"]
        config.update(
            learning_rate=inner["learning_rate"],
            gamma=self.gamma,
            gamma_prime=self.gamma_prime,
            local_clip_threshold=self.local_clip_threshold,
            local_clip_factor=self.local_clip_factor,
            epsilon=self.epsilon,
            local_clipping=self.local_clipping,
            adaptive_learning_rate=self.adaptive_learning_rate,
            adaptive_noise=self.adaptive_noise,
        )
        return config
