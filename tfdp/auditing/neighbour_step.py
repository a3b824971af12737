"""A DP model's real train step on neighbouring batches, measured in float64.

`NeighbourStep` borrows a compiled, built `DPModel` / `DPSequential` for
the length of a `with` block: it gives the model a copy of its optimizer
(same class, clip norm and weight decay) whose noise is 0 and whose inner
optimizer is plain SGD, and a train function traced for it. The update is
then minus the learning rate times the clipped sum divided by the expected
batch size b (plus the decay term, the same on both sides). Everything else
is the model's own: its layers (shared and tied ones included), weights,
dtype policies, `jit_compile`, loss, per-example path and
`physical_batch_size`. On leaving the block the model gets back its
optimizer, train function, chunking and the value of every variable
(weights, step counter, random-seed states, metrics): the user's model,
optimizer, ledger and step counter are as they were, even after an error.

`ratio(record, relation)` runs Keras's compiled train function on a batch
D and on a neighbouring batch D' laid out as `fit` lays out a Poisson draw
(drawn rows first, then padding rows that repeat record 0 with mask 0),
reads the weights after each step and returns
||update(D') - update(D)|| / (lr * C / b), computed in float64; a
replacement's bound is twice that. Every variable is restored after each
step, so both sides start from the same state and draw the same dropout
masks.

The learning rate is a power of two (so multiplying by it is exact) large
enough that the update dwarfs the weights: a weight of size |w| rounds the
float32 update by up to 2^-24 |w|, which at learning rate 1 would reach 1e-4
of the bound on a model with 10^4 weights. The ratio itself does not depend
on the learning rate.

Relations (D has `records` real rows, the batch `records + 1` rows):

* "add": D' = D plus the record as the last drawn row; the batch is full
  (the last physical chunk ends on the record).
* "add, padded batch": D' = the first half of D plus the record, followed
  by padding rows.
* "add, record in padding": as "add, padded batch", with the padding rows of
  D' copies of the record (`fit` pads with record 0, and the record may be
  record 0 of the data set).
* "add, record first": D' = the record followed by D's records, a full
  batch; D as for "add". A Poisson draw keeps the data set's order, so an
  added record may come before every other: each of them then moves one
  row down, which a step that gives an example anything by its position in
  the batch (a constant's row, a seed) would feel.
* "replace": the full batch with its first record replaced (bound 2C/b).

With adaptive clipping (`target_unclipped_quantile`) the stand-in starts
from the model optimizer's current clip norm C_t (the bound is lr * C_t / b),
its count of unclipped units is noiseless too, and `ratio` also records how
far the record moved that count: `count_ratio` is the largest
|count(D') - count(D)| seen over its bound (1/2 for adding a unit, each
unit adding +-1/2; 1 for a replacement). The count is read both as the
step releases it (the fraction b_t, clamped to [0, 1]) and unclamped (the
stand-in also logs the centred count itself): where every unit is unclipped
and b is below the batch's rows, both sides' fractions clamp to 1 and
would hide a count that moves by more than its bound.

With `examples_per_user=k` the step is user-level (`fit(user_ids=...)`):
every row above is a user whose k records are copies of it, each user's
gradient of their mean loss clipped as one unit, and the bound is per user.

Example (a record far outside the data is clipped to C: ratio 1):

>>> import keras, numpy as np, tfdp
>>> model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(1)])
>>> model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0), loss="mse")
>>> data = (np.ones((4, 3), "float32"), np.zeros((4, 1), "float32"))
>>> with NeighbourStep(model, data, records=3, batch_size=4, physical_batch_size=None) as step:
...     ratio = step.ratio((np.full(3, 100.0), np.zeros(1)))
>>> round(ratio, 5), model.optimizer.noise_multiplier   # the model's optimizer is back
(1.0, 1.0)
"""

import math

import keras
import numpy as np
import tensorflow as tf

from tfdp.models import multi_output

RELATIONS = ("add", "add, padded batch", "add, record in padding", "add, record first",
             "replace")

# Mechanisms whose update is not (learning rate) x (clipped sum) / b.
_REFUSED = {
    "DPIS": "its importance weights and per-record clip bounds come from a "
            "per-epoch pass over the whole data set, which a step on two batches "
            "does not run",
    "AdaDP": "its noise and update are rescaled per parameter by running "
             "statistics of earlier noisy gradients, so one step's update is not "
             "the clipped sum",
}

