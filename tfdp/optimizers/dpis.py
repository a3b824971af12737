"""`DPIS`: differentially private SGD with importance sampling (seed 002).

DPIS (Wei et al. 2022) samples each record with probability proportional to
its clipped gradient norm and weights it by the inverse probability, so every
sampled term has the same norm K~ / N~ and the noise can shrink as gradients
do. The math, with the fixes that keep it sound, is docs/mechanisms/dpis.md
and `tfdp.mechanisms.importance_sampling`; this module binds it to Keras:

* `make_training_data` releases N~ once and starts the first epoch of a
  `fit`; an internal callback starts every later one at the end of the
  epoch before it (so that a start the privacy budget does not allow can
  still stop training before another step). Starting an epoch computes all
  N per-example gradient norms with the current weights (one pass),
  releases K~ (and K~* with adaptive clipping), refills the per-record ghat
  table, chooses sigma_G from the target epsilon by projecting the ledger,
  and opens the epoch's step event. Every release is checked against the
  fit's `PrivacyBudget` callbacks BEFORE it is made: one that would exceed a
  budget is not made, and training stops (or, at the start of a `fit`, does
  not start).
* each step, the `ImportanceSampler` draws stage 1 (q_i = b ghat_i / K~) as a
  fixed-shape padded batch; `privatize` runs stage 2 on the current gradients
  (accept with ||g_i clipped|| / ghat_i), weights accepted rows so each term
  has norm K~ / N~, adds N(0, (sigma_G C_e)^2), divides by b, and refreshes
  ghat for every drawn record.

What a saved model keeps: N~, K~, C_e, sigma_G and the epoch count (optimizer
variables) and the ledger. The ghat table is NOT saved: it holds each
record's raw gradient norm, and a saved file is a release (docs/mechanisms/guarantee.md).
Nothing is lost: a resumed `fit` recomputes the whole table in one pass,
either for the epoch begun before the checkpoint (K~ released, no step run
yet: it goes on with the released values, releasing nothing new) or for a
new DPIS epoch.
"""

import json
import math
import warnings

import keras
import numpy as np
import tensorflow as tf

from tfdp.accounting import PrivacyLedger, event_from_dict
from tfdp.accounting import _engine
from tfdp.data.importance import ImportanceSampler, make_importance_dataset
from tfdp.data.sources import require_in_memory
from tfdp.mechanisms import dpsgd
from tfdp.mechanisms import importance_sampling as isp
from tfdp.per_example import compute_per_example_gradients
from tfdp.mechanisms.importance_sampling import _check_real
from tfdp.models.state_writes import checked_per_example_pass
from tfdp.optimizers.dp_optimizer import DPOptimizer, check_float32_scale, check_positive

ACCOUNTANTS = ("rdp", "pld")
# Purposes keying DPIS's host-side random streams (with the run's noise key).
_COUNT_STREAM, _RELEASE_STREAM, _SAMPLING_STREAM = 101, 102, 103
# Records per chunk of the per-epoch norm pass.
NORM_PASS_CHUNK = 1024


class _Run:
    """What one `fit` call binds to the optimizer (never saved or tracked)."""

    def __init__(self, model, arrays, batch_size, steps_per_epoch, sampler, norm_fn, budgets):
        self.model = model
        self.arrays = arrays
        self.num_examples = len(tf.nest.flatten(arrays)[0])
        self.batch_size = batch_size
        self.steps_per_epoch = steps_per_epoch
        self.sampler = sampler
        self.norm_fn = norm_fn
        self.budgets = [b for b in budgets if b.epsilon is not None]


class _OverBudget(ValueError):
    """A DPIS release (or the next epoch's first step) would exceed a budget."""


class _Untracked:
    """Host-side state kept out of Keras/TF tracking, so it is never saved:
    the ghat table variable, the per-epoch history, the step's logs."""

    def __init__(self):
        self.ghat = None
        self.history = []
        self.step_logs = None


class _EpochStarter(keras.callbacks.Callback):
    """Logs each DPIS epoch's released values, stops after the planned
    epochs, and starts the next epoch of a `fit` at the end of the one before
    (the first is started by `make_training_data`)."""

    def __init__(self, optimizer):
        super().__init__()
        self._optimizer = optimizer

    def on_epoch_end(self, epoch, logs=None):
        self._optimizer._on_epoch_end(self.model, epoch, self.params or {}, logs)


