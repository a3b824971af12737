"""`DPOptimizer`: any Keras optimizer, made differentially private.

The wrapper owns the private part of a step (clip per-example gradients, add
calibrated Gaussian noise, divide by the expected batch size, describe the
release to the privacy ledger); the inner optimizer only post-processes the
noisy mean, like `keras.optimizers.LossScaleOptimizer` wraps its inner one.
"""

import contextlib
import json
import math
import os

import keras
import numpy as np
import tensorflow as tf

from tfdp import accounting, distribute
from tfdp.accounting.calibration import steps_per_epoch as default_steps_per_epoch
from tfdp.accounting.joint_gaussian import joint_step_event
from tfdp.data.poisson import PoissonSampler, make_dataset
from tfdp.data.users import UserSampler
from tfdp.mechanisms import dpsgd, quantile_clipping
from tfdp.mechanisms.gaussian import fold_seed
from tfdp.models.released_writes import release
from tfdp.optimizers import sparse_embeddings as sparse
from tfdp.optimizers.noise_target import NoiseTarget

WEIGHT_DECAY_PLACEMENTS = ("before_clip", "after_noise")

FIXED_SETTING_ERROR = (
    "`{name}` of {cls} is fixed once the optimizer is created: the compiled "
    "train step keeps the value it was traced with, and the privacy ledger must "
    "charge exactly what the step runs. Create a new optimizer with the setting "
    "you want and compile the model with it (the ledger keeps counting). "
    "Received: {name}={value!r}"
)

NON_PRIVATE_ERROR = (
    "{name} is a differentially private optimizer: it needs per-example "
    "gradients to clip, and apply_gradients received the batch's mean gradient "
    "(from a plain keras.Model's fit, or from a custom training loop with "
    "tf.GradientTape). DP training runs only through `model.fit` of a "
    "tfdp.DPModel(inputs, outputs) or tfdp.DPSequential([...]) compiled with "
    "this optimizer: its train step computes the per-example gradients and "
    "the ledger counts the step. A custom training loop is not supported; "
    "customise the loss, the model's call() or a callback instead "
    "(docs/guides/your-model.md, \"Customising training\"). Nothing was "
    "applied, so nothing ran without privacy."
)


