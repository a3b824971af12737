"""`DPBandMF`: banded matrix-factorization noise (DP-BandMF) for any Keras optimizer.

A `DPOptimizer` whose noise is correlated across steps (Choquette-Choo et
al. 2023, `tfdp.mechanisms.bandmf`): the clipped sum of step t gets
w_t = (z_t - c_1 w_{t-1} - ... - c_{b-1} w_{t-b+1}) / c_0 with fresh
z_t ~ N(0, sigma^2 C^2), so the released iterates are as private as C x + z,
with C banded (b bands, ||c||_2 = 1). It trains from a `tf.data` pipeline
read in a fixed order (`tfdp.data.fixed_order`): no random access and no
Poisson sampling, and with a record in one step of every epoch of P >= b
steps, n steps cost ceil(n / P) Gaussian mechanisms of multiplier sigma
(`tfdp.accounting.bandmf`, under the zero-out relation). With bands=1 it
adds DP-SGD's noise.

The noise is added once per logical step to the clipped sum
(`noisy_gradients`), so per-layer rules, rounding-safe norms, physical
batches, mixed precision and XLA work as for `DPOptimizer`.
"""

import hashlib
import os
import secrets
import warnings

import keras
import numpy as np
import tensorflow as tf

from tfdp import distribute
from tfdp.accounting import bandmf as bandmf_accounting
from tfdp.data.cyclic_poisson import CyclicPoissonSampler, cyclic_sampling_probability
from tfdp.data.fixed_order import FixedOrderData
from tfdp.data.poisson import make_dataset
from tfdp.data.sampling import sampling_key
from tfdp.mechanisms import bandmf, dpsgd
from tfdp.optimizers import bandmf_state
from tfdp.accounting.calibration import steps_per_epoch as default_steps_per_epoch
from tfdp.optimizers.dp_optimizer import DPOptimizer, draw_multiple

ZERO_OUT = "zero_out"

AMPLIFIED = "add_or_remove"


class _StateBehind(ValueError):
    """The run's own noise state is at an earlier model step than the model."""


def _noise_state_error(message, path, kind=ValueError):
    return kind(
        f"{message} A DP-BandMF step's noise depends on the previous steps' noise, so a "
        "resumed run must continue the same noise stream: pass "
        "noise_state=<the file this run wrote> to the DPBandMF you compile with, or "
        "start a new stream with DPBandMF(..., fresh_noise_history=True) (charged as a "
        "new segment of the ledger: the participations of the steps before and after "
        f"are counted apart). Training was not started. Received: noise_state={path!r}"
    )


