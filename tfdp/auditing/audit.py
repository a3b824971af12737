"""Privacy auditing: run a mechanism on neighbouring datasets, attack, bound epsilon.

An audit trains on D and on D' = D plus one canary record many times, scores
every output with an attack (higher score: "the canary was in"), picks the
attack's threshold on one half of the trials and, on the other half, turns
its false-positive and false-negative counts into a lower bound on epsilon
that holds with the stated confidence (`tfdp.auditing.bounds`). A correct
mechanism's lower bound stays below the epsilon it claims; a bound above the
claim proves a bug (or a wrong claim), up to the 1 - confidence chance that
the trials were unlucky.

Two runners:

* `audit_training`: black-box, any training function. Each trial is a whole
  training run, scored by e.g. the canary's loss (`loss_score`). Slow (one
  trial per run) but makes no assumption about the training code.
* `audit_optimizer`: white-box and sample-efficient, for a tfdp optimizer. A
  linear model `Dense(1, use_bias=False)` with the loss -y * prediction has
  per-example gradient -y x whatever the weights, so every step of the real
  `DPModel.fit` path is an independent trial of the one-step mechanism.
  Ordinary records are x = 0 (gradient 0); canary j is x = scale * e_j (its
  gradient, clipped, is C e_j in size), so with k orthogonal canaries one step
  gives k trials. The score of canary j at step t is the j-th coordinate of
  the weight update, read after every step; D runs without the canaries. The
  bound is compared with the epsilon of ONE step, as the ledger accounts it.

Example:

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> out, inn = rng.normal(0.0, 1.0, 20000), rng.normal(1.0, 1.0, 20000)
>>> result = epsilon_from_scores(out, inn, delta=1e-5)
>>> 0.5 < result.epsilon_lower_bound < 4.4   # N(0,1) vs N(1,1): exact epsilon 4.38
True
"""

import dataclasses
import math

import numpy as np

from tfdp.accounting._validation import check_int, check_real, show
from tfdp.auditing.bounds import _epsilon_bounds, epsilon_lower_bound

_MAX_CANDIDATES = 50000


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """What an audit measured.

    Attributes:
        epsilon_lower_bound: with probability >= `confidence` the audited
            mechanism is not (epsilon', delta)-DP for any smaller epsilon'.
        confidence: the bound's confidence (Clopper-Pearson, both rates).
        delta: the delta audited.
        claimed_epsilon: the epsilon the mechanism reports for what was
            audited (one step for `audit_optimizer`), or None.
        negatives, positives: evaluation trials without / with the canary.
        false_positives, false_negatives: the attack's errors on them.
        threshold: the attack says "in" when score > threshold ("greater")
            or score < threshold ("less"); chosen on the selection trials.
        direction: "greater" or "less".
        epsilon_estimate: the same formula at the observed rates, without
            confidence intervals (informative only; inf if a rate is 0).
        selection_trials: trials (both sides) used to choose the threshold.
        mechanism: a name for reports.
    """

    epsilon_lower_bound: float
    confidence: float
    delta: float
    claimed_epsilon: float | None
    negatives: int
    positives: int
    false_positives: int
    false_negatives: int
    threshold: float
    direction: str
    epsilon_estimate: float
    selection_trials: int
    mechanism: str = ""

    @property
    def violates_claim(self):
        """True if the lower bound is above the claimed epsilon (a bug is caught)."""
        return self.claimed_epsilon is not None and self.epsilon_lower_bound > self.claimed_epsilon

    def to_dict(self):
        """The result as a plain dict (JSON-friendly)."""
        data = dataclasses.asdict(self)
        data["violates_claim"] = self.violates_claim
        return data

    def summary(self):
        """One line for logs and tables."""
        claim = "?" if self.claimed_epsilon is None else f"{self.claimed_epsilon:.3f}"
        return (
            f"{self.mechanism or 'audit'}: epsilon >= {self.epsilon_lower_bound:.3f} "
            f"({self.confidence:.0%} confidence, delta={self.delta:g}) vs claimed {claim}; "
            f"{self.negatives}+{self.positives} evaluation trials, "
            f"FP={self.false_positives}, FN={self.false_negatives}"
        )