def check_positive(name, value):
    """Raises ValueError unless `value` is a finite number > 0 (Keras style)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"Expected `{name}` to be a number. Received: {name}={value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"Expected `{name}` to be a finite number > 0. Received: {name}={value}"
        )
    return float(value)


# Clip norms and noise standard deviations above this overflow float32 once
# a batch of them is summed (float32's largest value is 3.4e38).
FLOAT32_SAFE_SCALE = 1e30


def check_float32_scale(name, value, received,
                        why="the per-example gradients and noise are float32"):
    """Refuses `value` (the setting or product `name`) above FLOAT32_SAFE_SCALE.

    `received` lists the arguments it comes from; `why` says where it is float32.

    Example:

    >>> check_float32_scale("l2_norm_clip", 1e31, "l2_norm_clip=1e+31")
    Traceback (most recent call last):
    ...
    ValueError: `l2_norm_clip` = 1e+31 overflows float32 (...). Received: l2_norm_clip=1e+31
    """
    if value > FLOAT32_SAFE_SCALE:
        raise ValueError(
            f"`{name}` = {value:g} overflows float32 ({why}; keep it <= "
            f"{FLOAT32_SAFE_SCALE:g}). Received: {received}"
        )


def check_float32_noise(l2_norm_clip, noise_multiplier):
    """Refuses a clip norm or noise std (sigma * C) that overflows float32 sums."""
    received = f"l2_norm_clip={l2_norm_clip:g}, noise_multiplier={noise_multiplier:g}"
    check_float32_scale("l2_norm_clip", l2_norm_clip, received)
    check_float32_scale("noise_multiplier * l2_norm_clip", noise_multiplier * l2_norm_clip, received)


def noise_multiplier_or_default(noise_multiplier, kwargs, default=1.0):
    """For optimizers whose `noise_multiplier` defaults to 1.0: `default`
    when none is given and no `target_epsilon` is in `kwargs` (which then
    leaves sigma to `fit`).

    Example:

    >>> noise_multiplier_or_default(None, {}), noise_multiplier_or_default(None, {"target_epsilon": 3})
    (1.0, None)
    """
    if noise_multiplier is None and kwargs.get("target_epsilon") is None:
        return default
    return noise_multiplier


def draw_multiple(batch_size):
    """Rows a Poisson draw is padded to a multiple of, without a fixed shape.

    8 keeps the number of distinct batch shapes (each a set of kernel
    set-ups) small where it costs little (under 3% more rows from batch 256
    on), but at the small batches of fine-tuning it would add up to 40% of
    the work (a draw of 9 at batch 8 runs 16 rows): there batches are padded
    to a multiple of batch_size // 32, 1 below batch 64.

    Example:

    >>> [draw_multiple(b) for b in (8, 64, 256, 2048)]
    [1, 2, 8, 8]
    """
    return int(min(8, max(1, batch_size // 32)))


def check_finite_hyperparameters(inner_optimizer):
    """Refuses NaN or infinite numbers among the inner optimizer's settings
    (Keras accepts `momentum=nan`; every weight then becomes NaN)."""
    for name, value in inner_optimizer.get_config().items():
        if isinstance(value, (float, np.floating)) and not math.isfinite(value):
            raise ValueError(
                f"Expected `{name}` of the inner {type(inner_optimizer).__name__} to be "
                f"finite. Received: {name}={value}"
            )


def _show_kwargs(kwargs):
    return ", ".join(f"{key}={value!r}" for key, value in sorted(kwargs.items()))


def _noise_key(seed):
    """Two int64 words keying the stateless noise; OS entropy unless seeded."""
    if seed is None:
        words = np.frombuffer(os.urandom(16), dtype=np.int64)
    else:
        words = np.random.default_rng([int(seed), 0x7FD9]).integers(
            np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=2, dtype=np.int64
        )
    return words.copy()


def _without_names(config):
    """`config` without its "name" entries (Keras numbers default names by
    how many optimizers a process made, which workers need not share)."""
    if isinstance(config, dict):
        return {k: _without_names(v) for k, v in config.items() if k != "name"}
    if isinstance(config, (list, tuple)):
        return [_without_names(v) for v in config]
    return config


class _FitNonce:
    """This `fit`'s nonce, as the noise key reads it (unseeded runs): a plain
    holder, so that neither Keras nor TF tracking saves the variable."""

    def __init__(self):
        self.variable = None


class _ModelSteps:
    """The model's private step counter, as the optimizer's noise key reads it.

    A plain holder, so that neither Keras nor TF tracking makes the model's
    variable an optimizer variable.
    """

    def __init__(self, variable=None):
        self.variable = variable


@keras.saving.register_keras_serializable(package="tfdp")
class DPOptimizer(keras.optimizers.Optimizer):
    """Makes any Keras optimizer differentially private (DP-SGD's mechanism).

    Each step clips every example's gradient to L2 norm `l2_norm_clip`, sums,
    adds N(0, (noise_multiplier * l2_norm_clip)^2) to every coordinate, divides
    by the expected batch size and hands the noisy mean to `inner_optimizer`.
    Use it with `tfdp.DPModel` / `tfdp.DPSequential`, which compute the
    per-example gradients and feed Poisson-sampled batches; a plain
    `keras.Model` gets a clear error instead of silently non-private training.

    Args:
        inner_optimizer: a `keras.optimizers.Optimizer` (Adam, SGD, RMSprop,
            ...). It only post-processes noisy gradients.
        l2_norm_clip: clipping bound C > 0 on each example's gradient norm.
        noise_multiplier: sigma > 0; the noise's standard deviation is
            sigma * C on the sum of clipped gradients. None (the default)
            with `target_epsilon`: chosen by the first `fit`.
        weight_decay: lambda >= 0 (default 0, none).
        weight_decay_placement: "before_clip" (default; seed 003: the L2 term
            lambda/2 ||theta||^2 joins each example's loss, so lambda * theta
            is added to every per-example gradient before clipping) or
            "after_noise" (classic: lambda * theta added to the noisy
            gradient, which can pin theta at C / lambda).
        seed: optional int making noise and sampling reproducible. Anyone who
            knows the seed can subtract the noise: use it for tests and
            reproductions, never for a model whose privacy matters. Without it
            the noise is keyed from OS entropy per run, and by a fresh nonce
            per `fit` (so a `fit` after `model.load_weights(earlier)` draws
            new noise). Neither the seed nor the key is ever saved (a loaded
            optimizer has seed None), and the noise of a step is keyed by the
            model's private step count too, so compiling a loaded model with
            a new optimizer of the same seed never replays the noise of
            earlier steps. A seeded run is reproducible: rolled back into the
            same optimizer, it replays the noise of the restored steps.
        name: optimizer name.
        target_epsilon: instead of `noise_multiplier`, the epsilon the run
            must end within: the first `fit` calibrates sigma from the number
            of records (or people, with `user_ids`), `batch_size` and its
            planned epochs, composed with what the model's ledger has spent,
            prints it and fixes it; a later `fit` that would pass the target
            is refused before its first step (`noise_target.NoiseTarget`).
            With both, `noise_multiplier` is used and the target only guards.
        target_delta: the delta of `target_epsilon` (required with it).
        target_unclipped_quantile: None (the default: C stays `l2_norm_clip`)
            or gamma in (0, 1) for adaptive clipping (Andrew et al. 2021): C
            starts at `l2_norm_clip` and moves each step toward the gamma
            quantile of the units' gradient norms, from a noisy count of the
            units it left unclipped. The ledger charges the same as fixed
            clipping at `noise_multiplier`: the gradient's noise multiplier
            is lowered to (z^-2 - (2 sigma_b)^-2)^(-1/2) to pay for the count
            (docs/mechanisms/dpsgd.md, "Adaptive clipping"). C is an
            optimizer variable (saved with the model, restored by
            BackupAndRestore) and `fit` logs it as `clip_norm`.
        clip_learning_rate: eta > 0 of C's update (default 0.2, the paper's;
            only with `target_unclipped_quantile`).
        clipped_count_stddev: sigma_b > 0, the noise on the count of
            unclipped units (default None: expected batch size / 20, the
            paper's); needs 2 sigma_b > noise_multiplier.
        clip_update: "geometric" (default, C exp(-eta (b - gamma))) or
            "linear" (C - eta (b - gamma)).
        sparse_embeddings: None (default: every coordinate gets noise) or
            {Embedding layer name: `tfdp.optimizers.SparseNoise(...)`}: those
            tables are updated on privately selected rows only, with noise
            on those rows only (`tfdp.optimizers.sparse_embeddings`;
            docs/mechanisms/sparse-embeddings.md). `noise_multiplier` stays
            the step's z, the one the ledger charges; the gradient's noise
            is raised to (z^-2 - sum sigma_c^-2)^(-1/2) to pay for the
            selections.

    Every privacy setting (the arguments above, and those listed in a
    subclass's `_fixed_settings`) is fixed once the optimizer is created:
    assigning one raises AttributeError. The compiled step keeps the values
    it was traced with, so a changed attribute would make the ledger charge
    a noise level the step does not add. To change a setting, compile the
    model with a new optimizer; the ledger keeps counting.

    Example:

    >>> import keras, tfdp
    >>> opt = tfdp.optimizers.DPOptimizer(
    ...     keras.optimizers.Adam(1e-3), l2_norm_clip=1.0, noise_multiplier=1.1)
    >>> opt.noise_multiplier
    1.1

    A target epsilon instead (sigma is chosen, and printed, by `fit`):

    >>> opt = tfdp.optimizers.DPOptimizer(keras.optimizers.Adam(1e-3), l2_norm_clip=1.0,
    ...                                   target_epsilon=3.0, target_delta=1e-5)
    """

    # Settings the compiled step reads as Python values: assignable once
    # (by the constructor). Subclasses extend the tuple.
    _fixed_settings = (
        "l2_norm_clip",
        "noise_multiplier",
        "weight_decay",
        "weight_decay_placement",
        "seed",
        "noise_target",
        "target_unclipped_quantile",
        "clip_learning_rate",
        "clipped_count_stddev",
        "clip_update",
        "sparse_embeddings",
    )

    # Why a subclass cannot clip adaptively (None: it can).
    adaptive_clipping_unsupported = None

    # Whether `target_epsilon` can set this optimizer's noise at `fit`: its
    # step is DP-SGD's event (what `calibrate_noise_multiplier` calibrates).
    calibrates_noise_at_fit = True

    def __init__(
        self,
        inner_optimizer,
        l2_norm_clip,
        noise_multiplier=None,
        weight_decay=0.0,
        weight_decay_placement="before_clip",
        seed=None,
        name=None,
        target_epsilon=None,
        target_delta=None,
        target_unclipped_quantile=None,
        clip_learning_rate=None,
        clipped_count_stddev=None,
        clip_update="geometric",
        sparse_embeddings=None,
        **kwargs,
    ):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "Expected `inner_optimizer` to be a keras.optimizers.Optimizer "
                f"instance. Received: inner_optimizer={inner_optimizer!r}"
            )
        if isinstance(inner_optimizer, DPOptimizer):
            raise ValueError(
                "`inner_optimizer` is already a tfdp optimizer; wrapping it again "
                "would clip and noise twice. Received: inner_optimizer="
                f"{type(inner_optimizer).__name__}"
            )
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "`inner_optimizer` is a keras.optimizers.LossScaleOptimizer, which divides "
                "the gradients it is given by its loss scale: a tfdp model computes its "
                "loss and per-example gradients in float32 without scaling them, so the "
                "private update would shrink by the loss scale (32768 at first) while "
                "the full epsilon is charged. Pass the optimizer it wraps instead "
                "(`inner_optimizer.inner_optimizer`); tfdp needs no loss scaling under "
                "mixed_float16. Received: inner_optimizer=LossScaleOptimizer("
                f"{type(inner_optimizer.inner_optimizer).__name__})"
            )
        if kwargs:
            raise TypeError(
                f"{type(self).__name__} got unexpected arguments {sorted(kwargs)}; its "
                "arguments are listed in help(tfdp.optimizers."
                f"{type(self).__name__}). Received: {_show_kwargs(kwargs)}"
            )
        l2_norm_clip = check_positive("l2_norm_clip", l2_norm_clip)
        noise_target = self._noise_target(noise_multiplier, target_epsilon, target_delta)
        if noise_multiplier is not None:
            noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
            check_float32_noise(l2_norm_clip, noise_multiplier)
        check_finite_hyperparameters(inner_optimizer)
        adaptive = self._check_adaptive_clipping(
            target_unclipped_quantile, clip_learning_rate, clipped_count_stddev, clip_update,
            noise_multiplier)
        sparse_embeddings = self._check_sparse_embeddings(
            sparse_embeddings, noise_multiplier, target_unclipped_quantile)
        if isinstance(weight_decay, bool) or not isinstance(
            weight_decay, (int, float, np.number)
        ) or not math.isfinite(weight_decay) or weight_decay < 0:
            raise ValueError(
                "Expected `weight_decay` to be a finite number >= 0. "
                f"Received: weight_decay={weight_decay!r}"
            )
        if weight_decay_placement not in WEIGHT_DECAY_PLACEMENTS:
            raise ValueError(
                f"Expected `weight_decay_placement` in {WEIGHT_DECAY_PLACEMENTS}. "
                f"Received: weight_decay_placement={weight_decay_placement!r}"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise TypeError(f"Expected `seed` to be an int or None. Received: seed={seed!r}")
        if seed is not None and seed < 0:
            raise ValueError(f"Expected `seed` to be an int >= 0 or None. Received: seed={seed}")
        super().__init__(learning_rate=0.0, name=name)
        # Keras's constructor sets its own `weight_decay`; ours is assigned next.
        self.__dict__["_assigned_settings"] = set()
        self.inner_optimizer = inner_optimizer
        self.l2_norm_clip = l2_norm_clip
        if noise_multiplier is None:  # fixed by the first fit (NoiseTarget.plan)
            self.__dict__["noise_multiplier"] = None
        else:
            self.noise_multiplier = noise_multiplier
        self.noise_target = noise_target
        self.weight_decay = float(weight_decay)
        self.weight_decay_placement = weight_decay_placement
        self.seed = seed
        self.target_unclipped_quantile = adaptive[0]
        self.clip_learning_rate = adaptive[1]
        self.clipped_count_stddev = adaptive[2]
        self.clip_update = adaptive[3]
        self.sparse_embeddings = sparse_embeddings
        if sparse_embeddings is not None:
            self.__dict__["physical_batches_unsupported"] = (
                "sparse_embeddings selects rows from the whole logical batch's counts.")
        self._clip_norm = None  # adaptive clipping: C_t, made by build
        self._noise_key = _noise_key(seed)
        self._model_steps = _ModelSteps()
        self._fit_nonce = _FitNonce()

    def _check_sparse_embeddings(self, sparse_embeddings, noise_multiplier, quantile):
        """Validates `sparse_embeddings` (`tfdp.optimizers.sparse_embeddings`)."""
        settings = sparse.check_settings(sparse_embeddings)
        if settings is None:
            return None
        overridden = [name for name in ("privatize", "clipped_sum", "noisy_gradients",
                                        "step_event", "apply_private_gradients")
                      if getattr(type(self), name) is not getattr(DPOptimizer, name)]
        if overridden:
            raise ValueError(
                f"`sparse_embeddings` is a setting of DP-SGD's step (tfdp.optimizers.DPOptimizer); "
                f"{type(self).__name__} changes that step ({', '.join(overridden)}), so its "
                "analysis does not cover the selection. Use DPOptimizer, or no "
                "sparse_embeddings. Received: sparse_embeddings="
                f"{sparse_embeddings!r}")
        if quantile is not None:
            raise ValueError(
                "`sparse_embeddings` and adaptive clipping (target_unclipped_quantile) cannot "
                "be combined yet: both pay for a count from the step's noise multiplier. Use "
                f"a fixed l2_norm_clip. Received: target_unclipped_quantile={quantile!r}")
        if noise_multiplier is not None:
            sparse.gradient_noise_multiplier(noise_multiplier, settings.values())
        return settings

    def _check_adaptive_clipping(self, quantile, learning_rate, count_stddev, update,
                                 noise_multiplier):
        """Validates the adaptive-clipping arguments; returns them resolved
        (all None but `clip_update` without a target quantile)."""
        if quantile is None:
            given = {name: value for name, value in (
                ("clip_learning_rate", learning_rate), ("clipped_count_stddev", count_stddev))
                if value is not None}
            if update != "geometric":
                given["clip_update"] = update
            if given:
                raise ValueError(
                    f"{_show_kwargs(given)} set(s) adaptive clipping, which "
                    "`target_unclipped_quantile` turns on (e.g. 0.5, the median norm). "
                    f"Received: {_show_kwargs(given)} with target_unclipped_quantile=None"
                )
            return None, None, None, "geometric"
        reason = type(self).adaptive_clipping_unsupported
        if reason:
            raise ValueError(
                f"{type(self).__name__} cannot clip adaptively: {reason} Use DPSGD or "
                f"DPOptimizer. Received: target_unclipped_quantile={quantile!r}"
            )
        if isinstance(quantile, bool) or not isinstance(quantile, (int, float, np.number)) or not (
                0.0 < quantile < 1.0):
            raise ValueError(
                "Expected `target_unclipped_quantile` to be a number in (0, 1) (the "
                "fraction of units left unclipped), or None. Received: "
                f"target_unclipped_quantile={quantile!r}"
            )
        if learning_rate is None:
            learning_rate = quantile_clipping.DEFAULT_CLIP_LEARNING_RATE
        learning_rate = check_positive("clip_learning_rate", learning_rate)
        if count_stddev is not None:
            count_stddev = check_positive("clipped_count_stddev", count_stddev)
            if noise_multiplier is not None:
                quantile_clipping.check_noise_split(
                    float(noise_multiplier), count_stddev,
                    f"noise_multiplier={noise_multiplier}, clipped_count_stddev={count_stddev}")
        if update not in quantile_clipping.CLIP_UPDATES:
            raise ValueError(
                f"Expected `clip_update` in {quantile_clipping.CLIP_UPDATES}. Received: "
                f"clip_update={update!r}"
            )
        return float(quantile), learning_rate, count_stddev, update

    @property
    def clips_adaptively(self):
        """Whether C follows a quantile of the norms (`target_unclipped_quantile`)."""
        return self.target_unclipped_quantile is not None

    def clip_norm(self):
        """The clip norm this step uses: `l2_norm_clip`, or with adaptive
        clipping the variable C_t (a float32 scalar; `float(...)` reads it)."""
        if not self.clips_adaptively:
            return self.l2_norm_clip
        if self._clip_norm is None:
            raise ValueError(
                "The adaptive clip norm is made when the optimizer is built (by the "
                "model's first fit, or optimizer.build(variables)). Received: an "
                "unbuilt optimizer"
            )
        return self._clip_norm

    def count_stddev(self, expected_batch_size):
        """sigma_b, the noise on the count of unclipped units."""
        return quantile_clipping.count_stddev(self.clipped_count_stddev, expected_batch_size)

    def check_noise_split(self, batch_size):
        """With adaptive clipping, refuses a sigma_b at which the gradient's
        noise multiplier is not defined (2 sigma_b <= z) for `batch_size`."""
        if not self.clips_adaptively or self.noise_multiplier is None:
            return
        stddev = self.count_stddev(float(batch_size))
        source = (f"clipped_count_stddev={stddev:g}" if self.clipped_count_stddev is not None
                  else f"clipped_count_stddev=None (batch_size / 20 = {stddev:g})")
        sigma = quantile_clipping.check_noise_split(
            float(self.noise_multiplier), stddev,
            f"noise_multiplier={self.noise_multiplier:g}, {source}, batch_size={batch_size}")
        check_float32_noise(self.l2_norm_clip, sigma)

    def _noise_target(self, noise_multiplier, target_epsilon, target_delta):
        """The `NoiseTarget` of `target_epsilon` (None without one); refuses
        neither sigma nor a target, and a target this mechanism cannot
        calibrate."""
        if target_epsilon is None:
            if target_delta is not None:
                raise ValueError(
                    "`target_delta` goes with `target_epsilon`. Received: "
                    f"target_delta={target_delta!r}, target_epsilon=None"
                )
            if noise_multiplier is None:
                raise ValueError(
                    f"{type(self).__name__} needs `noise_multiplier` (sigma > 0) or "
                    "`target_epsilon` with `target_delta` (sigma then chosen by fit). "
                    "Received: noise_multiplier=None, target_epsilon=None"
                )
            return None
        if not type(self).calibrates_noise_at_fit:
            raise ValueError(
                f"{type(self).__name__} cannot calibrate its noise from a target epsilon "
                "at fit; pass `noise_multiplier` (tfdp.accounting answers which sigma a "
                f"target needs). Received: target_epsilon={target_epsilon!r}"
            )
        return NoiseTarget(target_epsilon, target_delta)

    def plan_noise(self, model, num_units, batch_size, steps, unit_name, say):
        """Called by `DPModel.fit` after any backup is restored and before
        anything is released: with a target epsilon, calibrates sigma (unless a fit already trained with
        it) and refuses a fit that would pass the target (`NoiseTarget.plan`).
        The sigma is fixed when the fit starts releasing (`fix_planned_noise`):
        a fit refused before then leaves it open. No-op without a target."""
        if self.noise_target is None:
            return
        executions = getattr(model, "steps_per_execution", 1)
        if executions > 1:
            raise ValueError(
                f"The optimizer's target_epsilon={self.noise_target.epsilon:g} is enforced "
                "between steps (fit stops at the target, never past it), so it needs one step "
                "per execution: compile with steps_per_execution=1, or give the optimizer a "
                "fixed noise_multiplier (tfdp.accounting.calibrate_dpsgd computes one for a "
                "target) to run several steps per execution. Nothing was trained. "
                f"Received: steps_per_execution={executions}"
            )
        if "noise_multiplier" not in self.__dict__["_assigned_settings"]:
            self.__dict__["noise_multiplier"] = None  # still open: plan this fit
        sigma = self.noise_target.plan(self, model.privacy, num_units, batch_size, steps,
                                       unit_name, say)
        if sigma is not None:
            check_float32_noise(self.l2_norm_clip, sigma)
            self.__dict__["noise_multiplier"] = sigma

    def fix_planned_noise(self):
        """Fixes the sigma `plan_noise` chose (called by `DPModel.fit` as the
        ledger opens the fit's steps); from then on it is a fixed setting."""
        if self.__dict__.get("noise_multiplier") is not None:
            self.__dict__["_assigned_settings"].add("noise_multiplier")

    def __setattr__(self, name, value):
        if name in type(self)._fixed_settings:
            assigned = self.__dict__.get("_assigned_settings", set())
            if name in assigned:
                raise AttributeError(
                    FIXED_SETTING_ERROR.format(name=name, cls=type(self).__name__, value=value)
                )
            assigned.add(name)
        super().__setattr__(name, value)

    # -- Keras optimizer plumbing (as in LossScaleOptimizer) ---------------

    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        if self.clips_adaptively and self._clip_norm is None:
            # C_t: released information only (C_0 and the noisy counts).
            self._clip_norm = self.add_variable(
                shape=(), initializer=keras.initializers.Constant(self.l2_norm_clip),
                dtype="float32", name="clip_norm")

    @property
    def target_epsilon(self):
        """The `target_epsilon` this optimizer was given, or None (a fixed
        `noise_multiplier`). Example: `optimizer.target_epsilon` -> 3.0."""
        return None if self.noise_target is None else self.noise_target.epsilon

    @property
    def target_delta(self):
        """The `target_delta` of `target_epsilon`, or None without one."""
        return None if self.noise_target is None else self.noise_target.delta

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def apply(self, grads, trainable_variables=None):
        raise ValueError(NON_PRIVATE_ERROR.format(name=type(self).__name__))

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise ValueError(NON_PRIVATE_ERROR.format(name=type(self).__name__))

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- the private step ---------------------------------------------------

    def noise_stddev(self, expected_batch_size=None):
        """Standard deviation of the noise on each coordinate of the sum.

        With adaptive clipping, sigma_grad * C_t, sigma_grad = (z^-2 -
        (2 sigma_b)^-2)^(-1/2) for the count's sigma_b at the expected
        batch size (`expected_batch_size`, required then).
        """
        if not self.clips_adaptively:
            return self.noise_multiplier * self.l2_norm_clip
        stddev = tf.cast(self.count_stddev(expected_batch_size), tf.float32)
        sigma = quantile_clipping.gradient_noise_multiplier(
            tf.constant(self.noise_multiplier, tf.float32), stddev)
        return sigma * self.clip_norm()

    def count_noise_stddev(self, expected_batch_size):
        """sigma_b, the noise on the centred count of unclipped units."""
        return self.count_stddev(expected_batch_size)

    def bind_model_steps(self, model):
        """Keys this optimizer's noise by `model`'s private step counter, and
        by a fresh nonce for this `fit` (`_draw_fit_nonce`).

        Called by `make_training_data` at every `fit`. The counter is the one
        the privacy ledger counts: it is saved with the model, so a model
        loaded and compiled with a new optimizer of the same seed (whose own
        iteration counter starts at 0) gets fresh noise. It goes back with
        the weights, though (`model.load_weights(earlier)`): the nonce keeps
        an unseeded run's next fit from drawing a rolled-back branch's noise
        again.
        """
        self._model_steps.variable = getattr(model, "_dp_steps", None)
        self._draw_fit_nonce(model)

    def _draw_fit_nonce(self, model, shared=None):
        """Draws this fit's nonce (unseeded runs; a seeded run is reproducible
        by design, rollbacks included): 64 bits of OS entropy, or, from
        `shared` (the workers' secret seed of this fit), the same on every
        worker (DP-BandMF's replicas must draw the same noise). The variable
        is made at the first `fit` (the traced step reads it) and assigned
        at each later one; it is never saved."""
        if self.seed is not None:
            return
        if shared is None:
            value = np.frombuffer(os.urandom(8), np.int64)[0]
        else:
            value = np.random.default_rng([int(shared), 0x4E0C]).integers(
                np.iinfo(np.int64).min, np.iinfo(np.int64).max, dtype=np.int64)
        holder = self._fit_nonce
        if holder.variable is not None:
            holder.variable.assign(value)
            return
        strategy = model.distribute_strategy
        several = strategy.num_replicas_in_sync > 1
        # As the DP-BandMF noise stream's variables: a copy per replica.
        per_replica = dict(synchronization=tf.VariableSynchronization.ON_READ,
                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA) if several else {}
        with strategy.scope() if several else contextlib.nullcontext():
            holder.variable = tf.Variable(value, dtype=tf.int64, trainable=False, **per_replica)

    def fit_nonce_words(self):
        """This fit's nonce for a host-side draw's key (DPIS's K~ and
        importance sampling): int64 [1], or [0] for a seeded run
        (reproducible by design, rollbacks included) or before the first
        `bind_model_steps`. A draw that folds it in, as `step_key` does, is
        fresh in every fit of an unseeded run whatever the restored counters
        (a rolled-back branch never draws the discarded one's values).

        Example:

        >>> from tfdp.optimizers import DPSGD
        >>> DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0).fit_nonce_words()  # no fit yet
        array([], dtype=int64)
        """
        variable = self._fit_nonce.variable
        if variable is None or self.seed is not None:
            return np.zeros([0], np.int64)
        return np.reshape(variable.numpy(), [1]).astype(np.int64)

    def step_key(self):
        """This step's key: the run's secret key folded with this fit's nonce
        (unseeded runs, `bind_model_steps`), the model's step count and the
        optimizer's iteration count. Without a bound model (the optimizer
        driven by hand) the key is folded with the iteration count only."""
        key = self._noise_key
        nonce = self._fit_nonce.variable
        if nonce is not None and self.seed is None:
            key = dpsgd.step_seed(key, nonce)
        counter = self._model_steps.variable
        if counter is not None:
            key = dpsgd.step_seed(key, counter)
        return dpsgd.step_seed(key, self.iterations)

    def noise_seed(self):
        """This step's noise seed: `step_key`, per replica under tf.distribute."""
        seed = self.step_key()
        replica = tf.distribute.get_replica_context()
        if replica is not None and replica.num_replicas_in_sync > 1:
            seed = fold_seed(seed, replica.replica_id_in_sync_group)
        return seed

    def _decay_offsets(self, variables):
        return [self.weight_decay * tf.cast(v, tf.float32) for v in variables]

    def privatize(self, per_example, step_info):
        """Clip, sum, noise and average per-example gradients.

        Args:
            per_example: `tfdp.per_example.PerExampleGradients`.
            step_info: dict with "mask" (float [B], 0 on padding rows) and
                "expected_batch_size" (scalar).

        Under a tf.distribute strategy with R replicas this runs on each
        replica's share of the global batch and returns that replica's part
        of the noisy mean (noise std `noise_stddev() / sqrt(R)`); Keras sums
        the parts. Overrides must do the same (see `tfdp.distribute`).

        Returns:
            (noisy mean gradients aligned with `per_example.variables`,
            dict of per-step tensors for logging).
        """
        sums, counts = self.clipped_sum(per_example, step_info)
        if self.sparse_embeddings is not None:
            return self._sparse_noisy_gradients(sums, step_info, per_example), {
                "nonfinite_examples": counts["nonfinite_examples"]}
        grads = self.noisy_gradients(sums, step_info, per_example.variables)
        return grads, {"nonfinite_examples": counts["nonfinite_examples"],
                       **self.update_clip_norm(counts, step_info)}

    def clipped_sum(self, per_example, step_info):
        """The first half of `privatize`: the sum of clipped gradients.

        Each example's clipping factor depends on its own gradient only, so
        the sums of several chunks of a batch add up to the batch's sum
        (`DPModel.fit(physical_batch_size=...)` relies on it).

        Returns:
            (sums aligned with `per_example.variables`, dict of counts that
            add up over chunks: "nonfinite_examples", the drawn examples
            whose gradient norm is not finite, and with adaptive clipping
            "unclipped_count", sum_i (1[unit i unclipped] - 1/2)).
        """
        if self.weight_decay and self.weight_decay_placement == "before_clip":
            per_example = per_example.with_offsets(self._decay_offsets(per_example.variables))
        sq_norms = per_example.sq_norms()
        clip = self.clip_norm()
        factors = dpsgd.clip_factors(sq_norms, clip, step_info["mask"])
        counts = {"nonfinite_examples": tf.reduce_sum(
            tf.cast(~tf.math.is_finite(sq_norms), tf.float32) * step_info["mask"])}
        if self.clips_adaptively:
            counts["unclipped_count"] = quantile_clipping.centred_unclipped_count(
                sq_norms, clip, step_info["mask"])
        return per_example.weighted_sum(factors), counts

    def update_clip_norm(self, counts, step_info):
        """Adaptive clipping's release after the step's noisy gradients:
        the noisy unclipped fraction b_t, and C_{t+1} from C_t and b_t only.
        Called once a logical step (after `noisy_gradients`, which read
        C_t). Returns {"clip_norm": C_{t+1}, "unclipped_fraction": b_t}
        for the logs, or {} with fixed clipping."""
        if not self.clips_adaptively:
            return {}
        expected = step_info["expected_batch_size"]
        seed = fold_seed(self.noise_seed(), quantile_clipping.COUNT_STREAM)
        fraction = quantile_clipping.unclipped_fraction(
            counts["unclipped_count"], self.count_noise_stddev(expected), expected, seed)
        release(fraction)  # noisy: the next clip norm, saved, reads it
        noise = quantile_clipping.gradient_noise_multiplier(
            tf.constant(self.noise_multiplier, tf.float32),
            tf.cast(self.count_stddev(expected), tf.float32))
        ceiling = FLOAT32_SAFE_SCALE / tf.maximum(noise, 1.0)
        clip = quantile_clipping.next_clip_norm(
            self.clip_norm(), fraction, self.target_unclipped_quantile,
            self.clip_learning_rate, self.clip_update, ceiling)
        self._clip_norm.assign(clip)
        return {"clip_norm": tf.identity(clip), "unclipped_fraction": fraction}

    def noisy_gradients(self, sums, step_info, variables):
        """The second half of `privatize`: noise once, divide by b, decay.

        Args:
            sums: clipped sums from `clipped_sum` (of one batch, or added
                over its chunks).
            step_info: the step's dict ("expected_batch_size").
            variables: the variables `sums` are aligned with.

        Returns:
            The noisy mean gradients.
        """
        # Under tf.distribute Keras sums R replicas: each adds noise of
        # variance sigma^2 C^2 / R and 1/R of the decay (tfdp.distribute).
        stddev = (self.noise_stddev(step_info["expected_batch_size"]) if self.clips_adaptively
                  else self.noise_stddev())
        grads = dpsgd.noisy_mean(
            sums, stddev * distribute.noise_scale(),
            step_info["expected_batch_size"], self.noise_seed(),
        )
        if self.weight_decay and self.weight_decay_placement == "after_noise":
            share = distribute.replica_share()
            grads = [g + o * share for g, o in zip(grads, self._decay_offsets(variables))]
        return grads

    def _sparse_noisy_gradients(self, sums, step_info, per_example):
        """`noisy_gradients` with sparse tables: noise on selected rows only."""
        tables = self.__dict__.get("_sparse_tables")
        if tables is None:
            raise ValueError(
                "`sparse_embeddings` resolves its layers when `DPModel.fit` prepares the data "
                "(make_training_data); this optimizer was driven without it. Train with "
                "DPModel.fit.")
        variables = per_example.variables
        b = step_info["expected_batch_size"]
        seed = self.noise_seed()
        grads, selections = sparse.sparse_noisy_means(
            sums, variables, per_example, step_info["mask"], tables, self.noise_multiplier,
            lambda sigma: sigma * self.l2_norm_clip,
            lambda dense, stddev: dpsgd.noisy_mean(dense, stddev, b, seed), seed,
            static_shapes=self.__dict__.get("_sparse_static_shapes", False), divisor=b)
        if self.weight_decay and self.weight_decay_placement == "after_noise":
            offsets = self._decay_offsets(variables)
            for i, selected in selections.items():  # unselected rows: no update at all
                offsets[i] = offsets[i] * tf.cast(selected, offsets[i].dtype)[:, None]
            grads = [g + o for g, o in zip(grads, offsets)]
        return grads

    # Why a subclass cannot split a logical batch into physical chunks
    # (None: it can, through `clipped_sum` and `noisy_gradients`).
    physical_batches_unsupported = None

    def apply_private_gradients(self, grads, trainable_variables, model=None):
        """Hands the noisy gradients to the inner optimizer.

        Mechanisms that act after the update (SA-DPSGD's acceptance test)
        override this. Returns a dict of per-step tensors for logging.
        """
        self.inner_optimizer.apply(grads, trainable_variables)
        return {}

    def sampling_seed(self, steps_taken):
        """Seed for a `fit` call's sampler: None (OS entropy) unless seeded.

        A user seed is combined with the steps already taken, so a second
        `fit` (or a resumed run) draws new batches instead of replaying.
        """
        if self.seed is None:
            return None
        return int(np.random.SeedSequence([self.seed, steps_taken]).generate_state(1)[0])

    def step_event(self, sampling_probability, noise_multiplier=None):
        """The dp_accounting event one step of this optimizer releases (at
        `noise_multiplier` instead of its own, for planning)."""
        sigma = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        if self.sparse_embeddings is not None:  # the gradient's, then each selection's
            settings = list(self.sparse_embeddings.values())
            return joint_step_event(sampling_probability, [
                sparse.gradient_noise_multiplier(sigma, settings),
                *(s.selection_noise_multiplier for s in settings)])
        return accounting.dpsgd_event(sigma, sampling_probability)

    # Why a subclass cannot run under several replicas (None: it can).
    multi_replica_unsupported = None

    def check_distributable(self, strategy):
        """Raises unless this optimizer is exact under `strategy`'s replicas.

        Called by `make_training_data` when the model's strategy has several
        replicas. Refuses a mechanism that sets `multi_replica_unsupported`,
        and an inner optimizer with `clipnorm`, `clipvalue` or
        `global_clipnorm`: Keras applies those to each replica's part of the
        gradient before summing, and a part carries only 1/sqrt(R) of the
        noise, so the result would not be a function of the private sum.
        """
        replicas = strategy.num_replicas_in_sync
        if replicas <= 1:
            return
        if self.clips_adaptively:
            raise ValueError(
                "Adaptive clipping (target_unclipped_quantile) trains on one device: its "
                "count of unclipped units would need a sum across replicas that Keras's "
                "gradient sum does not make. Train on one device or with a fixed "
                f"l2_norm_clip. Received: {replicas} replicas"
            )
        if self.sparse_embeddings is not None:
            raise ValueError(
                "`sparse_embeddings` trains on one device: each replica would select rows "
                "from its own share's counts, a selection Keras's gradient sum does not "
                f"make. Train on one device or without sparse_embeddings. Received: {replicas} "
                "replicas")
        if self.multi_replica_unsupported:
            raise ValueError(
                f"{type(self).__name__} cannot train under a tf.distribute strategy "
                f"with several replicas: {self.multi_replica_unsupported} Train it "
                f"on one device. Received: {replicas} replicas"
            )
        for name in ("clipnorm", "clipvalue", "global_clipnorm"):
            value = getattr(self.inner_optimizer, name, None)
            if value is not None:
                raise ValueError(
                    f"Under a tf.distribute strategy with several replicas the inner "
                    f"optimizer must not clip gradients: Keras would clip each "
                    f"replica's partial gradient, which carries only part of the DP "
                    f"noise. tfdp already clips per example (l2_norm_clip). "
                    f"Received: {name}={value} with {replicas} replicas"
                )

    def agree_with_workers(self, model, num_examples, batch_size, steps_per_epoch=None):
        """Under several replicas: checks that every worker runs the same
        settings (`run_settings`) and returns the chief's secret sampling
        seed, in one all-gather (`tfdp.distribute.shared_sampling_seed`).

        `fit` calls it before it builds the optimizer: optimizers that differ
        (Adam on one worker, SGD on another) would otherwise make different
        collectives while creating their variables and fail unclearly there.
        Returns None on one replica.
        """
        strategy = model.distribute_strategy
        if strategy.num_replicas_in_sync <= 1:
            return None
        self.check_distributable(strategy)
        executions = getattr(model, "steps_per_execution", 1)
        if executions > 1:
            raise ValueError(
                "Under a tf.distribute strategy with several replicas a DP model runs "
                "one step per execution (Keras's multi-step loop fails inside "
                "TensorFlow on the replicas' input there): compile with "
                f"steps_per_execution=1. Received: steps_per_execution={executions} with "
                f"{strategy.num_replicas_in_sync} replicas"
            )
        if steps_per_epoch is None:
            steps_per_epoch = default_steps_per_epoch(num_examples, batch_size)
        settings = self.run_settings(model, num_examples, batch_size, steps_per_epoch)
        self.__dict__["_workers_seed"] = distribute.shared_sampling_seed(
            strategy, num_examples, settings
        )
        return self.__dict__["_workers_seed"]

    def workers_seed(self, model, num_examples, batch_size, steps_per_epoch=None):
        """Under several replicas, for `make_training_data`: the workers'
        shared secret seed that `fit` agreed on (`agree_with_workers`) before
        building the optimizer, taken once, or a new agreement when
        `make_training_data` is called without `fit`."""
        shared = self.__dict__.pop("_workers_seed", None)  # fit agreed already
        if shared is None:
            shared = self.agree_with_workers(model, num_examples, batch_size, steps_per_epoch)
            del self.__dict__["_workers_seed"]
        return shared

    def run_settings(self, model, num_examples, batch_size, steps_per_epoch):
        """What every worker of a multi-worker run must share (checked by
        `tfdp.distribute.shared_sampling_seed`): the batch, the steps, the
        ledger's steps so far, sigma and C, the optimizer (class and
        configuration) and the mechanism's step event."""
        config = json.dumps(_without_names(self.get_config()), sort_keys=True,
                            default=lambda v: v.item() if hasattr(v, "item") else type(v).__name__)
        return {
            "batch_size": float(batch_size),
            "steps_per_epoch": steps_per_epoch,
            "steps_run": int(model.privacy.steps),
            # Open until fit plans it (a target epsilon): the target instead.
            "noise_multiplier": (repr(self.noise_target.get_config())
                                 if self.noise_multiplier is None else float(self.noise_multiplier)),
            "l2_norm_clip": float(self.l2_norm_clip),
            "optimizer": f"{type(self).__module__}.{type(self).__qualname__} {config}",
            "mechanism": self.mechanism_setting(num_examples, batch_size),
        }

    def mechanism_setting(self, num_examples, batch_size):
        """What the ledger will charge per step, as a text every worker
        compares (`run_settings`): the step event at rate b / N."""
        if self.noise_multiplier is None:  # planned by fit from the target, after this
            return f"DP-SGD at rate {float(batch_size) / num_examples!r}"
        return repr(self.step_event(float(batch_size) / num_examples))

    def training_callbacks(self):
        """Keras callbacks this mechanism needs during `DPModel.fit`.

        `fit` runs them before every other callback (before `PrivacyBudget`
        reads the ledger), so a mechanism can make per-epoch releases and
        open the epoch's step event in `on_epoch_begin` (DPIS does). Called
        after `make_training_data`. Default: none.
        """
        return []

    # Why a subclass cannot train user-level (`fit(user_ids=...)`; None: it can).
    user_level_unsupported = None

    def make_training_data(self, model, arrays, batch_size, steps_per_epoch=None, budgets=(),
                           users=None, examples_per_user=None):
        """Poisson-sampled training data for `DPModel.fit` (docs/mechanisms/index.md).

        `budgets` are the fit's `PrivacyBudget` callbacks: a mechanism that
        makes releases outside its steps (DPIS) checks them before each
        release; DP-SGD's steps are left to the callbacks themselves.

        Opens the ledger's step event for these settings and returns
        `(dataset, steps_per_epoch)`; each element is `(arrays_batch,
        step_info)` with a padding mask and the expected batch size.

        Under a tf.distribute strategy with several replicas, every worker
        draws the same global batch (user seed, or a secret seed broadcast by
        the chief) and each replica gets its share of it as its element
        (`tfdp.distribute.distribute_poisson_batches`); "expected_batch_size"
        stays the global b.

        With `users` (a `tfdp.data.users.UserRecords`) and
        `examples_per_user` k, the step samples users instead of records
        (`tfdp.data.users.UserSampler`: q = batch_size / U, k records a
        user) and the ledger's steps are user-level ("add_or_remove_user").
        """
        num_examples = len(tf.nest.flatten(arrays)[0])
        if users is not None:
            num_examples = users.num_users  # the sampled units: people
        self.check_noise_split(batch_size)
        if self.sparse_embeddings is not None:
            if self.noise_multiplier is not None:
                sparse.gradient_noise_multiplier(self.noise_multiplier,
                                                 self.sparse_embeddings.values())
            self.__dict__["_sparse_tables"] = sparse.resolve_tables(self.sparse_embeddings, model)
            self.__dict__["_sparse_static_shapes"] = bool(model.jit_compile)
        strategy = model.distribute_strategy
        self.bind_model_steps(model)
        seed = self.sampling_seed(model.privacy.steps)
        if strategy.num_replicas_in_sync > 1:
            shared = self.workers_seed(model, num_examples, batch_size, steps_per_epoch)
            if seed is None:  # every worker must draw the same global batches
                seed = shared
        # Without XLA the compiled step takes any batch length without
        # retracing, so batches are not padded to one fixed shape (padding
        # rows cost as much as real ones). XLA and replicas keep one shape.
        fixed_shape = bool(model.jit_compile) or strategy.num_replicas_in_sync > 1
        padding = dict(fixed_shape=fixed_shape,
                       multiple=8 if fixed_shape else draw_multiple(batch_size))
        if users is None:
            sampler = PoissonSampler(num_examples, batch_size, steps_per_epoch=steps_per_epoch,
                                     seed=seed, **padding)
        else:
            sampler = UserSampler(users, examples_per_user, batch_size,
                                  steps_per_epoch=steps_per_epoch, seed=seed, **padding)

        def to_element(batch, mask):
            expected = tf.constant(float(batch_size))
            return batch, {"mask": mask, "expected_batch_size": expected}

        # Step t's draw is keyed by t: the run's steps continue the ledger's.
        first_step = model.privacy.steps
        if strategy.num_replicas_in_sync > 1:
            dataset = distribute.distribute_poisson_batches(
                strategy, sampler, arrays, to_element, first_step=first_step
            )
        else:
            dataset = make_dataset(sampler, arrays, first_step=first_step, repeat=True)
            dataset = dataset.map(to_element)
        relation = "add_or_remove" if users is None else "add_or_remove_user"
        model.privacy.begin_steps(self.step_event(batch_size / num_examples), relation=relation)
        return dataset, sampler.steps_per_epoch

    # -- serialization --------------------------------------------------------

    def get_config(self):
        """The optimizer's settings, without `seed`: whoever knows the seed
        can regenerate the noise, so it never enters a saved model."""
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "weight_decay": self.weight_decay,
            "weight_decay_placement": self.weight_decay_placement,
            **({} if self.noise_target is None else self.noise_target.get_config()),
            **({} if not self.clips_adaptively else {
                "target_unclipped_quantile": self.target_unclipped_quantile,
                "clip_learning_rate": self.clip_learning_rate,
                "clipped_count_stddev": self.clipped_count_stddev,
                "clip_update": self.clip_update,
            }),
            **({} if self.sparse_embeddings is None else {"sparse_embeddings": {
                name: setting.get_config() for name, setting in self.sparse_embeddings.items()}}),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds the optimizer; a serialized inner optimizer or learning
        rate schedule in `config` is deserialized first."""
        config = dict(config)
        for key in ("inner_optimizer", "learning_rate"):
            if isinstance(config.get(key), dict):
                config[key] = keras.saving.deserialize_keras_object(
                    config[key], custom_objects=custom_objects
                )
        if isinstance(config.get("sparse_embeddings"), dict):
            config["sparse_embeddings"] = {
                name: setting if isinstance(setting, sparse.SparseNoise)
                else sparse.SparseNoise(**setting)
                for name, setting in config["sparse_embeddings"].items()}
        return cls(**config)