@keras.saving.register_keras_serializable(package="tfdp")
class DPBandMF(DPOptimizer):
    """Any Keras optimizer, private with banded correlated noise (DP-BandMF).

    Two ways to train, chosen by what `fit` gets:

    - Fixed order, `model.fit(dataset, epochs=...)` on a `tf.data.Dataset`
      of batches in a fixed order (see `tfdp.data.fixed_order` for the
      pipelines that qualify; `fit` refuses the others by name). The
      ledger counts one Gaussian mechanism of `noise_multiplier` per epoch
      started (each record takes part once per epoch; P steps per epoch
      must be >= `bands`), under the zero-out relation: the guarantee
      protects a record's content, with the number of records and their
      positions public.
    - Amplified, `model.fit(x, y, batch_size=B, epochs=...)` on arrays,
      memmaps or a `tfdp.data.RecordSource` (cyclic Poisson sampling,
      `tfdp.data.cyclic_poisson`): each record gets a secret group in
      {0, ..., bands - 1}; step t of the stream samples only group
      t mod bands, each member with probability q = B * bands / N. So
      `batch_size` B is a step's EXPECTED batch size, as for DP-SGD (it
      must be <= N / bands), and an epoch has round(N / B) steps unless
      `steps_per_epoch` is given. The ledger counts one DP-SGD step event
      (Poisson rate q, `noise_multiplier`) per `bands` steps
      (`amplified_segment`), under add-or-remove. For a target epsilon:
      `tfdp.accounting.bandmf.calibrate_amplified(epsilon, delta, steps,
      bands, q)`. The groups' key is secret sampling randomness: it is kept
      with the noise history (and in `noise_state`), so a resumed stream
      keeps every record in its group.

    Each step clips every example's gradient to `l2_norm_clip`, sums, adds
    the banded noise w_t and divides by the (expected) batch size.

    Memory: the last `bands - 1` noise vectors, (bands - 1) x the number of
    trained parameters in float32. They are secret (whoever holds them can
    subtract them), so they are never in model files or exports; with
    `noise_state` they are written to that file (permissions 0600) at each
    epoch's end and when training ends (the file it replaces is kept as
    `<noise_state>.prev`), and read from it when `fit` resumes the run (from
    the `.prev` file when the model is one save behind: a run killed after
    writing the state and before its `BackupAndRestore` backup). A `fit` that continues a model trained by DP-BandMF needs the
    stream's state: from this optimizer (a second `fit` in the same process),
    from `noise_state` (after a restart: the file must be at the model's
    step), or a new stream with `fresh_noise_history=True`; otherwise `fit`
    refuses before the first step.

    Under a tf.distribute strategy with R replicas (one machine's devices,
    or several workers) every replica draws the same z_t (the same key; with
    several workers an unseeded optimizer takes its key from the chief's
    shared secret, `agree_with_workers`), keeps its own copy of the noise
    history, runs the same recurrence, and adds w_t / R to the clipped sum
    of its share of the batch; Keras's sum of the replicas' gradients
    carries w_t once, as on one device. A fixed-order batch is split
    row-wise over the replicas (`tfdp.distribute.distribute_fixed_batches`;
    with several workers each reads the pipeline once before training and
    the workers compare what they read: their pipelines must give the same
    order); cyclic Poisson draws are shared and split as DP-SGD's are. The
    history then takes (bands - 1) x the parameters on every replica, and
    each step rewrites it whole (a replica's copy cannot be updated in place).

    Args:
        inner_optimizer: a `keras.optimizers.Optimizer`; it post-processes
            the noisy gradients.
        l2_norm_clip: clipping bound C > 0.
        noise_multiplier: sigma > 0: z_t has std sigma * C per coordinate.
        bands: b >= 1, the number of steps a noise draw is spread over (1 is
            DP-SGD's noise). Larger b cancels more noise in the iterates and
            needs b - 1 noise vectors of memory; it must not exceed the
            steps per epoch.
        coefficients: optional c_0 ... c_{b-1} (normalised to unit norm).
            Default: `tfdp.mechanisms.bandmf.optimal_coefficients(b, n)`
            for the n steps the first `fit` plans ((epochs - initial_epoch)
            x steps per epoch), then fixed (saved with the optimizer's
            config).
        noise_state: optional path of the secret file holding the noise
            stream (written during `fit`, read to resume).
        fresh_noise_history: if True, the first `fit` starts a new noise
            stream even where the model's last steps ran another one.
        weight_decay, weight_decay_placement, seed, name: see `DPOptimizer`.

    Example:

    >>> import keras, tfdp
    >>> opt = tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.5), l2_norm_clip=1.0,
    ...                                noise_multiplier=2.0, bands=4)
    >>> opt.bands, opt.coefficients is None
    (4, True)
    """

    _fixed_settings = DPOptimizer._fixed_settings + (
        "bands", "noise_state", "fresh_noise_history",
    )

    adaptive_clipping_unsupported = (
        "its correlated noise over several steps is analysed at one fixed clip norm."
    )
    user_level_unsupported = (
        "its participation accounting counts records in a fixed order or cyclic "
        "Poisson groups of records, not people."
    )
    # `DPModel.fit` hands a tf.data.Dataset to `fixed_order_data` instead of
    # refusing it.
    trains_on_datasets = True
    # Its rounds are not DP-SGD steps: `tfdp.accounting.bandmf` calibrates them.
    calibrates_noise_at_fit = False

    def __init__(
        self,
        inner_optimizer,
        l2_norm_clip,
        noise_multiplier,
        bands,
        coefficients=None,
        noise_state=None,
        fresh_noise_history=False,
        weight_decay=0.0,
        weight_decay_placement="before_clip",
        seed=None,
        name=None,
        **kwargs,
    ):
        if isinstance(bands, bool) or not isinstance(bands, (int, np.integer)) or bands < 1:
            raise ValueError(f"Expected `bands` to be an int >= 1. Received: bands={bands!r}")
        if coefficients is not None:
            coefficients = bandmf.check_coefficients(coefficients)
            if len(coefficients) != bands:
                raise ValueError(
                    f"Expected {bands} coefficients (one per band). Received: "
                    f"coefficients of length {len(coefficients)}, bands={bands}"
                )
        if noise_state is not None and not isinstance(noise_state, (str, bytes)) and not hasattr(
            noise_state, "__fspath__"
        ):
            raise TypeError(
                f"Expected `noise_state` to be a file path or None. Received: noise_state={noise_state!r}"
            )
        if not isinstance(fresh_noise_history, bool):
            raise TypeError(
                "Expected `fresh_noise_history` to be a bool. Received: "
                f"fresh_noise_history={fresh_noise_history!r}"
            )
        super().__init__(
            inner_optimizer, l2_norm_clip, noise_multiplier, weight_decay=weight_decay,
            weight_decay_placement=weight_decay_placement, seed=seed, name=name, **kwargs,
        )
        self.bands = int(bands)
        self.noise_state = None if noise_state is None else str(noise_state)
        self.fresh_noise_history = fresh_noise_history
        self.__dict__["_coefficients"] = coefficients
        self.__dict__["_stream"] = None

    @property
    def coefficients(self):
        """The strategy's coefficients (unit norm), or None until the first
        `fit` computes them; fixed from then on."""
        coefficients = self.__dict__["_coefficients"]
        return None if coefficients is None else coefficients.copy()

    def _fix_coefficients(self, planned_steps, from_state=None):
        current = self.__dict__["_coefficients"]
        if from_state is not None:
            from_state = bandmf.check_coefficients(from_state)
            if current is not None and not np.allclose(current, from_state, rtol=0, atol=1e-12):
                raise _noise_state_error(
                    "The noise state was written with other strategy coefficients than "
                    "this optimizer's.", self.noise_state,
                )
            current = from_state
        elif current is None:
            current = bandmf.optimal_coefficients(self.bands, max(self.bands, planned_steps))
        bandmf.check_stable(current, planned_steps)
        self.__dict__["_coefficients"] = current
        return current

    # -- the private step ---------------------------------------------------

    def noisy_gradients(self, sums, step_info, variables):
        """Adds step t's banded noise w_t to the clipped sums, divides by B.

        Draws z_t with `dpsgd.gaussian_noise_like` (the same draws DPOptimizer
        adds), solves row t of C w = z with the stream's last b - 1 noise
        vectors, stores w_t in their place and counts the step.

        Args:
            sums: clipped sums (of one batch, or added over its chunks).
            step_info: the step's dict ("expected_batch_size").
            variables: the variables `sums` are aligned with.

        Returns:
            The noisy mean gradients.
        """
        stream = self.__dict__["_stream"]
        if stream is None:
            raise ValueError(
                "DPBandMF has no noise stream: train it with DPModel.fit (on a "
                "tf.data.Dataset in a fixed order, or on arrays or a record source), "
                "which starts or resumes the stream."
            )
        coefficients = tf.constant(self.__dict__["_coefficients"], tf.float32)
        # Under R replicas each draws the same z_t (`noise_seed`), runs the
        # recurrence on its own copy of the history and adds w_t / R: Keras's
        # sum over the replicas carries w_t once.
        share = distribute.replica_share()
        draws = dpsgd.gaussian_noise_like(sums, self.noise_stddev(), self.noise_seed())
        step = stream.step.read_value()
        noise = []
        for index, draw in enumerate(draws):
            history = stream.history[index] if stream.history else None
            value, slot = bandmf.correlated_noise(
                draw, None if history is None else history.read_value(), coefficients, step
            )
            if history is not None:
                stream.write(index, value, slot)
            noise.append(value * share)
        stream.step.assign_add(1)
        batch = step_info["expected_batch_size"]
        grads = [(s + w) / tf.cast(batch, s.dtype) for s, w in zip(sums, noise)]
        if self.weight_decay and self.weight_decay_placement == "after_noise":
            grads = [g + o * share for g, o in zip(grads, self._decay_offsets(variables))]
        return grads

    def noise_seed(self):
        """This step's noise seed: `step_key`, the same on every replica
        (each adds 1/R of the same w_t, see `noisy_gradients`)."""
        return self.step_key()

    # -- accounting -------------------------------------------------------------

    def step_event(self, sampling_probability):
        """Refused: a DP-BandMF step is not one release on its own.

        Its ledger segments count rounds (`fixed_order_segment`,
        `amplified_segment`).
        """
        raise ValueError(
            "DPBandMF's steps are accounted in rounds, not one event per step: use "
            "fixed_order_segment() or amplified_segment(). Received: "
            f"sampling_probability={sampling_probability!r}"
        )

    def fixed_order_segment(self, steps_per_epoch):
        """Ledger segment for a fixed order of P steps per epoch: (event,
        steps_per_round, relation) for `PrivacyLedger.begin_steps`.

        Example:

        >>> import keras, tfdp
        >>> opt = tfdp.optimizers.DPBandMF(keras.optimizers.SGD(), 1.0, 2.0, bands=4)
        >>> opt.fixed_order_segment(30)
        (GaussianDpEvent(noise_multiplier=2.0), 30, 'zero_out')
        """
        bandmf_accounting.check_separation(steps_per_epoch, self.bands)
        return (
            bandmf_accounting.fixed_order_round_event(self.noise_multiplier),
            int(steps_per_epoch), ZERO_OUT,
        )

    def amplified_segment(self, sampling_probability):
        """Ledger segment for cyclic Poisson sampling with rate q in the
        active group (a record's group is active every `bands` steps).

        Example:

        >>> import keras, tfdp
        >>> opt = tfdp.optimizers.DPBandMF(keras.optimizers.SGD(), 1.0, 2.0, bands=4)
        >>> opt.amplified_segment(0.05)[1:]
        (4, 'add_or_remove')
        """
        return (
            bandmf_accounting.amplified_round_event(self.noise_multiplier, sampling_probability),
            self.bands, "add_or_remove",
        )

    # -- the data -------------------------------------------------------------

    def fixed_order_data(self, x, y=None, batch_size=None, sample_weight=None,
                         class_weight=None, validation_split=0.0, steps_per_epoch=None,
                         epochs=1, initial_epoch=0):
        """Checks `fit`'s arguments for a tf.data pipeline in a fixed order.

        Called by `DPModel.fit` with its arguments when `x` is a
        `tf.data.Dataset`. Refuses, by name, a pipeline whose order is not
        fixed (`tfdp.data.fixed_order`), one with fewer batches than `bands`,
        and arguments a pipeline carries itself.

        Returns:
            A `tfdp.data.fixed_order.FixedOrderData`.
        """
        for name, value in (("y", y), ("sample_weight", sample_weight),
                            ("class_weight", class_weight)):
            if value is not None:
                raise ValueError(
                    f"A tf.data.Dataset holds the labels and weights: pass it as x alone. "
                    f"Received: {name} of type {type(value).__name__}"
                )
        if validation_split:
            raise ValueError(
                "validation_split cannot split a tf.data.Dataset; pass validation_data. "
                f"Received: validation_split={validation_split}"
            )
        planned = max(1, int(epochs) - int(initial_epoch))
        data = FixedOrderData(x, planned_steps=0)
        if batch_size is not None and batch_size != data.batch_size:
            raise ValueError(
                f"The dataset's batches hold {data.batch_size} records; leave batch_size "
                f"unset (the pipeline batches). Received: batch_size={batch_size!r}"
            )
        if steps_per_epoch is not None and steps_per_epoch != data.steps_per_epoch:
            raise ValueError(
                f"In a fixed order an epoch is one pass over the {data.steps_per_epoch} "
                "batches (the accounting counts a participation per epoch); leave "
                f"steps_per_epoch unset. Received: steps_per_epoch={steps_per_epoch!r}"
            )
        bandmf_accounting.check_separation(data.steps_per_epoch, self.bands)
        data.planned_steps = planned * data.steps_per_epoch
        self.__dict__["_fixed_order"] = data  # this fit's data, for `run_settings`
        return data

    def plan_epochs(self, epochs, initial_epoch=0):
        """Called by `DPModel.fit` on arrays or a source: the epochs the
        call plans, for the strategy's coefficients (fixed at the first
        `fit`)."""
        self.__dict__["_planned_epochs"] = max(1, int(epochs) - int(initial_epoch))
        self.__dict__["_fixed_order"] = None  # this fit samples arrays or a source

    def make_training_data(self, model, arrays, batch_size, steps_per_epoch=None, budgets=()):
        """The training stream for `DPModel.fit`; opens the ledger segment.

        A `FixedOrderData` (a tf.data pipeline) trains in its fixed order;
        arrays, memmaps or a record source are sampled cyclically
        (`tfdp.data.cyclic_poisson`, expected batch size `batch_size`).
        Starts a new noise stream, continues this optimizer's, or resumes the
        one in `noise_state`; refuses to start afresh where the model's last
        steps ran a DP-BandMF stream that is not continued (unless
        `fresh_noise_history`). Opens the ledger segment
        (`fixed_order_segment` or `amplified_segment`), a new segment for a
        new stream. Under several replicas the batches are split over them
        (`tfdp.distribute.distribute_fixed_batches`, or
        `distribute_poisson_batches` for the cyclic draws).

        Returns:
            (dataset, steps per Keras epoch): the infinite stream from the
            model's position.
        """
        strategy = model.distribute_strategy
        replicas = strategy.num_replicas_in_sync
        if self.noise_state is not None:  # before anything is charged
            bandmf_state.check_path(self.noise_state)
        self.bind_model_steps(model)
        variables = list(model.trainable_variables)
        ledger = model.privacy
        now = ledger.steps
        if isinstance(arrays, FixedOrderData):
            num_examples = len(arrays)
            layout = bandmf_state.fixed_order_layout(arrays.steps_per_epoch, arrays.batch_size)
            segment = self.fixed_order_segment(arrays.steps_per_epoch)
            planned = arrays.planned_steps
        else:
            num_examples = len(tf.nest.flatten(arrays)[0])
            q = cyclic_sampling_probability(batch_size, self.bands, num_examples)
            layout = bandmf_state.cyclic_poisson_layout(num_examples, batch_size)
            segment = self.amplified_segment(q)
            if steps_per_epoch is None:
                steps_per_epoch = default_steps_per_epoch(num_examples, batch_size)
            planned = self.__dict__.get("_planned_epochs", 1) * steps_per_epoch
        shared = None
        if replicas > 1:
            shared = self.workers_seed(model, num_examples, batch_size, steps_per_epoch)
            self._draw_fit_nonce(model, shared)  # every replica draws the same z_t
        stream, new = self._stream_for(model, variables, layout, segment, planned, now, shared)
        if isinstance(arrays, FixedOrderData) and distribute.num_workers(strategy) > 1:
            stream.order_check.adopt(arrays.first_pass()[0])  # the pass the workers compared
        event, per_round, relation = segment
        ledger.begin_steps(event, steps_per_round=per_round, relation=relation, new_segment=new)
        if isinstance(arrays, FixedOrderData):
            position = now - stream.start

            def make_stream():
                return arrays.stream(position, stream.order_check)

            if replicas > 1:
                return distribute.distribute_fixed_batches(strategy, make_stream), \
                    arrays.steps_per_epoch
            return make_stream(), arrays.steps_per_epoch
        return self._amplified_stream(model, arrays, batch_size, steps_per_epoch, stream, now,
                                      shared)

    def _amplified_stream(self, model, arrays, batch_size, steps_per_epoch, stream, now, shared):
        """Cyclic Poisson batches from model step `now` (groups from the
        stream); under several replicas every worker draws with the same
        key (a user seed, or `shared`, the chief's secret) and each replica
        gets its share of the draw."""
        strategy = model.distribute_strategy
        replicas = strategy.num_replicas_in_sync
        seed = self.sampling_seed(now)
        if seed is None:
            seed = shared
        fixed_shape = bool(model.jit_compile) or replicas > 1
        sampler = CyclicPoissonSampler(
            stream.layout["num_examples"], batch_size, self.bands, stream.groups_key,
            stream_start=stream.start, steps_per_epoch=steps_per_epoch,
            seed=seed, fixed_shape=fixed_shape,
            multiple=8 if fixed_shape else draw_multiple(batch_size),
        )

        def to_element(batch, mask):
            return batch, {"mask": mask, "expected_batch_size": tf.constant(float(batch_size))}

        if replicas > 1:
            dataset = distribute.distribute_poisson_batches(
                strategy, sampler, arrays, to_element, first_step=now)
            return dataset, sampler.steps_per_epoch
        dataset = make_dataset(sampler, arrays, first_step=now, repeat=True)
        return dataset.map(to_element), sampler.steps_per_epoch

    # -- several workers ----------------------------------------------------------

    def agree_with_workers(self, model, num_examples, batch_size, steps_per_epoch=None):
        """`DPOptimizer.agree_with_workers`, and then, for an unseeded
        optimizer, the noise key from the chief's shared secret: every
        replica of every worker must draw the same z_t (`noisy_gradients`).
        The key is taken once (the traced step keeps it)."""
        shared = super().agree_with_workers(model, num_examples, batch_size, steps_per_epoch)
        if shared is not None and self.seed is None and not self.__dict__.get("_shared_key"):
            self._noise_key = np.random.default_rng([shared, 0xBA4D]).integers(
                np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=2, dtype=np.int64)
            self.__dict__["_shared_key"] = True
        return shared

    def run_settings(self, model, num_examples, batch_size, steps_per_epoch):
        """`DPOptimizer.run_settings` with the ledger segment for
        "mechanism"; the noise seed (a `tfdp.distribute.SecretSetting`:
        every replica adds 1/R of the same w_t, so all must draw z_t from
        one key: one seed, or all unseeded to take the chief's); until the
        coefficients are fixed, the planned steps they are optimized for;
        for a fixed order under several workers, also the digest of the
        pipeline's first pass (`FixedOrderData.first_pass`): every worker
        must read the same batches in the same order."""
        settings = super().run_settings(model, num_examples, batch_size, steps_per_epoch)
        settings["noise seed"] = distribute.SecretSetting(
            "unseeded" if self.seed is None else f"seed {int(self.seed)}")
        data = self.__dict__.get("_fixed_order")
        if self.__dict__["_coefficients"] is None:
            settings["planned steps"] = (
                data.planned_steps if data is not None
                else self.__dict__.get("_planned_epochs", 1) * steps_per_epoch)
        if data is not None and distribute.num_workers(model.distribute_strategy) > 1:
            settings["pipeline (SHA-256 of its first pass)"] = data.first_pass()[1]
        return settings

    def mechanism_setting(self, num_examples, batch_size):
        """The ledger segment this fit opens (a text every worker compares)."""
        data = self.__dict__.get("_fixed_order")
        if data is not None:
            return repr(self.fixed_order_segment(data.steps_per_epoch))
        q = cyclic_sampling_probability(batch_size, self.bands, num_examples)
        return repr(self.amplified_segment(q))

    def _stream_for(self, model, variables, layout, segment, planned, now, shared=None):
        """(the stream to train, whether it is new); `shared` is the workers'
        secret seed under several replicas (for an unseeded groups key).

        The model's record of the stream its steps ran
        (`tfdp.models.training_state.NoiseStreamRecord`) then names this
        fit too (`_begin_fit`)."""
        record = model._noise_stream_record
        stream = self._pick_stream(model, variables, layout, segment, planned, now, shared,
                                   record.lineage)
        token = secrets.token_hex(8) if shared is None else hashlib.sha256(
            f"tfdp.DPBandMF fit {shared} {now}".encode("utf-8")).hexdigest()[:16]
        record.lineage = stream[0].begin_fit(now, token)
        return stream

    def _pick_stream(self, model, variables, layout, segment, planned, now, shared, lineage):
        stream = self.__dict__["_stream"]
        strategy = model.distribute_strategy
        open_segment = model.privacy.open_segment
        fits = stream is not None and stream.matches(variables, self.bands, layout)
        if fits and stream.model_step() == now and _continues(open_segment, segment, stream.start) \
                and bandmf_state.lineage_matches(stream.lineage, lineage, now):
            return stream, False
        ran_bandmf = (
            open_segment is not None and now > open_segment[1]
            and (open_segment[3] == ZERO_OUT or open_segment[2] > 1)
        )
        if self.fresh_noise_history and not self.__dict__.get("_fresh_used", False):
            self.__dict__["_fresh_used"] = True
            return self._new_stream(variables, layout, planned, now, shared, strategy), True
        # Steps a PrivacyJournal charged after the model's weights: their noise
        # is lost with the kill, so the stream cannot go on unless the state
        # file holds it at `now`.
        recovered = _journal_recovered(model, now) if ran_bandmf else None
        if self.noise_state is not None and ran_bandmf and any(
                os.path.exists(p) for p in _state_files(self.noise_state)):
            try:
                return self._load_stream(variables, layout, planned, now, open_segment, segment,
                                         strategy, lineage), False
            except _StateBehind:
                if recovered is None:
                    raise
        if recovered is not None:
            warnings.warn(_restart_message(recovered, now, self.noise_state), UserWarning,
                          stacklevel=2)
            return self._new_stream(variables, layout, planned, now, shared, strategy), True
        if ran_bandmf:
            where = (
                f"the file {self.noise_state!r} does not exist."
                if self.noise_state is not None else "no noise_state was given."
            )
            if stream is not None and stream.model_step() == now:
                raise _noise_state_error(
                    f"This optimizer holds the model's DP-BandMF noise stream at step {now}, "
                    f"but {_what_changed(stream, variables, layout)}: a noise stream "
                    "continues only on the data layout and variables it began with (the "
                    "ledger's rounds count a record's participations in it). Train on with "
                    "the layout it began with, or start a new stream on this one.",
                    self.noise_state,
                )
            raise _noise_state_error(
                f"This model's last {now - open_segment[1]} steps ran a DP-BandMF noise "
                f"stream, but this optimizer does not hold it at step {now}, and {where}",
                self.noise_state,
            )
        return self._new_stream(variables, layout, planned, now, shared, strategy), True

    def _new_stream(self, variables, layout, planned, now, shared=None, strategy=None):
        self._fix_coefficients(planned)
        groups_key = None
        if layout["order"] == bandmf_state.CYCLIC_POISSON:
            # secret, like the sampling key: OS entropy unless the optimizer is
            # seeded; every worker's the same (the chief's) under several
            seed = self.seed if self.seed is not None else shared
            groups_key = sampling_key(None if seed is None else [seed, now, 1])
        # Under several replicas every worker runs the same stream: one id
        # (from the shared secret), so workers saving the same moment to one
        # `noise_state` path see the same state, not another stream's.
        stream_id = None if shared is None else hashlib.sha256(
            f"tfdp.DPBandMF stream {shared} {now}".encode("utf-8")).hexdigest()[:16]
        stream = self.__dict__["_stream"]
        if stream is not None and stream.matches(variables, self.bands, stream.layout):
            stream.reset(now, layout, groups_key, stream_id)
        else:  # the traced step captures these variables: made once per optimizer
            several = strategy is not None and strategy.num_replicas_in_sync > 1
            stream = bandmf_state.NoiseStream(variables, self.bands, now, layout, groups_key,
                                              stream_id, strategy=strategy if several else None)
            self.__dict__["_stream"] = stream
        return stream

    def _load_stream(self, variables, layout, planned, now, open_segment, expected, strategy,
                     lineage):
        path, (meta, history, fingerprints) = self._state_at(
            now, open_segment, expected, lambda meta, path: self._check_state(meta, path, layout),
            lineage)
        shapes = [tuple(v.shape) for v in variables]
        if [tuple(h.shape[1:]) for h in history] != (shapes if self.bands > 1 else []):
            raise _noise_state_error(
                "The noise state's noise vectors do not match this model's trainable "
                "variables.", path,
            )
        self._fix_coefficients(planned, from_state=meta["settings"]["coefficients"])
        stream = self._new_stream(variables, layout, planned, now, strategy=strategy)
        bandmf_state.restore(stream, meta, history, fingerprints)
        return stream

    def _check_state(self, meta, path, layout):
        """Refuses a state written with other privacy settings or data."""
        settings = meta.get("settings", {})
        mine = self._state_settings()
        differ = sorted(
            key for key in ("bands", "noise_multiplier", "l2_norm_clip")
            if settings.get(key) != mine[key]
        )
        if differ:
            raise _noise_state_error(
                f"The noise state was written with other settings ({', '.join(differ)}: "
                f"{ {k: settings.get(k) for k in differ} }).", path,
            )
        if meta["layout"] != layout:
            raise _noise_state_error(
                f"The noise state's data layout is {_describe(meta['layout'])}, this "
                f"fit's {_describe(layout)}.", path,
            )

    def _state_at(self, now, open_segment, expected, check, lineage):
        """(path, loaded state) of this model's noise state at model step
        `now`: the file `noise_state`, or the previous one it replaced (a run
        killed after writing the state and before writing its backup resumes
        from that backup, one epoch back). Only a state of the model's
        `lineage` (its stream, and the fits its weights come from:
        `bandmf_state.lineage_matches`) is taken: never another run's, nor
        a branch of this run that the weights did not take. `check(meta,
        path)` refuses a state of other settings or data."""
        path = bandmf_state.resolved(self.noise_state)
        if lineage is None:
            raise _noise_state_error(
                "This model's weights do not record which DP-BandMF noise stream its steps "
                "ran (they were saved by an older tfdp, or put together from another "
                "model's variables), so no noise state can be shown to be this run's own.",
                path,
            )
        own_id = lineage[0][1]
        files = [p for p in _state_files(path) if os.path.exists(p)]
        found = []  # (path, loaded state, its stream id, its lineage)
        for candidate in files:
            loaded = bandmf_state.load(candidate)
            saved = loaded[0].get("lineage")
            found.append((candidate, loaded, None if saved is None else saved[0][1], saved))
            if saved is None or saved[0][1] != own_id:
                continue
            if candidate == path:
                check(loaded[0], path)
            at_now = _saved_step(loaded[0]) == now and _continues(
                open_segment, expected, int(loaded[0]["start"]))
            if at_now and bandmf_state.lineage_matches(saved, lineage, now):
                check(loaded[0], candidate)
                return candidate, loaded
        own = [f for f in found if f[2] == own_id]
        branches = [f for f in own if _saved_step(f[1][0]) == now]
        if branches:
            candidate, _, _, saved = branches[0]
            raise _noise_state_error(
                f"The noise state {candidate!r} is at model step {now}, of this run's noise "
                f"stream {own_id}, but of another branch of it: from model step "
                f"{bandmf_state.divergence(saved, lineage)} on, its noise history was drawn by "
                "another fit than the one this model's weights come from (the weights were "
                "rolled back to, or resumed from, an earlier file, and the run also went on "
                "from there). Resume from the weights saved with that state, or start a new "
                "stream.", candidate,
            )
        if own:
            older = ""
            if len(own) > 1:
                older = f" (and the previous one, {own[1][0]!r}, at step {_saved_step(own[1][1][0])})"
            raise _noise_state_error(
                f"The noise state was saved at model step {_saved_step(own[0][1][0])}{older}, "
                f"but the model is at step {now} (the model and the noise state come from "
                "different moments of the run; where a PrivacyJournal charged the steps "
                "after the state, the fit right after its recover(model), or the rerun fit "
                "with BackupAndRestore, starts a new stream by itself).", own[0][0],
                kind=_StateBehind,
            )
        others = [f for f in found if f[2] is not None]
        if others:
            written = ", ".join(f"{f[0]!r} by the run of noise stream {f[2]}" for f in others)
            raise _noise_state_error(
                f"The noise state was written by another run ({written}); this model's steps "
                f"ran the noise stream {own_id}. Two runs that share a noise_state path "
                "overwrite each other's secret state, and continuing another run's noise "
                "history (or its record groups) would void the guarantee: give each run its "
                "own noise_state path, and resume this model with the file its run wrote.",
                path,
            )
        raise _noise_state_error(
            f"The noise state {path!r} does not record which run wrote it (it was written "
            "by an older tfdp), so it cannot be shown to be this run's own.", path,
        )

    def _state_settings(self):
        coefficients = self.__dict__["_coefficients"]
        return {
            "bands": self.bands,
            "noise_multiplier": self.noise_multiplier,
            "l2_norm_clip": self.l2_norm_clip,
            "coefficients": None if coefficients is None else [float(c) for c in coefficients],
        }

    def save_noise_state(self, path=None):
        """Writes the noise stream to `path` (default: `noise_state`).

        The file is a secret (it lets its holder subtract the noise from the
        released iterates): keep it like a key, apart from the model.

        Args:
            path: the file; default the optimizer's `noise_state`.

        Raises:
            ValueError: without a stream (before the first `fit`) or a path.
        """
        path = self.noise_state if path is None else str(path)
        stream = self.__dict__["_stream"]
        if path is None or stream is None:
            raise ValueError(
                "Nothing to save: the noise stream starts with the first fit, and a path "
                f"is needed. Received: path={path!r}, stream started={stream is not None}"
            )
        bandmf_state.save(stream, path, self._state_settings())

    def check_backup(self, backup):
        """Refuses a `keras.callbacks.BackupAndRestore` with an integer
        `save_freq` when the stream is kept in `noise_state`: the state is
        written at epoch ends, so a backup from the middle of an epoch could
        never resume the stream. Called by `DPModel.fit` before it restores
        the backup (`tfdp.models.restore.restore_backups`), before any step.

        Example:

        >>> import keras, tfdp
        >>> opt = tfdp.optimizers.DPBandMF(keras.optimizers.SGD(), 1.0, 2.0, bands=4,
        ...                                noise_state="run/noise_state.npz")
        >>> opt.check_backup(keras.callbacks.BackupAndRestore("run/backup", save_freq=5))
        Traceback (most recent call last):
        ...
        ValueError: BackupAndRestore(save_freq=5) saves in the middle of epochs, ...
        """
        if self.noise_state is None or backup.save_freq == "epoch":
            return
        raise ValueError(
            f"BackupAndRestore(save_freq={backup.save_freq!r}) saves in the middle of epochs, "
            "and DP-BandMF's noise state (noise_state) is written at epoch ends: a run "
            "resumed from such a backup could never continue its noise stream. Use "
            "BackupAndRestore(save_freq=\"epoch\") (the default) with noise_state, or drop "
            "noise_state and resume with DPBandMF(..., fresh_noise_history=True) (a new "
            "stream, a new ledger segment). Training was not started. Received: "
            f"save_freq={backup.save_freq!r}, noise_state={self.noise_state!r}"
        )

    def training_callbacks(self):
        """With `noise_state`: a callback writing it at each epoch's end and
        when training ends."""
        if self.noise_state is None:
            return []
        return [_NoiseStateWriter(self)]

    # -- serialization --------------------------------------------------------

    def get_config(self):
        """The settings, with the strategy's coefficients once fixed; without
        `seed`, `noise_state` and `fresh_noise_history` (a file path and a
        one-run choice, not properties of the optimizer)."""
        config = super().get_config()
        config.update(bands=self.bands, coefficients=self.coefficients)
        if config["coefficients"] is not None:
            config["coefficients"] = [float(c) for c in config["coefficients"]]
        return config