# Baseline jitter (the same batch twice) above this fraction of the bound
# makes the measurement meaningless.
_MAX_JITTER = 1e-7

# The stand-in's log of the unclamped centred count of unclipped units.
CENTRED_COUNT = "centred_unclipped_count"

# The model's attributes a borrowed step replaces, restored on leaving.
_BORROWED = ("optimizer", "train_function", "_physical_batch_size", "_examples_per_user")
_ABSENT = object()


def _refusal(optimizer):
    from tfdp.optimizers import AdaDP, DPIS

    for cls in (DPIS, AdaDP):
        if isinstance(optimizer, cls):
            return cls.__name__, _REFUSED[cls.__name__]
    return None


class NeighbourStep:
    """The model's real train step on neighbouring batches (module docstring).

    Use it as a context manager: the model is borrowed inside the block.

    Args:
        model: a compiled, built `tfdp.DPModel` / `tfdp.DPSequential`.
        data: tuple (x, y) or (x, y, sample_weight) of arrays with one row
            per record (x may be a tuple or dict of arrays).
        records: int >= 2, real records in D.
        batch_size: the expected batch size b the step divides by.
        physical_batch_size: None or int, as `fit`'s argument.

    Attributes:
        model: the borrowed model.
        optimizer: its noiseless stand-in optimizer.
        rows: the records of D, each a nest of one-row arrays (no batch axis).
        lr: the inner SGD's learning rate.
        bound: lr * C / b, the add/remove bound on the update's L2 norm.
        steps: train steps run so far.
    """

    def __init__(self, model, data, records, batch_size, physical_batch_size,
                 examples_per_user=None):
        from tfdp.models import chunked_step
        from tfdp.models.matmul_precision import refuse_rewritten_matmuls

        refuse_rewritten_matmuls(model)  # as fit does: it would measure bfloat16 matmuls
        self.model = model
        self.records = records
        self.batch_size = float(batch_size)
        self.examples_per_user = examples_per_user
        self._original_optimizer = model.optimizer
        self.optimizer = _noiseless_optimizer(model.optimizer)
        self.count_ratio = 0.0 if self.optimizer.clips_adaptively else None
        self.last_fraction = None
        self.last_count = None
        # A batch here has records + 1 rows (users, with examples_per_user): a
        # larger chunk is the whole batch.
        if isinstance(physical_batch_size, (int, np.integer)) and not isinstance(
                physical_batch_size, bool):
            physical_batch_size = min(int(physical_batch_size), records + 1)
        self.physical_batch_size = chunked_step.check_physical_batch_size(
            self.optimizer, physical_batch_size, num_examples=records + 1,
            batch_size=records + 1,
        )
        count = len(tf.nest.flatten(data)[0])
        self.rows = [_row(data, i % count) for i in range(records + 1)]
        self.steps = 0
        self._baselines = {}
        self._baseline_counts = {}
        self._saved = None

    def __enter__(self):
        model = self.model
        self._saved = {name: model.__dict__.get(name, _ABSENT) for name in _BORROWED}
        self._state = [(v, v.numpy()) for v in _state_variables(model)]
        try:
            _set_optimizer(model, self.optimizer)
            model._physical_batch_size = self.physical_batch_size
            model._examples_per_user = self.examples_per_user
            model.train_function = None
            model._build_for(_stack(self.rows[:1]))  # metrics, the stand-in optimizer
            if not self.optimizer.built:
                self.optimizer.build(model.trainable_variables)
            if self.optimizer.clips_adaptively:  # the step's C_t, as the user's optimizer has it
                original = self._original_optimizer
                current = (float(original.clip_norm()) if original.built
                           else original.l2_norm_clip)
                self.optimizer.clip_norm().assign(current)
            scale = max(float(np.max(np.abs(v.numpy()))) for v in model.trainable_variables)
            clip = float(self.optimizer.clip_norm())
            exponent = math.ceil(math.log2(max(scale, 1e-30) * 2**20 * self.batch_size / clip))
            # ... but every update (records + 1 clipped gradients) stays below 2^100.
            ceiling = math.floor(math.log2(2.0**100 * self.batch_size / (clip * (self.records + 1))))
            self.lr = 2.0 ** max(0, min(exponent, ceiling))
            self.optimizer.inner_optimizer.learning_rate = self.lr
            self.bound = self.lr * clip / self.batch_size
            self._state = [(v, v.numpy()) for v in
                           _state_variables(model) + list(self.optimizer.variables)]
            model.make_train_function()
            jitter = np.linalg.norm(self._update(*self._batch(None, "add")) - self._baseline("add"))
            if not np.all(np.isfinite(self._baseline("add"))):
                raise RuntimeError(
                    "The train step on the data's own records gave non-finite weights, so "
                    "no change can be measured against it. Pass a few ordinary records as "
                    "x, y. Received: non-finite weights after one step"
                )
            if not jitter <= _MAX_JITTER * self.bound:
                raise RuntimeError(
                    "The train step gave two different updates for the same batch, so "
                    "its sensitivity cannot be measured: a layer draws randomness outside "
                    "Keras's seed generators, or the optimizer adds noise outside "
                    f"noise_stddev(). Received: a difference of {jitter / self.bound:.3g} "
                    "x the bound"
                )
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info):
        model, saved = self.model, self._saved
        self.restore()
        for name, value in saved.items():
            if name == "optimizer":
                _set_optimizer(model, value)
            elif value is _ABSENT:
                model.__dict__.pop(name, None)
            else:
                setattr(model, name, value)
        return False

    def restore(self):
        """Every variable back to its value before the step."""
        for variable, value in self._state:
            variable.assign(value)

    def ratio(self, record, relation="add"):
        """||update(D') - update(D)|| / bound for `relation` (inf if not finite)."""
        if relation not in RELATIONS:
            raise ValueError(f"Expected `relation` in {RELATIONS}. Received: relation={relation!r}")
        record = self.as_data(record)
        baseline = self._baseline(relation)  # first: it sets last_fraction when it runs
        change = np.linalg.norm(self._update(*self._batch(record, relation)) - baseline)
        scale = 2.0 if relation == "replace" else 1.0
        if self.count_ratio is not None:  # the released fraction (over 1/b) and the count
            fraction, count = self._baseline_counts[relation]
            moved = max(abs(self.last_fraction - fraction) * self.batch_size,
                        abs(self.last_count - count))
            moved = moved / (0.5 * scale) if np.isfinite(moved) else math.inf
            self.count_ratio = max(self.count_ratio, moved)
        bound = self.bound * scale
        return float(change / bound) if np.isfinite(change) else math.inf

    def as_data(self, record):
        """`record` with every leaf in the data's dtype and shape (a crafted
        float64 value becomes the data's float32)."""
        with np.errstate(over="ignore"):  # a crafted 1e300 becomes the data's inf
            return tf.nest.map_structure(
                lambda leaf, like: np.asarray(leaf, like.dtype).reshape(like.shape), record,
                self.rows[0]
            )

    def predict(self, record):
        """The model's inference prediction for one record, float64 (its
        first output's, for a model with several: the first target's)."""
        x = _stack([self.as_data(record)])[0]
        prediction = self.model(tf.nest.map_structure(tf.constant, x), training=False)
        prediction = multi_output.first_output(self.model, prediction)
        return tf.cast(prediction, tf.float64).numpy()[0]

    def _baseline(self, relation):
        if relation not in self._baselines:
            self._baselines[relation] = self._update(*self._batch(None, relation))
            self._baseline_counts[relation] = (self.last_fraction, self.last_count)
        return self._baselines[relation]

    def _batch(self, record, relation):
        """Rows and number of drawn rows of D (record None) or D'."""
        n, rows = self.records, list(self.rows[: self.records])
        half = max(1, n // 2)
        if relation == "add":
            drawn = rows + ([] if record is None else [record])
            return drawn + rows[:1] * (n + 1 - len(drawn)), len(drawn)
        if relation == "add, record first":
            if record is None:
                return rows + rows[:1], n
            return [record] + rows, n + 1
        if relation == "replace":
            base = rows + [self.rows[n]]
            return ([base[0]] if record is None else [record]) + base[1:], n + 1
        drawn = rows[:half] + ([] if record is None else [record])
        filler = record if record is not None and relation == "add, record in padding" else rows[0]
        return drawn + [filler] * (n + 1 - len(drawn)), len(drawn)

    def _update(self, rows, drawn):
        """Runs the compiled step on `rows` (the first `drawn` of them drawn);
        returns the weights after it, float64, and restores every variable."""
        mask = np.zeros(len(rows), np.float32)
        mask[:drawn] = 1.0
        if self.examples_per_user:  # each row is a user holding k copies of it
            k = self.examples_per_user
            rows, mask = [row for row in rows for _ in range(k)], np.repeat(mask, k)
        return self.update(rows, mask)

    def update(self, rows, mask):
        """The weights after one step on `rows` (records, each a nest without
        the batch axis) with `mask` (1 drawn, 0 padding), float64; every
        variable is restored after it. With `examples_per_user=k` the rows
        are already users' records, k consecutive rows a user (as a sampler
        draws them)."""
        mask = np.asarray(mask, np.float32)
        step_info = {"mask": tf.constant(mask), "expected_batch_size": tf.constant(self.batch_size)}
        data = (tf.nest.map_structure(tf.constant, _stack(rows)), step_info)
        try:
            logs = self.model.train_function([data])
            if "unclipped_fraction" in logs:  # adaptive clipping's count, released
                self.last_fraction = float(np.asarray(logs["unclipped_fraction"]).ravel()[0])
                self.last_count = float(np.asarray(logs[CENTRED_COUNT]).ravel()[0])
            after = np.concatenate(
                [np.asarray(v.numpy(), np.float64).ravel() for v in self.model.trainable_variables]
            )
        finally:
            self.restore()
        self.steps += 1
        return after


def _state_variables(model):
    """Every variable a train step can change: weights, the step counter,
    random-seed states and metrics."""
    seen, out = set(), []
    for v in list(model.variables) + list(model.metrics_variables) + list(
            model._nonfinite_counter.variables):
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _set_optimizer(model, optimizer):
    """Assigns the model's optimizer as `compile` does (a compiled DP model
    refuses a plain assignment, which would desynchronise its ledger)."""
    model.__dict__["_dp_compiling"] = True
    try:
        model.optimizer = optimizer
    finally:
        model.__dict__["_dp_compiling"] = False


def _row(data, index):
    return tf.nest.map_structure(lambda a: np.asarray(a[index]), data)


def _stack(rows):
    """Rows (nests of arrays) stacked into one batch."""
    return tf.nest.map_structure(lambda *leaves: np.stack(leaves), *rows)


def _noiseless_optimizer(optimizer):
    """The same mechanism (class, clip norm, weight decay) with noise 0 and a
    plain SGD inner optimizer (its learning rate set by the caller); with
    adaptive clipping it also logs the unclamped count (`CENTRED_COUNT`)."""
    from tfdp.optimizers import DPOptimizer, SADPSGD

    if not isinstance(optimizer, DPOptimizer):
        raise ValueError(
            "sensitivity_search needs a model compiled with a tfdp optimizer. Received: "
            f"optimizer={type(optimizer).__name__ if optimizer is not None else None}"
        )
    refused = _refusal(optimizer)
    if refused:
        name, why = refused
        raise ValueError(
            f"sensitivity_search cannot measure {name}: {why}. It measures DPSGD, "
            f"DPOptimizer (and their subclasses, DPBandMF included) and SADPSGD's "
            f"candidate step. "
            f"Received: optimizer={type(optimizer).__name__}"
        )
    from tfdp.optimizers import DPBandMF

    cls = type(optimizer)

    def update_clip_norm(self, counts, step_info):
        """The mechanism's release, and the count it reads unclamped."""
        released = cls.update_clip_norm(self, counts, step_info)
        if released:
            released = {**released, CENTRED_COUNT: tf.identity(counts["unclipped_count"])}
        return released

    members = {"noise_stddev": lambda self, *args: 0.0,
               "count_noise_stddev": lambda self, *args: 0.0,
               "update_clip_norm": update_clip_norm}
    if isinstance(optimizer, DPBandMF):
        # Without noise a DP-BandMF step is DP-SGD's: its banded noise of zero
        # draws is zero, so the update is the clipped sum over b. The copy
        # needs no noise stream, and the user's (secret) stream is not touched.
        members["noisy_gradients"] = DPOptimizer.noisy_gradients
    if isinstance(optimizer, SADPSGD):
        # The accept/reject test after the update reads only the released
        # candidate and public data (post-processing): measure the candidate.
        members["apply_private_gradients"] = DPOptimizer.apply_private_gradients
    noiseless = type(f"Noiseless{cls.__name__}", (cls,), members)
    try:
        copy = noiseless.from_config(optimizer.get_config())
    except Exception as error:  # any failure: a subclass's own constructor
        raise ValueError(
            f"sensitivity_search rebuilds the optimizer from its get_config() to run "
            f"it without noise, and {cls.__name__}.from_config failed. Received: "
            f"{type(error).__name__}: {error}"
        ) from error
    copy.inner_optimizer = keras.optimizers.SGD(learning_rate=1.0)
    return copy