@keras.saving.register_keras_serializable(package="tfdp")
class DPIS(DPOptimizer):
    """DPIS: DP-SGD with importance sampling and a per-epoch noise schedule.

    Use it with `tfdp.DPModel` / `tfdp.DPSequential`: `fit` then samples each
    batch in two stages by gradient norm (an expected `batch_size` records are
    accepted per step, about `k * batch_size` gradients computed), and the
    noise multiplier sigma_G of each epoch is the smallest that keeps the
    projected epsilon of all `epochs` within `target_epsilon` (docs/mechanisms/dpis.md;
    Wei et al. 2022, Algorithm 1). Each Keras epoch is one DPIS
    epoch; training stops after `epochs` of them. Everything DPIS releases is
    in `model.privacy`: N~ once, K~ (and K~*) per epoch, and every step.

    Args:
        learning_rate: float or schedule for the inner SGD (default 0.01).
        momentum: float >= 0 for the inner SGD (default 0).
        nesterov: bool for the inner SGD (default False).
        l2_norm_clip: C_1 > 0, the clip bound of the first epoch (fixed unless
            `adaptive_clipping`).
        target_epsilon: the run's total epsilon (required).
        target_delta: its delta (default 1e-5).
        epochs: E, the number of epochs the budget is planned for (required).
        sigma_n: standard deviation of the noise on the released dataset
            size N~ (required, a constant > 0). The paper uses 0.02 N, which
            reads the private N: pass 0.02 times a public estimate of N
            (e.g. 1200 for 60,000 records).
        sigma_k: noise multiplier of the K~ release on the unscaled sum of
            sampled clipped norms (sensitivity C). Default None:
            max(0.02 * b, 5). 0.02 * b is the paper's noise (0.02 N C on
            K' = sum / p_K, p_K = b / N~); the floor 5 keeps small batches
            from spending much of the budget on K~ (b = 64 on digits, 30
            epochs: the paper's 1.28 alone costs epsilon 1.4, 5 costs 0.19).
        k: the probability multiplier k > 1 (default 5, the paper's; 3 on
            IMDb): stage 1 draws about k * b records per step.
        epoch_divider: a_E in [0, 1] (default 0.8; the paper uses 1 on
            Fashion-MNIST): the first a_E * E epochs plan future epochs with
            the worst case K~ = N~ C, later ones with the current K~.
        gradient_floor: g_L as a fraction of the clip bound (default 0.01):
            ghat_i >= k * g_L, so records with tiny gradients keep a chance.
        adaptive_clipping: bool (default False; section 3.5). From the second
            epoch, releases K~* (norms clipped at `external_clip`) and sets
            C_e = clip_quantile * K~* / N~.
        external_clip: C* (default 4 * l2_norm_clip).
        clip_quantile: lambda > 0 (default 1).
        accountant: "rdp" (default) or "pld": the accountant under which
            the target is met (read epsilon with the same one, e.g.
            `PrivacyBudget(..., accountant="pld")`; RDP reads higher).
        inner_optimizer: optional Keras optimizer replacing SGD (e.g. Adam;
            then leave learning_rate, momentum and nesterov unset).
        log_sampling_stats: bool (default False). True logs the realised
            batch size and the stage-1/stage-2 acceptance rates every step:
            they are computed from the private batch without noise, so they
            RELEASE PRIVATE VALUES that epsilon does not cover (to History,
            TensorBoard, CSV logs, ...). For debugging on data you may
            expose only. By default the logs hold released values only
            (sigma_g, k_tilde, clip_norm).
        weight_decay, weight_decay_placement, seed, name: see `DPOptimizer`.

    Logs (per step): "sigma_g", "k_tilde", "clip_norm" and, with
    `log_sampling_stats`, "batch_size" (accepted records), "stage1_rate"
    (drawn / N) and "stage2_rate" (accepted / drawn). `epoch_history` keeps
    one dict per epoch (sigma_g, k_tilde, clip_norm, projected epsilon, ...).

    Example:

    >>> import tfdp
    >>> opt = tfdp.optimizers.DPIS(learning_rate=4.0, l2_norm_clip=0.1,
    ...                            target_epsilon=3.0, epochs=40, sigma_n=1200.0)
    >>> opt.k, opt.epoch_divider
    (5.0, 0.8)
    """

    # DPIS's own settings (assigned in __init__), not DPOptimizer's read-only
    # target_epsilon and target_delta properties of its NoiseTarget.
    target_epsilon = None
    target_delta = None

    # noise_multiplier is left out: it is sigma_G, chosen every epoch (its
    # property refuses assignment with its own message).
    _fixed_settings = tuple(n for n in DPOptimizer._fixed_settings if n != "noise_multiplier") + (
        "target_epsilon", "target_delta", "epochs", "sigma_n", "sigma_k", "k",
        "epoch_divider", "gradient_floor", "adaptive_clipping", "external_clip",
        "clip_quantile", "accountant", "log_sampling_stats",
    )

    adaptive_clipping_unsupported = (
        "its importance weights and per-record clip bounds are its own clipping."
    )
    user_level_unsupported = (
        "its importance sampling draws records by their own gradient bounds and its "
        "analysis is per record, not per person."
    )
    physical_batches_unsupported = (
        "its second-stage acceptance and the refresh of each drawn record's "
        "gradient bound run over the whole drawn batch at once, which it does "
        "not split into chunks."
    )

    def __init__(
        self,
        learning_rate=None,
        momentum=None,
        nesterov=None,
        l2_norm_clip=1.0,
        target_epsilon=None,
        target_delta=1e-5,
        epochs=None,
        sigma_n=None,
        sigma_k=None,
        k=5.0,
        epoch_divider=0.8,
        gradient_floor=0.01,
        adaptive_clipping=False,
        external_clip=None,
        clip_quantile=1.0,
        accountant="rdp",
        inner_optimizer=None,
        log_sampling_stats=False,
        weight_decay=0.0,
        weight_decay_placement="before_clip",
        seed=None,
        name=None,
        **kwargs,
    ):
        if inner_optimizer is None:
            inner_optimizer = keras.optimizers.SGD(
                learning_rate=0.01 if learning_rate is None else learning_rate,
                momentum=0.0 if momentum is None else momentum,
                nesterov=bool(nesterov),
            )
        elif any(v is not None for v in (learning_rate, momentum, nesterov)):
            raise ValueError(
                "Set the learning rate and momentum on `inner_optimizer`, not on DPIS. "
                f"Received: learning_rate={learning_rate!r}, momentum={momentum!r}, "
                f"nesterov={nesterov!r} together with inner_optimizer="
                f"{type(inner_optimizer).__name__}"
            )
        # Checked before DPOptimizer's check, whose message would show its
        # placeholder noise_multiplier=1 (DPIS has no such argument).
        clip = check_positive("l2_norm_clip", l2_norm_clip)
        check_float32_scale("l2_norm_clip", clip, f"l2_norm_clip={clip:g}")
        # DPIS allocates sigma_G per epoch; the base class's fixed noise
        # multiplier is unused (1.0 only passes its check).
        super().__init__(
            inner_optimizer,
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=1.0,
            weight_decay=weight_decay,
            weight_decay_placement=weight_decay_placement,
            seed=seed,
            name=name,
            **kwargs,
        )
        if target_epsilon is None:
            raise ValueError(
                "DPIS chooses its noise every epoch from the run's privacy budget: pass "
                "target_epsilon. Received: target_epsilon=None"
            )
        self.target_epsilon = _check_real("target_epsilon", target_epsilon, low=0.0)
        self.target_delta = _check_real(
            "target_delta", target_delta, low=0.0, high=1.0, high_inclusive=False
        )
        if epochs is None or isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 1:
            raise ValueError(
                "DPIS plans its budget over a number of epochs: pass epochs as an int >= 1. "
                f"Received: epochs={epochs!r}"
            )
        self.epochs = int(epochs)
        if sigma_n is None:
            raise ValueError(
                "DPIS releases a noisy dataset size N~ = N + N(0, sigma_n^2); sigma_n must "
                "be a constant you choose (the paper's 0.02 * N reads the private N): pass "
                "0.02 times a public estimate of N, e.g. sigma_n=1200.0 for 60,000 "
                "records. Received: sigma_n=None"
            )
        self.sigma_n = _check_real("sigma_n", sigma_n, low=0.0)
        self.sigma_k = None if sigma_k is None else _check_real("sigma_k", sigma_k, low=0.0)
        self.k = _check_real("k", k, low=1.0)
        self.epoch_divider = _check_real(
            "epoch_divider", epoch_divider, low=0.0, low_inclusive=True, high=1.0
        )
        self.gradient_floor = _check_real("gradient_floor", gradient_floor, low=0.0, high=1.0)
        self.adaptive_clipping = bool(adaptive_clipping)
        self.external_clip = (
            None if external_clip is None else check_positive("external_clip", external_clip)
        )
        self.clip_quantile = check_positive("clip_quantile", clip_quantile)
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"Expected `accountant` in {ACCOUNTANTS}. Received: accountant={accountant!r}")
        if accountant == "pld" and self.target_delta < _engine.PLD_MIN_DELTA:
            raise ValueError(
                f"DPIS cannot plan target_delta={self.target_delta:g} with accountant='pld': "
                f"the PLD accountant cannot resolve delta below {_engine.PLD_MIN_DELTA:g} (its "
                "epsilon would be too small); use accountant='rdp' for such a delta. Received: "
                f"target_delta={self.target_delta:g}"
            )
        self.accountant = accountant
        self.log_sampling_stats = bool(log_sampling_stats)
        self._check_float32_settings()
        self._state = _Untracked()
        self._run = None
        self._epoch_starter = _EpochStarter(self)
        self._dpis_ready = True

    def _check_float32_settings(self):
        """Refuses settings whose values overflow float32 in DPIS's steps, with
        DPOptimizer's bound on the clip norm (NaN and inf are refused above)."""
        check_float32_scale(
            "sigma_n", self.sigma_n, f"sigma_n={self.sigma_n:g}",
            why="the released N~ = N + N(0, sigma_n^2) is float32 in every step",
        )
        if self.adaptive_clipping:
            external = self.external_clip or 4.0 * self.l2_norm_clip
            check_float32_scale(
                "clip_quantile * " + ("external_clip" if self.external_clip else "4 * l2_norm_clip"),
                self.clip_quantile * external,
                f"clip_quantile={self.clip_quantile:g}, external_clip={self.external_clip!r}, "
                f"l2_norm_clip={self.l2_norm_clip:g}",
                why="adaptive clipping's clip bound C_e can reach it, and C_e is float32 in every step",
            )

    # -- sigma_G replaces the fixed noise multiplier -------------------------

    @property
    def noise_multiplier(self):
        """The current epoch's sigma_G (None before the first epoch)."""
        variable = getattr(self, "_sigma_g", None)
        if variable is None:
            return None
        value = float(variable.numpy())
        return value if value > 0 else None

    @noise_multiplier.setter
    def noise_multiplier(self, value):
        if getattr(self, "_dpis_ready", False):
            raise AttributeError(
                "DPIS chooses its noise multiplier sigma_G every epoch from "
                "target_epsilon, so `noise_multiplier` cannot be set. Received: "
                f"noise_multiplier={value!r}"
            )

    @property
    def sigma_g(self):
        """The current epoch's noise multiplier sigma_G (None before training)."""
        return self.noise_multiplier

    # -- state ---------------------------------------------------------------

    def build(self, var_list):
        super().build(var_list)
        if getattr(self, "_sigma_g", None) is not None:
            return

        def scalar(name, dtype="float64"):
            return self.add_variable((), initializer="zeros", dtype=dtype, name=name)

        # Released values (post-processing of noisy releases): safe to save.
        self._n_tilde = scalar("dpis_n_tilde")
        self._k_tilde = scalar("dpis_k_tilde")
        self._clip = scalar("dpis_clip_norm")
        self._sigma_g = scalar("dpis_sigma_g")
        self._epochs_begun = scalar("dpis_epochs_begun", "int64")

    def _check_built(self):
        if getattr(self, "_sigma_g", None) is None:
            raise ValueError("DPIS is not built: compile a tfdp.DPModel with it and call fit().")

    @property
    def epochs_begun(self):
        """How many DPIS epochs have started (each released a K~)."""
        self._check_built()
        return int(self._epochs_begun.numpy())

    @property
    def n_tilde(self):
        """The released noisy dataset size N~ (None before it is released)."""
        self._check_built()
        value = float(self._n_tilde.numpy())
        return value if value != 0.0 else None

    @property
    def k_tilde(self):
        """The current epoch's released K~ (None before the first epoch)."""
        self._check_built()
        value = float(self._k_tilde.numpy())
        return value if value > 0 else None

    @property
    def clip_norm(self):
        """The current epoch's clip bound C_e (None before the first epoch)."""
        self._check_built()
        value = float(self._clip.numpy())
        return value if value > 0 else None

    @property
    def epoch_history(self):
        """One dict per DPIS epoch of this session: sigma_g, k_tilde,
        clip_norm, n_tilde, projected_epsilon, ... (not saved)."""
        return self._state.history

    @property
    def ghat_table(self):
        """A copy of the per-record ghat table (None before training).

        Private: it holds each record's raw gradient norm. Never saved.
        """
        table = self._state.ghat
        return None if table is None else table.numpy().copy()

    def record_state(self):
        """The variables DPIS writes from records' values without noise, by
        design and never saved: the ghat table. A write the step makes to a
        saved variable may not read them (`tfdp.models.released_writes`)."""
        table = self._state.ghat
        return [] if table is None else [table]

    # -- random streams --------------------------------------------------------

    def _stream(self, purpose, counter, steps_taken):
        """A NumPy generator keyed by the run's secret key, a purpose, a counter
        (the epoch index), the ledger's step count and this fit's nonce.

        The key is never saved (OS entropy unless seeded); the counter and the
        step count only grow across save/load and a new optimizer on a
        resumed model, but go back with the weights (`load_weights(earlier)`):
        the nonce, fresh each `fit` of an unseeded run, keeps a rolled-back
        branch from drawing the noise of the discarded one again.
        """
        words = [int(w) for w in np.asarray(self._noise_key, np.int64).view(np.uint64)]
        nonce = self.fit_nonce_words().view(np.uint64).tolist()
        sequence = np.random.SeedSequence(
            words, spawn_key=(purpose, int(counter), int(steps_taken), *nonce)
        )
        return np.random.default_rng(sequence)

    # -- fit -----------------------------------------------------------------

    def training_callbacks(self):
        return [self._epoch_starter]

    def agree_with_workers(self, model, num_examples, batch_size, steps_per_epoch=None):
        """Refuses several replicas (before `fit` builds anything); None on one."""
        strategy = model.distribute_strategy
        if strategy.num_replicas_in_sync > 1:
            raise ValueError(
                "DPIS samples and refreshes its per-record table on one replica; it does "
                "not support tf.distribute strategies with several replicas. Received: "
                f"{strategy.num_replicas_in_sync} replicas"
            )

    def make_training_data(self, model, arrays, batch_size, steps_per_epoch=None, budgets=()):
        """DPIS batches for `DPModel.fit`, after starting a DPIS epoch.

        Releases N~ (first time only), starts an epoch (norm pass, K~
        release, sigma_G allocation, step event) and returns `(dataset,
        steps_per_epoch)` whose elements carry the stage-1 draw in step_info.
        An epoch begun before a checkpoint with no step run in it (the open
        step event is its) goes on instead: a norm pass, no release.

        Raises ValueError, before the release, if a release would exceed one
        of `budgets` (the fit's `PrivacyBudget` callbacks), or if after them
        no step fits in a budget.
        """
        self._check_built()
        self.agree_with_workers(model, None, batch_size)
        resumable = self._begun_epoch_without_steps(model, batch_size)
        if self.epochs_begun >= self.epochs and not resumable:
            raise ValueError(
                f"DPIS(epochs={self.epochs}) has started all its planned epochs, so its "
                f"budget target_epsilon={self.target_epsilon} is planned out. Compile a new "
                "DPIS with the epochs and budget you want to add (the ledger keeps "
                f"counting). Received: epochs_begun={self.epochs_begun}"
            )
        require_in_memory(arrays, "DPIS", "computes every record's gradient norm each epoch")
        num_examples = len(tf.nest.flatten(arrays)[0])
        self.bind_model_steps(model)
        if self._state.ghat is None:
            self._state.ghat = tf.Variable(
                tf.zeros([num_examples], tf.float32),
                shape=tf.TensorShape([None]),
                trainable=False,
                name="dpis_ghat_table",
            )
        else:
            self._state.ghat.assign(tf.zeros([num_examples], tf.float32))
        sampler = ImportanceSampler(
            num_examples,
            batch_size,
            steps_per_epoch=steps_per_epoch,
            seed=np.concatenate([np.asarray(self._noise_key, np.int64),
                                 [_SAMPLING_STREAM, model.privacy.steps], self.fit_nonce_words()]),
            ghat_table=self._state.ghat,  # read in the graph at every draw
        )
        self._run = _Run(
            model, arrays, batch_size, sampler.steps_per_epoch, sampler,
            self._make_norm_fn(model), budgets,
        )
        if resumable:
            self._resume_epoch()
        else:
            self._begin_epoch()
        dataset = make_importance_dataset(sampler, arrays)
        return dataset, sampler.steps_per_epoch

    def _on_epoch_end(self, model, epoch, params, logs):
        if logs is not None and self.epoch_history:
            last = self.epoch_history[-1]
            logs.update(sigma_g=last["sigma_g"], k_tilde=last["k_tilde"], clip_norm=last["clip_norm"])
        planned = params.get("epochs")
        more = planned is None or epoch + 1 < planned
        if self.epochs_begun < self.epochs and more and not model.stop_training:
            try:
                self._begin_epoch()
            except _OverBudget as error:
                warnings.warn(f"Stopping DPIS training: {error}", stacklevel=2)
                model.stop_training = True
            return
        if self.epochs_begun >= self.epochs:
            planned = params.get("epochs")
            if planned is not None and epoch + 1 < planned and not model.stop_training:
                warnings.warn(
                    f"DPIS(epochs={self.epochs}) ran all its planned epochs, which spend "
                    f"its budget target_epsilon={self.target_epsilon}; stopping before "
                    f"the {planned} epochs fit() asked for.",
                    stacklevel=2,
                )
            model.stop_training = True

    # -- the per-epoch releases ---------------------------------------------

    def _make_norm_fn(self, model):
        loss_fn = model._per_example_loss  # pylint: disable=protected-access
        method = model.per_example_gradients

        # The pass runs the layers' training call on every record, before the
        # step is traced: checked as the step's own pass is (a layer that
        # writes a variable here is refused before the pass runs).
        @tf.function(reduce_retracing=True, autograph=False)
        def sq_norms(x, y, weights):
            with checked_per_example_pass(model):
                per_example, _, _ = compute_per_example_gradients(
                    model, x, y, weights, loss_fn, method, training=True
                )
            return self._decayed(per_example).sq_norms()

        return sq_norms

    def _all_norms(self):
        """Per-example gradient norms of all N records with the current weights.

        NaN where a gradient is not finite. One pass in chunks of
        `NORM_PASS_CHUNK` records (the last one padded with weight 0).
        """
        run = self._run
        arrays = run.arrays
        count = run.num_examples
        chunk = min(count, NORM_PASS_CHUNK)
        sample_weight = arrays[2] if len(arrays) > 2 else None
        if tf.nest.is_nested(sample_weight):
            raise ValueError(
                "DPIS's pass over all records takes one sample weight per example (shape "
                "[N]); give one for every output, or train with DPSGD. Received: "
                f"sample_weight as a {type(sample_weight).__name__} (one per output)")
        out = np.empty(count, np.float64)
        for start in range(0, count, chunk):
            stop = min(start + chunk, count)
            real = stop - start

            def take(a):
                part = np.asarray(a[start:stop])
                if real < chunk:
                    pad = np.zeros((chunk - real,) + part.shape[1:], part.dtype)
                    part = np.concatenate([part, pad])
                return part

            x = tf.nest.map_structure(take, arrays[0])
            y = tf.nest.map_structure(take, arrays[1])  # one array per output of several
            weights = np.zeros(chunk, np.float32)
            weights[:real] = 1.0 if sample_weight is None else np.reshape(sample_weight[start:stop], -1)
            sq = run.norm_fn(x, y, tf.constant(weights)).numpy()[:real].astype(np.float64)
            out[start:stop] = np.where(np.isfinite(sq), np.sqrt(np.maximum(sq, 0.0)), np.nan)
        return out

    def _begin_epoch(self):
        run = self._run
        ledger = run.model.privacy
        epoch = self.epochs_begun
        if epoch >= self.epochs:
            raise ValueError(
                f"DPIS(epochs={self.epochs}) has started all its planned epochs; its "
                f"budget target_epsilon={self.target_epsilon} is planned out. Received: "
                f"epoch {epoch + 1}"
            )
        b = float(run.batch_size)
        clip = self.clip_norm or self.l2_norm_clip
        n_tilde = self.n_tilde
        if n_tilde is None:
            self._check_budgets(ledger, [isp.count_event(self.sigma_n)], "the noisy dataset size N~")
            rng = self._stream(_COUNT_STREAM, 0, ledger.steps)
            n_tilde = isp.noisy_count(run.num_examples, self.sigma_n, rng)
            if n_tilde == 0.0:  # the variable's 0 means "not released yet"
                n_tilde = math.ulp(0.0)
            ledger.record(isp.count_event(self.sigma_n))
            self._n_tilde.assign(n_tilde)
        isp.clamp_norm_sum(0.0, b, clip, n_tilde)  # raises now if b is too large for N~
        sigma_k = self.sigma_k if self.sigma_k is not None else max(0.02 * b, 5.0)
        p_k = isp.norm_sum_sampling_probability(b, n_tilde)
        release = isp.norm_sum_event(sigma_k, p_k)
        releases = 2 if self.adaptive_clipping and epoch > 0 else 1
        self._check_budgets(ledger, [release] * releases, f"epoch {epoch + 1}'s K~")
        rng = self._stream(_RELEASE_STREAM, epoch, ledger.steps)
        # Counted before the first release: a retry after a failure below uses
        # a fresh stream, never the same noise for a second release.
        self._epochs_begun.assign(epoch + 1)
        norms = self._all_norms()
        finite = np.isfinite(norms)
        epoch_events = [release]
        if self.adaptive_clipping:
            external = self.external_clip or 4.0 * self.l2_norm_clip
            epoch_events.append(release)
            if epoch > 0:
                k_star = isp.noisy_norm_sum(
                    np.where(finite, np.minimum(norms, external), 0.0), external, sigma_k, p_k, rng
                )
                ledger.record(release)
                clip = isp.adaptive_clip(
                    max(k_star, 0.0), n_tilde, self.clip_quantile, external,
                    minimum=1e-3 * self.l2_norm_clip,
                )
        clipped = np.where(finite, np.minimum(norms, clip), 0.0)
        k_prime = isp.noisy_norm_sum(clipped, clip, sigma_k, p_k, rng)
        ledger.record(release)
        k_tilde = isp.clamp_norm_sum(k_prime, b, clip, n_tilde)
        worst = isp.uses_worst_case(epoch, self.epochs, self.epoch_divider)
        previous = self.noise_multiplier
        sigma_g, projected = isp.allocate_noise_multiplier(
            ledger,
            self.target_epsilon,
            self.target_delta,
            batch_size=b,
            clip=clip,
            n_tilde=n_tilde,
            k_tilde=k_tilde,
            steps_per_epoch=run.steps_per_epoch,
            epochs_left=self.epochs - epoch,
            future_k_tilde=n_tilde * clip if worst else k_tilde,
            epoch_events=epoch_events,
            accountant=self.accountant,
            max_noise_multiplier=previous,
        )
        self._sigma_g.assign(sigma_g)
        self._k_tilde.assign(k_tilde)
        self._clip.assign(clip)
        ledger.begin_steps(isp.step_event(sigma_g, clip, k_tilde, n_tilde, b))
        self._start_sampling(epoch, norms, clip, k_tilde, n_tilde)
        self._state.history.append(
            {
                "epoch": epoch,
                "sigma_g": sigma_g,
                "k_tilde": k_tilde,
                "clip_norm": clip,
                "n_tilde": n_tilde,
                "worst_case_future": worst,
                "projected_epsilon": projected,
                "padded_size": run.sampler.padded_size,
            }
        )
        self._check_room(epoch, sigma_g)

    def _start_sampling(self, epoch, norms, clip, k_tilde, n_tilde):
        """Fills the ghat table from the epoch's `norms` and starts the
        sampler's epoch with the released K~ and N~."""
        run = self._run
        b = float(run.batch_size)
        clipped = np.where(np.isfinite(norms), np.minimum(norms, clip), np.nan)
        self._state.ghat.assign(
            isp.first_stage_bounds(clipped, self.k, self.gradient_floor * clip, k_tilde, b)
        )
        run.sampler.start_epoch(
            k_tilde,
            epoch_index=epoch,
            # The padded length is observable: sized from released values only.
            expected_size=isp.released_first_stage_size(
                self.k, self.gradient_floor * clip, k_tilde, n_tilde, b
            ),
            population=n_tilde,
        )

    def _begun_epoch_without_steps(self, model, batch_size):
        """Whether the ledger's open step event is this optimizer's current
        epoch's, with no step run in it: an epoch begun (its K~ released)
        right before a checkpoint, which a resumed `fit` goes on with."""
        if self.k_tilde is None:
            return False
        ledger = model.privacy
        opened = json.loads(ledger.to_json())["open"]
        if opened is None or opened["start"] != ledger.steps:
            return False
        current = isp.step_event(
            self.noise_multiplier, self.clip_norm, self.k_tilde, self.n_tilde, float(batch_size)
        )
        return event_from_dict(opened["event"]) == current

    def _resume_epoch(self):
        """Goes on with the begun epoch (see `_begun_epoch_without_steps`):
        recomputes its ghat table with the current weights, as beginning it
        did, and releases nothing."""
        epoch = self.epochs_begun - 1
        clip, k_tilde, n_tilde = self.clip_norm, self.k_tilde, self.n_tilde
        self._start_sampling(epoch, self._all_norms(), clip, k_tilde, n_tilde)
        self._state.history.append(
            {
                "epoch": epoch,
                "sigma_g": self.noise_multiplier,
                "k_tilde": k_tilde,
                "clip_norm": clip,
                "n_tilde": n_tilde,
                "resumed": True,
                "padded_size": self._run.sampler.padded_size,
            }
        )
        self._check_room(epoch, self.noise_multiplier)

    def _check_room(self, epoch, sigma_g):
        """Raises `_OverBudget` unless one more step fits in every budget."""
        ledger = self._run.model.privacy
        for budget in self._run.budgets:
            if ledger.steps_within_budget(
                budget.epsilon, budget.delta, accountant=budget.accountant, max_steps=1
            ) == 0:
                raise _OverBudget(
                    f"after epoch {epoch + 1}'s releases no step of sigma_G={sigma_g:.4g} "
                    f"fits in the privacy budget epsilon={budget.epsilon} "
                    f"(delta={budget.delta}). Received: "
                    f"epsilon={ledger.epsilon(budget.delta, accountant=budget.accountant):.4g} spent"
                )

    def _check_budgets(self, ledger, events, what):
        """Raises `_OverBudget` unless recording `events` keeps every budget."""
        for budget in self._run.budgets:
            if budget.accountant == "pld":  # else its refusal reads as epsilon inf below
                _engine.check_pld_delta(budget.delta)
            projected = PrivacyLedger.from_json(ledger.to_json())
            for event in events:
                projected.record(event)
            try:
                spent = projected.epsilon(budget.delta, accountant=budget.accountant)
            except ValueError:  # beyond what the accountant can represent
                spent = math.inf
            if spent > budget.epsilon:
                raise _OverBudget(
                    f"releasing {what} would exceed the privacy budget "
                    f"epsilon={budget.epsilon} (delta={budget.delta}), so it was not "
                    f"released and training does not go on. Received: epsilon={spent:.4g} "
                    "after that release"
                )

    # -- the private step ------------------------------------------------------

    def _decayed(self, per_example):
        if self.weight_decay and self.weight_decay_placement == "before_clip":
            return per_example.with_offsets(self._decay_offsets(per_example.variables))
        return per_example

    def noise_stddev(self):
        """sigma_G * C_e: the noise's standard deviation on the weighted sum."""
        return tf.cast(self._sigma_g, tf.float32) * tf.cast(self._clip, tf.float32)

    def step_event(self, sampling_probability=None):
        """The current epoch's per-step event (docs/mechanisms/dpis.md; the argument is unused)."""
        run = self._run
        if run is None or self.k_tilde is None:
            raise ValueError("DPIS has no epoch yet: its step event is set when fit() starts an epoch.")
        return isp.step_event(
            self.noise_multiplier, self.clip_norm, self.k_tilde, self.n_tilde, run.batch_size
        )

    def privatize(self, per_example, step_info):
        """Stage 2, importance weights, noise; refreshes ghat of the drawn records.

        Args:
            per_example: `PerExampleGradients` of the stage-1 rows.
            step_info: dict with "mask", "expected_batch_size", "indices",
                "ghat", "uniform", "num_examples" (see `make_importance_dataset`).

        Returns:
            (noisy gradient estimate, dict of per-step tensors).
        """
        variables = per_example.variables
        per_example = self._decayed(per_example)
        sq_norms = per_example.sq_norms()
        mask = tf.cast(step_info["mask"], tf.float32)
        clip = tf.cast(self._clip, tf.float32)
        k_tilde = tf.cast(self._k_tilde, tf.float32)
        n_tilde = tf.cast(self._n_tilde, tf.float32)
        batch_size = tf.cast(step_info["expected_batch_size"], tf.float32)
        stage = isp.second_stage(sq_norms, step_info["ghat"], clip, step_info["uniform"], mask)
        weights = isp.importance_weights(stage["norms"], stage["accepted"], k_tilde, n_tilde)
        sums = per_example.weighted_sum(weights)
        grads = dpsgd.noisy_mean(sums, self.noise_stddev(), batch_size, self.noise_seed())
        if self.weight_decay and self.weight_decay_placement == "after_noise":
            grads = [g + o for g, o in zip(grads, self._decay_offsets(variables))]
        # ghat_{t+1} = min(k max(||g clipped||, g_L), K~ / b) for every drawn record.
        refreshed = isp.first_stage_bounds(
            tf.where(stage["finite"], stage["clipped_norms"], float("nan")),
            self.k,
            self.gradient_floor * clip,
            k_tilde,
            batch_size,
        )
        drawn = mask > 0.0
        self._state.ghat.scatter_nd_update(
            tf.boolean_mask(step_info["indices"], drawn)[:, None],
            tf.boolean_mask(refreshed, drawn),
        )
        drawn_count = tf.reduce_sum(mask)
        accepted_count = tf.reduce_sum(tf.cast(stage["accepted"], tf.float32))
        nonfinite = tf.reduce_sum(tf.cast(~stage["finite"], tf.float32) * mask)
        logs = {
            "sigma_g": tf.cast(self._sigma_g, tf.float32),
            "k_tilde": k_tilde,
            "clip_norm": clip,
        }
        if self.log_sampling_stats:
            logs["batch_size"] = accepted_count
            logs["stage1_rate"] = drawn_count / tf.cast(step_info["num_examples"], tf.float32)
            logs["stage2_rate"] = tf.math.divide_no_nan(accepted_count, drawn_count)
        self._state.step_logs = logs
        return grads, {"nonfinite_examples": nonfinite, **logs}

    def apply_private_gradients(self, grads, trainable_variables, model=None):
        """Applies the noisy estimate; returns the step's DPIS logs."""
        self.inner_optimizer.apply(grads, trainable_variables)
        logs, self._state.step_logs = self._state.step_logs or {}, None
        return logs

    # -- serialization ---------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        config.pop("noise_multiplier", None)
        config.update(
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            epochs=self.epochs,
            sigma_n=self.sigma_n,
            sigma_k=self.sigma_k,
            k=self.k,
            epoch_divider=self.epoch_divider,
            gradient_floor=self.gradient_floor,
            adaptive_clipping=self.adaptive_clipping,
            external_clip=self.external_clip,
            clip_quantile=self.clip_quantile,
            accountant=self.accountant,
            log_sampling_stats=self.log_sampling_stats,
        )
        return config