def _state_files(path):
    """The noise state and the previous one it replaced (a save killed
    between its two renames leaves only the previous one)."""
    path = bandmf_state.resolved(path)
    return [path, bandmf_state.previous_path(path)]


def _saved_step(meta):
    """The model step a saved noise state continues at."""
    return int(meta["start"]) + int(meta["steps"])


def _describe(layout):
    if layout.get("order") == bandmf_state.CYCLIC_POISSON:
        return (f"cyclic Poisson sampling of {layout['num_examples']} records, expected "
                f"batch size {layout['batch_size']:g}")
    return f"a fixed order of {layout['steps_per_epoch']} batches of {layout['batch_size']}"


def _what_changed(stream, variables, layout):
    """What keeps `stream` from continuing on `variables` and `layout`."""
    if stream.layout != layout:
        return f"it runs on {_describe(stream.layout)}, and this fit's data is {_describe(layout)}"
    if [tuple(v.shape) for v in variables] != stream.shapes:
        return ("it was made for other trainable variables (shapes "
                f"{stream.shapes}; now {[tuple(v.shape) for v in variables]})")
    return "the model's weights come from another run or another branch of this one"


def _journal_recovered(model, now):
    """The model step of the weights whose ledger a `PrivacyJournal` moved
    on to `now` (`PrivacyJournal.recover`), or None."""
    recovery = getattr(model, "_journal_recovery", None)
    if recovery is None or recovery[1] != now or recovery[0] >= now:
        return None
    return recovery[0]