# -- from scores to a bound ------------------------------------------------------


def _check_scores(name, scores):
    try:
        values = np.asarray(scores, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise TypeError(f"Expected `{name}` to be an array of numbers. Received: {name}={show(scores)}") from None
    if values.size < 4:
        raise ValueError(f"Expected `{name}` to hold at least 4 scores. Received: {values.size} scores")
    bad = int(np.sum(~np.isfinite(values)))
    if bad:
        raise ValueError(
            f"Expected `{name}` to be finite numbers; {bad} of {values.size} are NaN or inf "
            "(a failed run must not be silently dropped from an audit)."
        )
    return values


def _counts(sorted_out, sorted_in, thresholds, direction):
    """(false positives, false negatives) of the rule at every threshold."""
    if direction == "greater":  # "in" iff score > t
        fp = sorted_out.size - np.searchsorted(sorted_out, thresholds, side="right")
        fn = np.searchsorted(sorted_in, thresholds, side="right")
    else:  # "in" iff score < t
        fp = np.searchsorted(sorted_out, thresholds, side="left")
        fn = sorted_in.size - np.searchsorted(sorted_in, thresholds, side="left")
    return fp, fn


def _sorted_quantiles(values, count):
    """`np.quantile(values, np.linspace(0, 1, count))` for sorted `values`:
    the same numbers (numpy's default linear method, its rounding too), read
    from the sorted array instead of partitioning it again for every one of
    the `count` quantiles (seconds at an audit's 50,000 candidates)."""
    positions = (values.size - 1) * np.linspace(0.0, 1.0, count)
    below = np.floor(positions).astype(np.int64)
    above = np.minimum(below + 1, values.size - 1)
    fraction = positions - below
    low, high = values[below], values[above]
    step = high - low
    return np.where(fraction >= 0.5, high - step * (1.0 - fraction), low + step * fraction)


def _select_threshold(out, inn, delta, confidence):
    """Threshold and direction maximizing the bound on the selection trials."""
    out, inn = np.sort(out), np.sort(inn)
    pooled = np.unique(np.concatenate([out, inn]))
    if pooled.size > _MAX_CANDIDATES:
        pooled = _sorted_quantiles(pooled, _MAX_CANDIDATES)
    middles = (pooled[:-1] + pooled[1:]) / 2.0
    thresholds = np.concatenate([[pooled[0] - 1.0], middles, [pooled[-1] + 1.0]])
    best = (-1.0, 0.0, "greater")
    for direction in ("greater", "less"):
        fp, fn = _counts(out, inn, thresholds, direction)
        bounds = _epsilon_bounds(fp, out.size, fn, inn.size, delta, confidence)
        index = int(np.argmax(bounds))
        if bounds[index] > best[0]:
            best = (float(bounds[index]), float(thresholds[index]), direction)
    return best[1], best[2]


def _point_estimate(fp, negatives, fn, positives, delta):
    fpr, fnr = fp / negatives, fn / positives
    values = [0.0]
    for error, other in ((fpr, fnr), (fnr, fpr)):
        if 1.0 - delta - other > 0:
            values.append(math.inf if error == 0 else math.log((1.0 - delta - other) / error))
    return max(values)


def epsilon_from_scores(
    scores_out,
    scores_in,
    delta,
    confidence=0.95,
    selection_fraction=0.5,
    seed=0,
    claimed_epsilon=None,
    mechanism="",
):
    """Lower bound on epsilon from attack scores on D (out) and D' (in).

    A random `selection_fraction` of each side's trials (seeded) chooses the
    threshold and direction with the largest bound; the bound is computed on
    the remaining trials only (a threshold chosen on the evaluation trials
    would invalidate the confidence interval).

    Args:
        scores_out: scores of outputs trained without the canary.
        scores_in: scores of outputs trained with it (at least 4 each).
        delta: delta of the guarantee audited, in [0, 1).
        confidence: in (0, 1) (default 0.95).
        selection_fraction: in (0, 1) (default 0.5).
        seed: seed of the split.
        claimed_epsilon: optional epsilon to compare with.
        mechanism: optional name for reports.

    Returns:
        `AuditResult`.

    Example:

    >>> r = epsilon_from_scores([0] * 6, [9] * 6, delta=0.0)
    >>> r.epsilon_lower_bound   # perfectly separated, but 3 + 3 trials prove nothing
    0.0
    >>> r = epsilon_from_scores([0] * 2000, [9] * 2000, delta=0.0)
    >>> r.false_positives, r.false_negatives, round(r.epsilon_lower_bound, 2)
    (0, 0, 5.6)
    """
    out = _check_scores("scores_out", scores_out)
    inn = _check_scores("scores_in", scores_in)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=True)
    confidence = check_real("confidence", confidence, low=0.0, high=1.0)
    selection_fraction = check_real("selection_fraction", selection_fraction, low=0.0, high=1.0)
    if claimed_epsilon is not None:
        claimed_epsilon = check_real("claimed_epsilon", claimed_epsilon, low=0.0, low_inclusive=True, allow_inf=True)
    rng = np.random.default_rng(check_int("seed", seed))

    def split(values):
        values = values[rng.permutation(values.size)]
        cut = min(max(1, int(round(values.size * selection_fraction))), values.size - 1)
        return values[:cut], values[cut:]

    select_out, eval_out = split(out)
    select_in, eval_in = split(inn)
    threshold, direction = _select_threshold(select_out, select_in, delta, confidence)
    fp, fn = _counts(np.sort(eval_out), np.sort(eval_in), np.asarray([threshold]), direction)
    fp, fn = int(fp[0]), int(fn[0])
    bound = epsilon_lower_bound(fp, eval_out.size, fn, eval_in.size, delta, confidence)
    return AuditResult(
        epsilon_lower_bound=bound,
        confidence=confidence,
        delta=delta,
        claimed_epsilon=claimed_epsilon,
        negatives=int(eval_out.size),
        positives=int(eval_in.size),
        false_positives=fp,
        false_negatives=fn,
        threshold=threshold,
        direction=direction,
        epsilon_estimate=_point_estimate(fp, eval_out.size, fn, eval_in.size, delta),
        selection_trials=int(select_out.size + select_in.size),
        mechanism=mechanism,
    )


