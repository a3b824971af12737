"""`sensitivity_search`: check a DP model's real train step before training.

DP-SGD's guarantee assumes that one record moves a step's update by at most
lr * C / b (added or removed; twice that for a replaced record). That
holds only if every norm the clipping uses is at least the norm of what is
summed, for ANY record, in the arithmetic the step really runs (float32,
bfloat16, XLA, physical batches). `sensitivity_search` tests that claim on
your compiled model: it runs the model's own train step (Keras's compiled
train function, with your model's weights, dtype policy, `jit_compile`,
loss and `physical_batch_size`) without noise on neighbouring batches, and
searches for the record that moves the update the most:

1. real records from `x`, `y`;
2. extreme magnitudes (subnormal 1e-40, 1e-30 .. 1e30, 3e38) in inputs,
   targets and sample weights;
3. NaN and Inf entries;
4. cancelling positions: tied sequence positions with alternating targets,
   or alternating inputs, the attack on factored norms;
5. flush-to-zero: huge inputs (3e38) behind the zero rows of the first
   layer's kernel (a zero-initialised layer) with a tiny output gradient,
   cancelled exactly by a second position, so that the clip factor times
   that gradient falls below 2^-126, where float32 results are flushed;
6. tiny inputs: inputs at 2^-126 / |M| (M the first layer's kernel; lambda M
   is the offset of weight decay before clipping), the smallest normal and
   a subnormal, with a huge sample weight (3e38) or target, so that every
   product x M is flushed while the record's gradient is not;
7. gradient ascent on float inputs and targets, discrete search on token
   ids, labels and masks;
8. the worst records again as the last drawn row of a full batch, in a
   padded batch, filling the padding rows, before every other record
   (which each move one row down), and replacing another record.

Constructions 5 and 6 read the model's first layer's kernel (its zero rows,
its scale) and prediction, and build the record from them.

A user-level model (`fit(user_ids=..., examples_per_user=k)`) is checked
per user: each row of the batches is a person holding k copies of it. When
the model's ledger is user-level and neither the argument nor the last
`fit` gives k, the search raises instead of checking records; the summary
prints k. How the sampler chooses people and their records (whether one
person's presence moves anyone else's draws) is checked by
`tfdp.auditing.sampler_coupling`, which runs the real samplers.

It reports the worst ratio update change / bound (the bound holds when the
ratio is <= 1, up to float32 rounding of about 1e-6), the record, the
construction and neighbour relation that reached it, and the per-example
path the model takes.

Cost: one train step of `records + 1` rows per candidate (about 60 to 100
candidates plus `search_steps`), and one trace (or XLA compilation) of the
train step and of the surrogate's gradient: seconds for a small model on a
CPU (under XLA with `physical_batch_size` too: the chunked step compiles
once whatever the count of drawn rows). The search borrows your model (its
own layers, weights and settings) with a noiseless stand-in optimizer and
puts everything back on leaving, even after an error: its weights,
optimizer and optimizer state, ledger, step counter and train function are
as they were. On a GPU it turns TensorFloat-32 off for the process first,
as `fit` does, so that it measures the arithmetic training will run.

What it cannot prove: it is a search, not a proof. A ratio <= 1 means that
none of the records it tried broke the bound, not that none can; a record
that needs a structure it does not try (or weights it does not reach) goes
unseen. A ratio above 1 is a proof: the record it reports breaks the bound
of this model's step.

Example:

>>> import keras, numpy as np, tfdp
>>> model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
>>> model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0), loss="mse")
>>> rng = np.random.default_rng(0)
>>> x, y = rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
>>> result = tfdp.auditing.sensitivity_search(model, x, y, search_steps=4)
>>> result.worst_ratio <= 1 + 1e-5
True
>>> result.check()   # raises SensitivityExceeded, with the record, above 1 + 1e-5
"""

import dataclasses
import time

import numpy as np
import tensorflow as tf

from tfdp.auditing import crafted_records, record_search
from tfdp.auditing.neighbour_step import RELATIONS, NeighbourStep
from tfdp.data.users import check_examples_per_user
from tfdp.models import float32_precision, multi_output
from tfdp.models.dp_model import _lists_to_tuples
from tfdp.models.user_level import check_user_level_optimizer


class SensitivityExceeded(AssertionError):
    """A record moved the train step's update beyond the DP bound."""


