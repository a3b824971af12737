"""`AdaDP` (Xu et al., seed 004): adaptive learning rate and adaptive noise.

See docs/mechanisms/adadp.md and `tfdp.mechanisms.adaptive_noise`
for the math and why it is private.
"""

import math
import numbers

import keras
import numpy as np
import tensorflow as tf

from tfdp import accounting, distribute
from tfdp.data import public
from tfdp.data.sources import require_in_memory
from tfdp.mechanisms import adaptive_noise as ada
from tfdp.per_example import compute_per_example_gradients
from tfdp.optimizers.dp_optimizer import DPOptimizer, check_positive, noise_multiplier_or_default

PAPER_BOUNDS = ("theorem1", "poisson_rdp")
NOISE_SHAPES = ("released", "public")
# Public examples per per-example gradient pass of the public statistic
# (memory: PUBLIC_CHUNK x d floats).
PUBLIC_CHUNK = 256

MISSING_PUBLIC_DATA = (
    "AdaDP(noise_shape='public') has no public data set. Call "
    "`optimizer.set_public_data((x_public, y_public))` with data that is NOT "
    "training data (a held-out split you may release, for example); a model "
    "loaded from a file needs this too, since arrays are not saved with the "
    "optimizer's configuration. Training was not started."
)

# `tfdp train --mechanism adadp` settings per built-in dataset (RMSprop-sized
# learning rates). digits: chosen by `examples/adadp_digits.py --tune` on a
# validation split carved from the training data (batch sizes 64-512, learning
# rates 0.005-0.05, two seeds each; the test split was not read).
RECIPE_DEFAULTS = {
    "digits": dict(batch_size=64, learning_rate=0.02),
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


class _PublicShapeRefresher(keras.callbacks.Callback):
    """Recomputes AdaDP's public noise shape before the steps that need it."""

    def __init__(self, optimizer):
        super().__init__()
        self._optimizer = optimizer

    def on_train_batch_begin(self, batch, logs=None):
        self._optimizer._maybe_refresh_public_shape(self.model)


@keras.saving.register_keras_serializable(package="tfdp")
class AdaDP(DPOptimizer):
    """AdaDP: DP training with an adaptive learning rate and adaptive noise.

    Adaptive learning rate: v_j <- (1 - gamma) v_j + gamma g~_j^2 on the
    released noisy gradient g~, and theta <- theta - learning_rate * g~ /
    sqrt(v + epsilon), which is exactly
    `keras.optimizers.RMSprop(rho=1 - gamma, epsilon=epsilon)`: AdaDP runs
    one as its inner optimizer, and v is its "velocity" slot.

    Adaptive noise (docs/mechanisms/adadp.md): a statistic s
    ("noise_second_moment", one slot per variable) sets the SHAPE of
    per-coordinate clip bounds whose SCALE is C's:

        c_j = local_clip_factor * l2_norm_clip * sqrt(s'_j / sum_k s'_k),

    s'_j = max(s_j, 1e-3 * mean(s)) (no zero bound; the sum is over s', so
    sum_j c_j^2 = (local_clip_factor * l2_norm_clip)^2 exactly, whatever the
    scale of s). While Var_j(sqrt(s_j)) <= `local_clip_threshold` (G,
    warm-up) a step is DP-SGD (clip C, noise N(0, (sigma* C)^2)). After that
    (adaptive phase) each per-example gradient is clipped to the ellipsoid
    sum_j g_j^2 / (d c_j^2) <= 1 (`local_clipping="whitened_l2"`, default)
    or to the box [-c_j, c_j] ("coordinate", the paper's), and coordinate j
    of the sum gets N(0, sigma_j^2), sigma_j = sigma* sqrt(d) c_j (d the
    number of trainable parameters). With a uniform s, whitened-L2 AdaDP is
    exactly DP-SGD with clip beta * C: it differs from DP-SGD only through
    the shape it learns. The phase is decided each step inside the compiled
    step (`tf.cond`) from s alone. G is in squared-gradient units: the
    paper's 1e-6 suits its C = 4, lot 600; with small C or large batches
    Var(sqrt(s)) can stay below it and AdaDP never leaves warm-up (it is
    then ADAL).

    Where s comes from (`noise_shape`), both sound:

    * "released" (default): s_j <- gamma_prime s_j + (1 - gamma_prime)
      g~_j^2, an EMA of the released noisy gradients (the paper reads raw
      gradients, an unaccounted release). Free.
    * "public": s_j = mean over `public_data`, a data set you declare
      public, of squared per-example gradients at the current weights,
      recomputed before the first step of every `fit` and then every
      `public_refresh_steps` steps (by a callback, between compiled steps).
      Immune to the noise floor of released gradients. Never pass training
      data: s steers every step without noise (`fit` refuses a public set
      sharing examples with the training data). Cost: one per-example
      gradient pass over the public set (in chunks of 256, materialized:
      256 x d floats) per refresh, i.e. about n_public / (batch_size x
      public_refresh_steps) of the training's gradient work (Fashion-MNIST
      with 5,000 public examples, batch 2048, every 10 steps: about 24%
      more), plus one hash per training example per `fit`. Runs on one
      replica.

    Both statistics are optimizer variables, saved with `model.save` and
    restored (the public arrays are not: call `set_public_data` again).

    Privacy: in the whitened space (coordinate j divided by sqrt(d) c_j) every
    clipped example has L2 norm <= 1 and the noise is
    N(0, noise_multiplier^2 I), so each step, in either phase and with either
    noise shape, is the event `dpsgd_event(noise_multiplier, q)` that the
    ledger charges (tight Poisson sampled-Gaussian RDP). `paper_epsilon`
    reproduces the paper's own accounting and is not the guarantee.

    Memory: the adaptive phase materializes per-example gradients, a
    [B, *shape] tensor per variable: B x d floats for padded batch size B
    (about 4 * B * d bytes, e.g. 230 MB for the 26,010-parameter CNN at
    B = 2200), where DP-SGD's path keeps only per-layer factors. This bounds
    the batch size on large models.

    Ablations of the paper's section IV-E: `adaptive_noise=False` is ADAL
    (DP-SGD noise with the RMSprop step); `adaptive_learning_rate=False` is
    ADAN (adaptive noise with a plain SGD step, theta -= learning_rate * g~).

    Logs: "adadp_phase" (0 warm-up, 1 adaptive), "adadp_noise_std_mean" and
    "adadp_noise_std_spread" (mean and standard deviation over coordinates
    of the noise std sigma_j on the clipped sum).

    Args:
        learning_rate: float or schedule (default 0.002, the paper's MNIST
            setting; ADAN needs a larger one, the paper used 0.1).
        l2_norm_clip: C > 0: the warm-up's global clipping bound, and the
            scale of the adaptive bounds (sum_j c_j^2 = beta^2 C^2).
        noise_multiplier: sigma* > 0, the noise multiplier in both phases
            (default 1.0; chosen by `fit` with `target_epsilon` and
            `target_delta`, see `DPOptimizer`).
        gamma: weight of the new g~^2 in v, in (0, 1] (default 0.1).
        gamma_prime: weight of the OLD value in s, in [0, 1) (default 0.9;
            used by noise_shape="released").
        local_clip_threshold: G >= 0 (default 1e-6); local clipping starts
            once Var(sqrt(s)) > G.
        local_clip_factor: beta > 0 (default 1.2).
        epsilon: the RMSprop smoothing term epsilon_0 > 0 (default 1e-7, as
            Keras; not a privacy parameter).
        local_clipping: "whitened_l2" (default: scale each example so that
            its whitened L2 norm is <= 1, keeping its direction) or
            "coordinate" (the paper: clip each coordinate to [-c_j, c_j]).
            Same privacy.
        noise_shape: "released" (default) or "public" (see above).
        public_data: with noise_shape="public", a pair (x, y) of PUBLIC
            arrays (not training data); `None` defers it to
            `set_public_data` (as `from_config` does).
        public_refresh_steps: int >= 1 (default 10): steps between two
            computations of the public s.
        adaptive_learning_rate: bool (default True); False gives ADAN.
        adaptive_noise: bool (default True); False gives ADAL.
        momentum: SGD momentum in [0, 1) of ADAN's step (default 0; only
            with adaptive_learning_rate=False). With momentum 0.9,
            local_clip_factor=1 and a uniform s, ADAN with whitened-L2
            clipping is DP-SGD with momentum 0.9 and clip C.
        weight_decay, weight_decay_placement, seed, name: see `DPOptimizer`.

    Example:

    >>> import tfdp
    >>> opt = tfdp.optimizers.AdaDP(learning_rate=0.002, l2_norm_clip=4.0,
    ...                             noise_multiplier=3.0)
    >>> opt.local_clip_factor, opt.gamma_prime, opt.local_clipping
    (1.2, 0.9, 'whitened_l2')
    >>> round(opt.paper_epsilon(1e-5, sampling_probability=0.01, steps=1800), 3)
    1.465
    """

    _fixed_settings = DPOptimizer._fixed_settings + (
        "gamma", "gamma_prime", "local_clip_threshold", "local_clip_factor", "epsilon",
        "local_clipping", "adaptive_learning_rate", "adaptive_noise",
    )

    adaptive_clipping_unsupported = (
        "it clips and noises per parameter from its own running statistics."
    )
    user_level_unsupported = (
        "its adaptive noise is driven by per-record gradient statistics and its analysis "
        "(docs/mechanisms/adadp.md) is stated per record, not per person."
    )
    physical_batches_unsupported = (
        "its adaptive phase clips materialized per-example gradients "
        "coordinate-wise inside one tf.cond over the whole batch, which it does "
        "not split into chunks."
    )

    def __init__(
        self,
        learning_rate=0.002,
        l2_norm_clip=1.0,
        noise_multiplier=None,
        gamma=0.1,
        gamma_prime=0.9,
        local_clip_threshold=1e-6,
        local_clip_factor=1.2,
        epsilon=1e-7,
        local_clipping="whitened_l2",
        noise_shape="released",
        public_data=None,
        public_refresh_steps=10,
        adaptive_learning_rate=True,
        adaptive_noise=True,
        momentum=0.0,
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
        if noise_shape not in NOISE_SHAPES:
            raise ValueError(
                f"Expected `noise_shape` in {NOISE_SHAPES}. Received: noise_shape={noise_shape!r}"
            )
        if isinstance(public_refresh_steps, bool) or not isinstance(
            public_refresh_steps, numbers.Integral
        ) or public_refresh_steps < 1:
            raise ValueError(
                "Expected `public_refresh_steps` to be an int >= 1. "
                f"Received: public_refresh_steps={public_refresh_steps!r}"
            )
        adaptive_learning_rate = _check_bool("adaptive_learning_rate", adaptive_learning_rate)
        adaptive_noise_on = _check_bool("adaptive_noise", adaptive_noise)
        if noise_shape == "released" and public_data is not None:
            raise ValueError(
                "`public_data` sets the public noise shape: pass noise_shape='public' "
                "with it. Received: noise_shape='released' and public_data"
            )
        if noise_shape == "public" and not adaptive_noise_on:
            raise ValueError(
                "ADAL (adaptive_noise=False) adds DP-SGD's noise and has no noise "
                "shape. Received: noise_shape='public' and adaptive_noise=False"
            )
        momentum = _check_fraction("momentum", momentum, low_open=False, high_open=True)
        if momentum and adaptive_learning_rate:
            raise ValueError(
                "`momentum` is for the SGD step of adaptive_learning_rate=False (ADAN); "
                "the adaptive learning rate is RMSprop's. Received: momentum="
                f"{momentum} and adaptive_learning_rate=True"
            )
        if adaptive_learning_rate:
            inner = keras.optimizers.RMSprop(
                learning_rate=learning_rate, rho=1.0 - gamma, epsilon=epsilon
            )
        else:
            inner = keras.optimizers.SGD(learning_rate=learning_rate, momentum=momentum)
        super().__init__(
            inner,
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier_or_default(noise_multiplier, kwargs),
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
        self.noise_shape = noise_shape
        self.public_refresh_steps = int(public_refresh_steps)
        self.adaptive_learning_rate = adaptive_learning_rate
        self.adaptive_noise = adaptive_noise_on
        self.momentum = momentum
        self._public = None  # (x, y, number of examples, row hashes)
        self._public_fn = None
        self._next_refresh = None  # iteration of the next public refresh
        if public_data is not None:
            self.set_public_data(public_data)

    # -- state ----------------------------------------------------------------

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        # s (the paper's E'[g~^2], or the public statistic): one slot per variable.
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

    # -- the public noise shape -----------------------------------------------

    def set_public_data(self, public_data):
        """Sets (or replaces) the PUBLIC data set of noise_shape="public".

        Call it on a loaded model before training again: arrays are not saved
        with the optimizer. s is recomputed on it before the next step.
        Never pass training data: s steers every step without noise.

        Args:
            public_data: (x, y), x an array (or nest of arrays for a
                multi-input model) and y the labels, as the compiled loss
                expects them.
        """
        if self.noise_shape != "public":
            raise ValueError(
                "`public_data` sets the public noise shape: construct AdaDP with "
                f"noise_shape='public'. Received: noise_shape={self.noise_shape!r}"
            )
        x, y, num = public.public_arrays(public_data, "public_data")
        self._public = (x, y, num, public.row_hashes(x))
        self._next_refresh = None

    def public_second_moments(self, model):
        """s on the public set at the model's current weights (a list).

        s_j = mean over the public examples of the squared per-example
        gradient of the compiled loss (plus weight_decay * theta with
        weight_decay_placement="before_clip", as the clipped gradients),
        computed with `training=False`. Reads the public arrays and the
        weights only.
        """
        if self._public is None:
            raise ValueError(MISSING_PUBLIC_DATA)
        x, y, num, _ = self._public
        if self._public_fn is None or self._public_fn[0] is not model:
            self._public_fn = (model, self._make_public_fn(model))
        fn = self._public_fn[1]
        chunk = min(num, PUBLIC_CHUNK)
        totals = None
        for start in range(0, num, chunk):
            size = min(chunk, num - start)
            pad = chunk - size  # pad to one shape: the function is traced once

            def rows(array, start=start, size=size, pad=pad):
                part = array[start : start + size]
                if pad:
                    part = np.concatenate([part, np.repeat(part[:1], pad, 0)], 0)
                return part

            weights = np.concatenate([np.ones(size, np.float32), np.zeros(pad, np.float32)])
            sums = fn(tf.nest.map_structure(rows, x), rows(y), weights)
            totals = sums if totals is None else [t + u for t, u in zip(totals, sums)]
        return [t / float(num) for t in totals]

    def _make_public_fn(self, model):
        variables = model.trainable_variables

        @tf.function(autograph=False)  # as Keras traces the step: not converted
        def squared_sums(x, y, weights):
            per_example, _, _ = compute_per_example_gradients(
                model, x, y, weights, model._per_example_loss, model.per_example_gradients,
                training=False,
            )
            grads = per_example.materialize()
            if self.weight_decay and self.weight_decay_placement == "before_clip":
                grads = [g + o[None] for g, o in zip(grads, self._decay_offsets(variables))]
            keep = tf.cast(weights, grads[0].dtype)
            return [tf.tensordot(keep, tf.square(g), axes=1) for g in grads]

        return squared_sums

    def _maybe_refresh_public_shape(self, model):
        """Assigns the public s when a refresh is due (called between steps)."""
        step = int(self.iterations.numpy())
        if self._next_refresh is not None and step < self._next_refresh:
            return
        values = self.public_second_moments(model)
        for slot, value in zip(self.second_moments(model.trainable_variables), values):
            slot.assign(value)
        self._next_refresh = step + self.public_refresh_steps

    def training_callbacks(self):
        """The public shape's refresher (noise_shape="public"), else none."""
        if self.noise_shape == "public":
            return [_PublicShapeRefresher(self)]
        return []

    def make_training_data(self, model, arrays, batch_size, steps_per_epoch=None, budgets=()):
        """DP-SGD's Poisson-sampled data; with the public shape, checks first.

        noise_shape="public" refuses to start without public data, with
        public data sharing examples (identical inputs) with the training
        data, or under several replicas; s is recomputed before the first
        step of every `fit` (the weights may have changed).
        """
        if self.noise_shape == "public":
            if self._public is None:
                raise ValueError(MISSING_PUBLIC_DATA)
            require_in_memory(
                arrays, "AdaDP(noise_shape='public')",
                "compares every training record with the public data",
            )
            replicas = model.distribute_strategy.num_replicas_in_sync
            if replicas > 1:
                raise ValueError(
                    "AdaDP(noise_shape='public') computes its public statistic on one "
                    f"replica: train it on one device. Received: {replicas} replicas"
                )
            public.check_disjoint_from_training_data(
                self._public[3], arrays[0], "public_data",
                "The public noise shape steers every step",
            )
            self._next_refresh = None
            if not self.built:
                self.build(model.trainable_variables)
        return super().make_training_data(
            model, arrays, batch_size, steps_per_epoch=steps_per_epoch, budgets=budgets
        )

    # -- noise scales and phase (overridden by test doubles only) -------------

    def whitened_noise_multiplier(self):
        """Noise std in the whitened space, sigma* (adaptive phase)."""
        return self.noise_multiplier

    def in_adaptive_phase(self, moments):
        """Bool tensor: Var(sqrt(s)) > G, i.e. local clipping this step."""
        return ada.is_adaptive_phase(moments, self.local_clip_threshold)

    def clip_bounds(self, moments):
        """The adaptive phase's bounds c from s (see the class docstring)."""
        return ada.clip_bounds(moments, self.local_clip_factor, self.l2_norm_clip)

    # -- the private step -----------------------------------------------------

    def privatize(self, per_example, step_info):
        """Warm-up: DP-SGD. Adaptive phase: local clipping and adaptive noise.

        The adaptive branch materializes per-example gradients (memory
        B x d, see the class docstring). The phase is a `tf.cond` on s.
        """
        if not self.adaptive_noise:
            return super().privatize(per_example, step_info)
        variables = per_example.variables
        moments = [tf.convert_to_tensor(m) for m in self.second_moments(variables)]
        adaptive = self.in_adaptive_phase(moments)
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
        bounds = self.clip_bounds(moments)
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
        """Logs this step's phase and noise, updates s from g~ (released
        shape), steps.

        Logs (computed from s before the update, i.e. the values this step's
        `privatize` used): see the class docstring.
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
        adaptive = self.in_adaptive_phase(moments)
        mean, spread = ada.noise_std_summary(
            moments, self.local_clip_factor, self.l2_norm_clip,
            self.whitened_noise_multiplier(), ada.num_parameters(trainable_variables),
        )
        logs = {
            "adadp_phase": tf.cast(adaptive, tf.float32),
            "adadp_noise_std_mean": tf.where(adaptive, mean, float(self.noise_stddev())),
            "adadp_noise_std_spread": tf.where(adaptive, spread, 0.0),
        }
        if self.noise_shape == "released":
            # s reads the global g~ (one replica's part has too little noise).
            global_grads = distribute.sum_over_replicas(grads)
            updated = ada.update_second_moments(moments, global_grads, self.gamma_prime)
            for slot, value in zip(slots, updated):
                slot.assign(value)
        self.inner_optimizer.apply(grads, trainable_variables)
        return logs

    # -- accounting -----------------------------------------------------------

    def step_event(self, sampling_probability, noise_multiplier=None):
        """DP-SGD's event with noise multiplier sigma*, in both phases.

        In the adaptive phase the step is DP-SGD in the whitened space
        (clip 1, noise sigma*), see `tfdp.mechanisms.adaptive_noise`.
        """
        return super().step_event(sampling_probability, noise_multiplier)

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
            noise_shape=self.noise_shape,
            public_refresh_steps=self.public_refresh_steps,
            adaptive_learning_rate=self.adaptive_learning_rate,
            adaptive_noise=self.adaptive_noise,
            momentum=self.momentum,
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds the optimizer without its public data (arrays are not
        configuration): with noise_shape="public" call `set_public_data`
        before training."""
        config = {"public_data": None, **config}
        return super().from_config(config, custom_objects=custom_objects)