# -- black-box: whole training runs -----------------------------------------------


def loss_score(loss):
    """A black-box attack: minus the trained model's loss on the canary.

    Args:
        loss: a Keras loss (name, instance or function of (y_true, y_pred)).

    Returns:
        `score_fn(model, canary_x, canary_y) -> float` for `audit_training`.

    Example:

    >>> score_fn = loss_score("mse")
    """
    import keras

    loss_fn = keras.losses.get(loss) if isinstance(loss, str) else loss

    def score_fn(model, canary_x, canary_y):
        prediction = model(np.asarray(canary_x)[None], training=False)
        value = loss_fn(np.asarray(canary_y)[None], prediction)
        return -float(np.mean(np.asarray(value)))

    return score_fn


def audit_training(
    train_fn,
    score_fn,
    data,
    canary,
    runs,
    delta,
    confidence=0.95,
    seed=0,
    claimed_epsilon=None,
    mechanism="",
):
    """Black-box audit: `runs` trainings on D and on D plus the canary.

    Args:
        train_fn: `train_fn(x, y, seed) -> model`, one complete training run.
            It must use `seed` for all its randomness (noise included), so
            the audit is reproducible; runs get distinct seeds.
        score_fn: `score_fn(model, canary_x, canary_y) -> float`, higher
            meaning "the canary was in" (e.g. `loss_score(loss)`).
        data: `(x, y)` arrays, the dataset D.
        canary: `(canary_x, canary_y)`, one record (no batch axis).
        runs: trainings per side, an integer >= 4.
        delta, confidence, claimed_epsilon, mechanism: see
            `epsilon_from_scores`.
        seed: base seed; run r on D uses seed + 2r, on D' seed + 2r + 1.

    Returns:
        `AuditResult`.
    """
    if not callable(train_fn) or not callable(score_fn):
        raise TypeError(
            "Expected `train_fn` and `score_fn` to be callables. Received: "
            f"train_fn={show(train_fn)}, score_fn={show(score_fn)}"
        )
    runs = check_int("runs", runs, minimum=4)
    seed = check_int("seed", seed)
    x, y = (np.asarray(a) for a in data)
    canary_x, canary_y = (np.asarray(a) for a in canary)
    if canary_x.shape != x.shape[1:]:
        raise ValueError(
            f"Expected the canary's input to have shape {x.shape[1:]} (one record of x). "
            f"Received: canary_x of shape {canary_x.shape}"
        )
    x_in = np.concatenate([x, canary_x[None].astype(x.dtype)])
    y_in = np.concatenate([y, np.asarray(canary_y, dtype=y.dtype).reshape((1,) + y.shape[1:])])
    scores_out, scores_in = [], []
    for run in range(runs):
        scores_out.append(float(score_fn(train_fn(x, y, seed + 2 * run), canary_x, canary_y)))
        scores_in.append(float(score_fn(train_fn(x_in, y_in, seed + 2 * run + 1), canary_x, canary_y)))
    return epsilon_from_scores(
        scores_out, scores_in, delta, confidence=confidence, seed=seed,
        claimed_epsilon=claimed_epsilon, mechanism=mechanism,
    )