@dataclasses.dataclass(frozen=True)
class SensitivityResult:
    """What `sensitivity_search` found.

    Attributes:
        worst_ratio: the largest ||update(D') - update(D)|| / bound seen
            (bound lr * C / b, twice that for a replacement; inf when a
            record made the update non-finite).
        worst_record: that record, a nest like the data, (x, y) or (x, y,
            sample_weight), without the batch axis.
        construction: how the record was made (e.g. "cancelling positions:
            tied inputs, targets +-1e+08 (delta 1e+04)").
        relation: the neighbouring batches ("add", "add, padded batch",
            "add, record in padding", "add, record first", "replace").
        per_example_path: `model.per_example_path` of the model checked.
        table: one row per construction: (name, train steps, worst ratio,
            relation of the worst).
        settings: the model's settings that shape its step, in words.
        steps: train steps run; seconds: time the search took.
        count_ratio: with adaptive clipping, the largest change of the count
            of unclipped units over its bound (1/2 per added unit, 1 per
            replacement) among the records tried; None with fixed clipping.
    """

    worst_ratio: float
    worst_record: object
    construction: str
    relation: str
    per_example_path: str
    table: tuple
    settings: str
    steps: int
    seconds: float
    count_ratio: float = None

    def summary(self):
        """A few lines: the verdict, the settings, and the table."""
        verdict = "within the bound" if self.worst_ratio <= 1.0 + 1e-5 else "BOUND EXCEEDED"
        lines = [
            f"sensitivity search: worst ratio {self.worst_ratio:.9g} ({verdict}) by "
            f"{self.construction} [{self.relation}]",
        ] + ([] if self.count_ratio is None else [
            f"count of unclipped units: worst change {self.count_ratio:.9g} x its bound"]) + [
            f"{self.settings}; {self.steps} train steps in {self.seconds:.1f} s",
            f"per-example path: {self.per_example_path}",
            f"{'construction':<28}{'steps':>7}{'worst ratio':>18}  relation",
        ]
        lines += [f"{name:<28}{steps:>7}{ratio:>18.9g}  {relation}"
                  for name, steps, ratio, relation in self.table]
        return "\n".join(lines)

    def check(self, tolerance=1e-5):
        """Raises `SensitivityExceeded` (with the record) if the worst ratio
        exceeds 1 + tolerance (or is not finite).

        Args:
            tolerance: allowed excess over the bound (float32 rounding of the
                step itself is about 1e-6).
        """
        if self.count_ratio is not None and not self.count_ratio <= 1.0 + tolerance:
            raise SensitivityExceeded(
                f"One record moved adaptive clipping's count of unclipped units "
                f"{self.count_ratio:.6g} times its bound (tolerance {tolerance:g}).\n"
                f"{self.summary()}")
        if self.worst_ratio <= 1.0 + tolerance:
            return
        record = tf.nest.map_structure(
            lambda a: np.array2string(np.asarray(a), threshold=64, precision=6), self.worst_record
        )
        raise SensitivityExceeded(
            f"One record moved the DP update {self.worst_ratio:.6g} times the bound "
            f"(tolerance {tolerance:g}).\n{self.summary()}\nThe record (x, y[, sample_weight]):\n"
            + "\n".join(str(part) for part in tf.nest.flatten(record))
        )


class _Table:
    """Train steps and the worst (ratio, record, detail, relation) per construction."""

    def __init__(self):
        self.rows = {}

    def add(self, construction, detail, record, ratio, relation, steps=1):
        steps_so_far, worst = self.rows.get(construction, (0, None))
        if worst is None or ratio > worst[0]:
            worst = (ratio, record, detail, relation)
        self.rows[construction] = (steps_so_far + steps, worst)

    def worst(self):
        """(ratio, record, construction and detail, relation) of the worst row."""
        name, (_, (ratio, record, detail, relation)) = max(
            self.rows.items(), key=lambda item: item[1][1][0])
        return ratio, record, f"{name}: {detail}" if detail else name, relation

    def worst_records(self):
        """(construction, detail, record) of each construction's worst."""
        return [(name, worst[2], worst[1]) for name, (_, worst) in self.rows.items()]


def _check_model(model):
    from tfdp.models.dp_model import DPTrainingMixin

    if not isinstance(model, DPTrainingMixin):
        raise ValueError(
            "sensitivity_search checks a tfdp.DPModel or tfdp.DPSequential. Received: "
            f"model={type(model).__name__}"
        )
    if getattr(model, "optimizer", None) is None or getattr(model, "_per_example_loss", None) is None:
        raise ValueError(
            "Compile the model with its tfdp optimizer and loss before "
            "sensitivity_search: it checks the step that fit would run. Received: an "
            "uncompiled model"
        )
    if not model.built:
        raise ValueError(
            "Build the model before sensitivity_search (call it on a batch, or give "
            "keras.Input a shape). Received: an unbuilt model"
        )