def _restart_message(weights_step, now, path):
    where = ("no noise_state was given" if path is None
             else f"the noise state {path!r} does not hold the stream at step {now}")
    return (
        f"The PrivacyJournal charged {now - weights_step} steps that ran (or were journaled "
        f"ahead) after the model's step {weights_step}; their DP-BandMF noise was drawn from "
        f"the killed run's stream and lost with it ({where}), so that stream cannot go on. "
        f"This fit starts a new DP-BandMF noise stream at model step {now}, charged as a new "
        "segment of the ledger (as fresh_noise_history=True: the killed stream's rows end "
        "at the journal's count, and the two streams' participations are counted apart); a "
        "fixed order restarts from its first batch."
    )


def _continues(open_segment, expected, start):
    """Whether the ledger's open segment is the stream that began at `start`."""
    if open_segment is None:
        return False
    event, segment_start, per_round, relation = open_segment
    return (event, per_round, relation) == expected and segment_start == start


class _NoiseStateWriter(keras.callbacks.Callback):
    """Writes the optimizer's noise stream to its `noise_state` file."""

    def __init__(self, optimizer):
        super().__init__()
        self._optimizer = optimizer

    def on_epoch_end(self, epoch, logs=None):
        self._optimizer.save_noise_state()

    def on_train_end(self, logs=None):
        self._optimizer.save_noise_state()