# -- white-box: every step of a tfdp optimizer ---------------------------------------


def one_step_epsilon(ledger, delta, accountant="rdp"):
    """The largest epsilon of one training step in a ledger.

    Every step event of the ledger's segments is accounted alone (one-off
    records, such as DPIS's noisy dataset size, are not steps and are left
    out). This is what a per-step audit compares its bound with.

    Args:
        ledger: a `tfdp.accounting.PrivacyLedger` (e.g. `model.privacy`).
        delta: in (0, 1).
        accountant: "rdp" or "pld".

    Returns:
        A float (0.0 if no step ran).
    """
    import json

    from tfdp.accounting import PrivacyLedger, event_from_dict

    # The saved form lists the step segments apart from the one-off records.
    saved = json.loads(ledger.to_json())
    events = [segment["event"] for segment in saved["segments"]]
    if saved["open"] is not None and saved["steps"] > saved["open"]["start"]:
        events.append(saved["open"]["event"])
    largest = 0.0
    for data in events:
        single = PrivacyLedger()
        single.record(event_from_dict(data))
        largest = max(largest, single.epsilon(delta, accountant=accountant))
    return largest


def _linear_loss(y_true, y_pred):
    """-y * prediction: the per-example gradient is -y x, whatever the weights."""
    import tensorflow as tf

    return -tf.reduce_sum(tf.cast(y_true, y_pred.dtype) * y_pred, axis=-1)


def _check_plain_sgd(optimizer):
    """The update must be -learning_rate * (noisy gradient), step by step."""
    import keras

    from tfdp.optimizers import DPOptimizer

    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(
            "Expected `make_optimizer` to return a tfdp optimizer. Received: "
            f"{type(optimizer).__name__}"
        )
    inner = optimizer.inner_optimizer
    momentum = float(getattr(inner, "momentum", 0.0) or 0.0)
    if type(inner) is not keras.optimizers.SGD or momentum != 0.0:
        raise ValueError(
            "audit_optimizer reads each step's noisy gradient from the weight update, "
            "so the inner optimizer must be plain SGD without momentum (momentum, "
            "Adam or RMSprop make a step depend on earlier ones; they only "
            "post-process released gradients, so audit the mechanism with SGD). "
            f"Received: inner optimizer {type(inner).__name__} with momentum={momentum}"
        )
    learning_rate = inner.learning_rate
    try:
        return float(learning_rate)
    except (TypeError, ValueError):
        raise ValueError(
            "audit_optimizer needs a constant learning rate. Received: "
            f"learning_rate={show(learning_rate)}"
        ) from None