def _check_data(model, x, y, sample_weight, records):
    if isinstance(records, bool) or not isinstance(records, (int, np.integer)) or records < 2:
        raise ValueError(f"Expected `records` to be an int >= 2. Received: records={records!r}")
    if x is None or y is None:
        raise ValueError(
            f"sensitivity_search needs inputs and targets. Received: x={type(x).__name__}, "
            f"y={type(y).__name__}"
        )
    if isinstance(x, (list, tuple)) and len(getattr(model, "inputs", None) or ()) <= 1:
        x = np.asarray(x)  # one input given as a Python list, as fit takes it
    x = tf.nest.map_structure(np.asarray, _lists_to_tuples(x))
    if multi_output.has_several_outputs(model):  # one target per output, in output order
        y = multi_output.in_output_order(model, multi_output.check_targets(model, y))
        if sample_weight is not None:  # [N], or one per output (a tuple in output order)
            sample_weight = multi_output.in_output_order(
                model, multi_output.check_sample_weight(sample_weight, None))
    data = (x, tf.nest.map_structure(np.asarray, y)) + (
        () if sample_weight is None else (tf.nest.map_structure(np.asarray, sample_weight),))
    for array in tf.nest.flatten(data):
        if array.ndim == 0 or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
            raise ValueError(
                "sensitivity_search takes x, y (and sample_weight) as arrays with one "
                "row a record, e.g. a few rows of your training arrays. Received: an "
                f"array of dtype {array.dtype} and shape {array.shape}"
            )
    counts = {len(a) for a in tf.nest.flatten(data)}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(
            "Expected x, y (and sample_weight) with the same number of records, at least "
            f"one. Received: {sorted(counts)} rows"
        )
    return data


def _settings(model, step):
    optimizer = model.optimizer
    parts = [
        f"{type(model).__name__} '{model.name}'",
        f"{type(optimizer).__name__}(l2_norm_clip={optimizer.l2_norm_clip:g}"
        + (f", adaptive: target_unclipped_quantile={optimizer.target_unclipped_quantile:g}, "
           f"C_t={float(optimizer.clip_norm()) if optimizer.built else optimizer.l2_norm_clip:g}"
           if optimizer.clips_adaptively else "")
        + (f", weight_decay={optimizer.weight_decay:g} {optimizer.weight_decay_placement}"
           if optimizer.weight_decay else "") + ")",
        f"dtype policy {model.dtype_policy.name}",
        f"jit_compile={bool(model.jit_compile)}",
        f"physical_batch_size={step.physical_batch_size}",
        f"batches of {step.records + 1} rows, b={step.batch_size:g}",
        f"user level, k={step.examples_per_user} records a person"
        if step.examples_per_user else "record level",
    ]
    return ", ".join(parts)


def sensitivity_search(model, x, y, sample_weight=None, *, records=7, batch_size=None,
                       physical_batch_size=None, search_steps=48, seed=0,
                       examples_per_user=None):
    """Searches for a record that moves the model's DP step beyond its bound.

    See the module docstring for what it runs, what it costs and what it
    cannot prove.

    Args:
        model: a compiled `tfdp.DPModel` / `tfdp.DPSequential` (DPSGD,
            DPOptimizer and its subclasses, DPBandMF (its step without noise
            is DP-SGD's: the clipped sum over b; its noise stream is not
            touched), or SADPSGD, whose candidate step is measured; DPIS and
            AdaDP are refused). Only read.
        x, y: a few real records (arrays; x may be a tuple or dict of arrays
            for a multi-input model); the first `records + 1` are used
            (repeated if fewer).
        sample_weight: optional weights, as for `fit`.
        records: real records in the batch D (the batches have `records + 1`
            rows).
        batch_size: the expected batch size b the step divides by (default
            `records + 1`); the ratio does not depend on it.
        physical_batch_size: as `fit`'s argument (default: the one the last
            `fit` used, else None).
        search_steps: train steps spent on gradient ascent and the discrete
            search, on top of the fixed constructions.
        seed: seeds the random directions and the searches.
        examples_per_user: None (record-level), or k to check the user-level
            step of `fit(user_ids=..., examples_per_user=k)`: every row of
            the batches is then a user holding k copies of it, and the bound
            is per user (default: the k the last `fit` used, if any; a model
            whose ledger is user-level needs one).

    Returns:
        `SensitivityResult`; call `.check()` to raise if the bound broke.

    Raises:
        ValueError: for a model or data it cannot check (it says why), and
            for a user-level ledger without `examples_per_user`.
    """
    _check_model(model)
    data = _check_data(model, x, y, sample_weight, records)
    if physical_batch_size is None:
        physical_batch_size = getattr(model, "_physical_batch_size", None)
    started = time.perf_counter()
    if examples_per_user is None:
        examples_per_user = getattr(model, "_examples_per_user", None)
    if examples_per_user is None and model.privacy.relation == "add_or_remove_user":
        raise ValueError(
            "This model's privacy ledger is user-level (fit(user_ids=...)): its bound is "
            "per person, and a record-level search would check the wrong step. Pass "
            "examples_per_user=k, the k of fit(examples_per_user=k). Received: "
            "examples_per_user=None"
        )
    if examples_per_user is not None:
        check_examples_per_user(examples_per_user)
        check_user_level_optimizer(model.optimizer, f"examples_per_user={examples_per_user}")
    step = NeighbourStep(model, data, records, batch_size or records + 1, physical_batch_size,
                         examples_per_user)
    settings = _settings(model, step)
    # The arithmetic fit trains in: on a GPU, fit turns TensorFloat-32 off first.
    float32_precision.keep_float32_exact()
    with step:
        table = _search(step, data, records, search_steps, seed)
    ratio, record, construction, relation = table.worst()
    rows = tuple((name, steps, worst[0], worst[3]) for name, (steps, worst) in table.rows.items())
    return SensitivityResult(
        worst_ratio=ratio, worst_record=record, construction=construction, relation=relation,
        per_example_path=model.per_example_path, table=rows, settings=settings,
        steps=step.steps, seconds=time.perf_counter() - started, count_ratio=step.count_ratio,
    )