def default_normalizer(model):
    """(offset 0, scale C): a DP-SGD step's released sum is in units of C."""
    return 0.0, float(model.optimizer.l2_norm_clip)


def weight_decay_normalizer(ordinary_records):
    """Normalizer for weight decay before clipping (q = 1).

    Every record's gradient gets lambda * theta added before clipping, so the
    `ordinary_records` records of x = 0 add `ordinary_records` times
    clip(lambda * theta) to each step's sum. The attacker knows theta (white
    box) and subtracts it. Use with `absent="nan"` and
    `batch_size=num_examples`.

    Args:
        ordinary_records: `num_examples - canaries`.

    Returns:
        `normalizer(model) -> (offset, C)`.
    """
    ordinary_records = check_int("ordinary_records", ordinary_records)

    def normalizer(model):
        optimizer = model.optimizer
        theta = model.layers[-1].kernel.numpy()[:, 0].astype(np.float64)
        offset = float(optimizer.weight_decay) * theta
        clip = float(optimizer.l2_norm_clip)
        offset = offset * min(1.0, clip / max(float(np.linalg.norm(offset)), 1e-30))
        return -ordinary_records * offset, clip  # the released sum is negated

    return normalizer


def adadp_normalizer(model):
    """Normalizer for AdaDP (with `adaptive_learning_rate=False`): whitening.

    Divides coordinate j by its noise standard deviation over sigma*: C in
    the warm-up, sqrt(d) c_j in the adaptive phase, read from AdaDP's noisy
    statistic s before the step. Without the canary the score is then
    N(0, sigma*^2) whatever the history; with it, shifted by at most 1.
    """
    import tensorflow as tf

    from tfdp.mechanisms import adaptive_noise

    optimizer, variables = model.optimizer, model.trainable_variables
    moments = [tf.convert_to_tensor(m) for m in optimizer.second_moments(variables)]
    if bool(adaptive_noise.is_adaptive_phase(moments, optimizer.local_clip_threshold)):
        bounds = adaptive_noise.clip_bounds(moments, optimizer.local_clip_factor, optimizer.l2_norm_clip)
        return 0.0, math.sqrt(adaptive_noise.num_parameters(variables)) * bounds[0].numpy()[:, 0]
    return 0.0, float(optimizer.l2_norm_clip)


def dpis_normalizer(model):
    """Normalizer for DPIS: divide by K~ / N~, the norm of every accepted term.

    Audit DPIS where K~ stays at its floor b C + C on both D and D' (few
    canaries, a large batch), so both runs have the same per-step event.
    """
    optimizer = model.optimizer
    return 0.0, float(optimizer.k_tilde) / float(optimizer.n_tilde)