def _search(step, data, records, search_steps, seed):
    """Runs every construction and search on the entered `step`; returns the `_Table`."""
    outputs = getattr(step.model, "outputs", None)
    classes = [int(o.shape[-1] or 1) if len(o.shape) else 1 for o in outputs or []] or [1]
    if len(classes) == 1:
        classes = classes[0]  # one output; several: one count per output's target
    space = crafted_records.RecordSpace(data, classes)
    rng = np.random.default_rng(seed)
    table = _Table()
    base = space.template
    constructions = [("real records", [("", step.rows[-1])] + [
        ("", tf.nest.map_structure(lambda a, i=i: np.asarray(a[i % len(a)]), data))
        for i in range(records + 1, records + 4)])]
    constructions += [
        ("extreme magnitudes", crafted_records.extremes(space, base)),
        ("NaN/Inf", crafted_records.nonfinite(space, base)),
        ("cancelling positions", crafted_records.cancelling_positions(space, base, step.predict, rng)),
    ]
    kernel = crafted_records.first_kernel(step.model, space)
    constructions += [
        ("flush-to-zero", crafted_records.flush_to_zero(space, base, step.predict, kernel)),
        ("tiny inputs", crafted_records.tiny_inputs(space, base, step.predict, kernel,
                                                    _gradient_scale(step))),
    ]
    for construction, candidates in constructions:
        for detail, record in candidates:
            table.add(construction, detail, record, step.ratio(record), "add")

    continuous = record_search.ClippedContribution(step, space)
    discrete = space.indices(kind="int") + space.indices(kind="bool")
    if continuous.watched and search_steps:
        starts = [base] + [r for name, _, r in table.worst_records()
                           if name != "NaN/Inf" and _finite(r)][:2]
        budget = search_steps // 2 if discrete else search_steps
        ratio, record, used = record_search.gradient_ascent(step, space, continuous, starts, budget)
        if record is not None:
            table.add("gradient ascent", "", record, ratio, "add", used)
        search_steps -= used
    ratio, record, used = record_search.discrete_search(step, space, base, search_steps, rng)
    if record is not None:
        table.add("discrete search", "", record, ratio, "add", used)

    for construction, detail, record in table.worst_records():
        for relation in RELATIONS[1:]:
            table.add(construction, detail, record, step.ratio(record, relation), relation)
    return table


def _gradient_scale(step):
    """The norm a crafted gradient should reach: the weight-decay offset's
    (lambda times the weights' norm) when decay comes before clipping, else C."""
    optimizer = step.optimizer
    clip = float(optimizer.clip_norm())  # C_t with adaptive clipping
    if not optimizer.weight_decay or optimizer.weight_decay_placement != "before_clip":
        return clip
    weights = np.sqrt(sum(float(np.sum(np.square(np.asarray(v.numpy(), np.float64))))
                          for v in step.model.trainable_variables))
    return max(clip, float(optimizer.weight_decay) * weights)


def _finite(record):
    return all(np.all(np.isfinite(np.asarray(a, np.float64))) for a in tf.nest.flatten(record)
               if np.issubdtype(np.asarray(a).dtype, np.floating))