def _run_linear(make_optimizer, x, y, batch_size, steps, epochs, seed, normalizer):
    """Trains the audit's linear model once.

    Returns (released [T, d] = the step's sum as read from the update,
    offsets [T, d], scales [T, d], model).
    """
    import keras

    import tfdp

    class _Recorder(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.kernels, self.offsets, self.scales = [], [], []

        def _kernel(self):
            return self.model.layers[-1].kernel.numpy()[:, 0].astype(np.float64)

        def on_train_batch_begin(self, batch, logs=None):
            kernel = self._kernel()
            offset, scale = normalizer(self.model)
            self.kernels.append(kernel)
            self.offsets.append(np.broadcast_to(np.asarray(offset, np.float64), kernel.shape))
            self.scales.append(np.broadcast_to(np.asarray(scale, np.float64), kernel.shape))

        def on_train_end(self, logs=None):
            self.kernels.append(self._kernel())

    optimizer = make_optimizer(seed)
    learning_rate = _check_plain_sgd(optimizer)
    model = tfdp.DPSequential(
        [keras.Input((x.shape[1],)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    model.compile(optimizer=optimizer, loss=_linear_loss)
    recorder = _Recorder()
    model.fit(
        x, y, batch_size=batch_size, epochs=epochs, steps_per_epoch=steps // epochs,
        verbose=0, callbacks=[recorder],
    )
    kernels = np.asarray(recorder.kernels)
    # update = -lr * (sum + noise) / b, so the released sum (negated) is:
    released = np.diff(kernels, axis=0) * batch_size / learning_rate
    return released, np.asarray(recorder.offsets), np.asarray(recorder.scales), model


def audit_optimizer(
    make_optimizer,
    steps,
    delta=1e-5,
    canaries=64,
    num_examples=None,
    batch_size=None,
    canary_scale=None,
    epochs=1,
    confidence=0.95,
    seed=0,
    accountant="rdp",
    absent="zeros",
    normalizer=None,
    drop_unchanged_steps=False,
    public_energy_data=False,
    mechanism=None,
):
    """White-box audit of one step of a tfdp optimizer, through `DPModel.fit`.

    Trains the linear audit model (see the module docstring) once on D'
    (`canaries` canary records among `num_examples` records of x = 0) and
    once on D, where the canaries are replaced by `absent` records that the
    mechanism ignores: exactly the add/remove neighbour with the same
    sampling rate and expected batch size. Each step and canary gives one
    trial per side: `steps * canaries` trials per side.

    Canary j's gradient is along e_j and the noise is isotropic, so the j-th
    coordinate of a step's released sum depends on canary j alone: its
    trials are those of the one-step mechanism on (D' minus canary j, D').
    The score of canary j at step t is that coordinate, read from the weight
    update (the inner optimizer must be plain SGD), minus `offset` and
    divided by `scale` as returned by `normalizer(model)` just before the
    step. A mechanism whose state adapts to released values
    (AdaDP's noise shape, DPIS's K~, weight decay's dependence on the
    weights) is audited soundly when the normalizer whitens it: the score
    without the canary is then the same fixed distribution whatever the
    history, and with it a mixture of shifts no larger than one step allows.

    Args:
        make_optimizer: `make_optimizer(seed) -> tfdp optimizer`, a fresh one
            per run (D' uses `seed`, D `seed + 1`). Its inner optimizer must
            be SGD without momentum, with a constant learning rate.
        steps: training steps per run, an integer >= 1.
        delta: delta audited (default 1e-5).
        canaries: k, an integer >= 1; inputs have k + 1 coordinates (the last
            one is never touched by training data; SA-DPSGD's public energy
            set reads it).
        num_examples: records per dataset (default: `canaries`).
        batch_size: expected batch size (default `num_examples`: sampling
            rate q = 1, the strongest audit of the Gaussian step).
        canary_scale: norm of a canary's gradient before clipping (default
            100 times the optimizer's `l2_norm_clip`, so a mechanism that
            does not clip is caught).
        epochs: `fit` epochs the steps are split into (default 1).
        confidence: confidence of the bound (default 0.95).
        seed: base seed (also of the selection/evaluation split).
        accountant: "rdp" (default, what tfdp reports) or "pld", for the
            claimed one-step epsilon.
        absent: what replaces the canaries in D: "zeros" (default; a record
            with gradient 0 contributes nothing to DP-SGD's sum) or "nan"
            (a NaN record contributes nothing at all, docs/mechanisms/index.md#clipping:
            needed when every record's gradient gets an offset, as with
            weight decay before clipping).
        normalizer: `normalizer(model) -> (offset, scale)` (scalars or
            [k + 1] arrays), called before every step (the audit model's
            weights are `model.layers[-1].kernel`, its optimizer
            `model.optimizer`); default `default_normalizer` (0, C).
        drop_unchanged_steps: drop steps that left every weight unchanged
            (SA-DPSGD's rejected candidates). Sound only when that decision
            cannot depend on the canaries (SA-DPSGD's energy on the spare
            coordinate): then the kept steps' canary coordinates have their
            unconditional distribution.
        public_energy_data: True to hand the optimizer a public energy set
            (x = e_spare, y = 1) with `set_public_energy_data` (SA-DPSGD).
        mechanism: name for reports (default: the optimizer's class name).

    Returns:
        `AuditResult` with `claimed_epsilon` = the ledger's one-step epsilon
        (`one_step_epsilon`, the largest over both runs).

    Example:

    >>> import tfdp
    >>> make = lambda seed: tfdp.optimizers.DPSGD(
    ...     1.0, l2_norm_clip=1.0, noise_multiplier=2.0, seed=seed)
    >>> result = audit_optimizer(make, steps=100, canaries=32)  # doctest: +SKIP
    >>> result.epsilon_lower_bound <= result.claimed_epsilon   # doctest: +SKIP
    True
    """
    if not callable(make_optimizer):
        raise TypeError(f"Expected `make_optimizer` to be a callable. Received: make_optimizer={show(make_optimizer)}")
    steps = check_int("steps", steps, minimum=1)
    canaries = check_int("canaries", canaries, minimum=1, maximum=100000)
    epochs = check_int("epochs", epochs, minimum=1)
    if steps % epochs:
        raise ValueError(f"Expected `steps` to be a multiple of epochs ({epochs}). Received: steps={steps}")
    num_examples = canaries if num_examples is None else check_int("num_examples", num_examples, minimum=canaries)
    batch_size = num_examples if batch_size is None else check_int(
        "batch_size", batch_size, minimum=1, maximum=num_examples
    )
    seed = check_int("seed", seed)
    if absent not in ("zeros", "nan"):
        raise ValueError(f"Expected `absent` to be 'zeros' or 'nan'. Received: absent={show(absent)}")
    normalizer = default_normalizer if normalizer is None else normalizer
    probe = make_optimizer(seed)
    _check_plain_sgd(probe)
    clip = float(probe.l2_norm_clip)
    if canary_scale is None:
        canary_scale = 100.0 * clip
    canary_scale = check_real("canary_scale", canary_scale, low=0.0)

    dimension = canaries + 1
    slots = np.arange(canaries)
    x_in = np.zeros((num_examples, dimension), np.float32)
    x_in[slots, slots] = canary_scale
    x_out = np.zeros_like(x_in)
    if absent == "nan":
        x_out[slots] = np.nan
    y = np.ones((num_examples, 1), np.float32)

    def make(run_seed):
        optimizer = make_optimizer(run_seed)
        if public_energy_data:
            x_public = np.zeros((1, dimension), np.float32)
            x_public[0, canaries] = 1.0
            optimizer.set_public_energy_data((x_public, np.ones((1, 1), np.float32)))
        return optimizer

    results = []
    for run_seed, x in ((seed, x_in), (seed + 1, x_out)):
        released, offsets, scales, model = _run_linear(
            make, x, y, batch_size, steps, epochs, run_seed, normalizer
        )
        if drop_unchanged_steps:
            keep = np.any(released != 0.0, axis=1)
            released, offsets, scales = released[keep], offsets[keep], scales[keep]
        scores = ((released - offsets) / scales)[:, :canaries]
        results.append((scores.reshape(-1), one_step_epsilon(model.privacy, delta, accountant)))
    (scores_in, claimed_in), (scores_out, claimed_out) = results
    return epsilon_from_scores(
        scores_out, scores_in, delta, confidence=confidence, seed=seed,
        claimed_epsilon=max(claimed_in, claimed_out),
        mechanism=mechanism or type(probe).__name__,
    )
