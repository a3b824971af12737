"""`DPModel` and `DPSequential`: Keras models that train with DP.

They differ from `keras.Model` / `keras.Sequential` in training only:
`fit` feeds Poisson-sampled batches (fixed padded shape and a mask) and
`train_step` computes per-example gradients and hands them to a tfdp
optimizer, which clips, noises and applies them. Each step is counted in the
model's privacy ledger (`model.privacy`), saved with the model and its
checkpoints. Prediction, evaluation, saving and export are plain Keras.
"""

import contextlib
import functools
import json
import logging
import os
import weakref

import keras
import numpy as np
import tensorflow as tf
from keras.src.models import cloning
from keras.src.models.functional import Functional
from keras.src.saving import object_registration
from keras.src.utils.tracking import no_automatic_dependency_tracking

from tfdp import distribute, preprocessing
from tfdp.accounting import PrivacyLedger
from tfdp.data import interrupts, sources
from tfdp.data.fixed_order import FixedOrderData
from tfdp.models import (
    chunked_step, float32_precision, input_checks, multi_output, released_writes, state_writes,
    user_level, weight_ledgers,
)
from tfdp.models.atomic_save import atomic_write, is_local_path
from tfdp.models.augmentation import step_key as augmentation_key
from tfdp.models.chosen_checkpoint import note_save
from tfdp.models.counter_reads import read_counter
from tfdp.models.functional_class import make_functional, wants_functional
from tfdp.models.jit import resolve_jit_compile
from tfdp.models.restore import LedgerGuard, naming_the_file
from tfdp.models.step_errors import without_record_values
from tfdp.models.task_inputs import check_graph_arguments, check_no_text, text_as_tensors
from tfdp.models.tied_layers import retie, tied_layers
from tfdp.models.training_state import (
    LoraVariables, NoiseStreamRecord, restore_training_state, training_state,
)
from tfdp.per_example import (
    METHODS,
    check_per_example_support,
    compute_per_example_gradients,
)
from tfdp.per_example.validation import path_line

logger = logging.getLogger("tfdp")

_LEDGER_KEY = "privacy_ledger"
DEFAULT_DELTA = 1e-5


def _first_dim(arrays):
    return len(tf.nest.flatten(arrays)[0])


def _take(arrays, index):
    return tf.nest.map_structure(lambda a: a[index], arrays)


_NOT_SAMPLEABLE = (
    "DP training Poisson-samples every batch (the privacy accounting holds only "
    "for Poisson sampling), which needs random access to the records; a tf.data "
    "pipeline, PyDataset or generator cannot be sampled. Pass NumPy arrays "
    "(memmaps too: np.load(path, mmap_mode='r') is read row by row) or a "
    "tfdp.data.RecordSource (any object with len() and [i]), or convert the "
    "pipeline once: tfdp.data.write_records(dataset, path, batched=True) for a "
    "batched pipeline (dataset.batch(...): each example becomes one record; "
    "without batched=True each batch would be stored as one record), "
    "tfdp.data.write_records(dataset, path) for one of single examples, then "
    "model.fit(tfdp.data.read_records(path), ...). A pipeline read in a fixed "
    "order trains with tfdp.optimizers.DPBandMF instead. Received: x of type {}"
)


class DPTrainingMixin:
    """The private training path shared by `DPModel` and `DPSequential`."""

    # A subclass that overrides train_step is refused by fit unless it sets
    # this to True: its step only hands each record's own data to
    # super().train_step() and releases nothing more (`_check_train_step`).
    train_step_is_private = False

    def _init_dp(self, per_example_gradients):
        if per_example_gradients not in METHODS:
            raise ValueError(
                f"Expected `per_example_gradients` in {METHODS}. Received: "
                f"per_example_gradients={per_example_gradients!r}"
            )
        self.per_example_gradients = per_example_gradients
        self._dp_steps = self.add_weight(
            shape=(),
            dtype="int64",
            initializer="zeros",
            trainable=False,
            name="dp_steps",
            aggregation="only_first_replica",
        )
        self._privacy_ledger = PrivacyLedger(step_counter=self._read_dp_steps)
        self._per_example_loss = None
        self._physical_batch_size = None
        self._examples_per_user = None  # k when training user-level
        self._augmentation = None  # fit(augment=..., augmentations=k)
        self._add_nonfinite_counter()
        # Saved with the model after its layers (tfdp.models.training_state).
        self._lora_variables = LoraVariables(self)
        # Which DP-BandMF noise stream its steps ran, saved with the weights.
        self._noise_stream_record = NoiseStreamRecord()

    @no_automatic_dependency_tracking
    def _add_nonfinite_counter(self):
        # Untracked: a training-data statistic, kept out of evaluate(),
        # saved files and exports. Counts over the model's life in memory.
        self._nonfinite_counter = keras.metrics.Sum(name="nonfinite_examples")

    @property
    def per_example_path(self):
        """Which per-example gradient path `fit` takes, in one line.

        "batched pass with per-layer rules" (naming any layer that takes the
        per-layer vjp fallback) or "whole-model vectorized_map (why)", and
        what fit would refuse ("but fit refuses ..."). Also
        logged once (logger "tfdp", INFO) when the training step is traced.

        Example: `print(model.per_example_path)`.
        """
        return path_line(self)  # with what fit would refuse (tfdp.per_example.validate)

    def _read_dp_steps(self):
        return read_counter(self._dp_steps)

    def summary(self, *args, **kwargs):
        """Keras `summary`; its parameter counts leave out the private step
        counter (bookkeeping saved with the weights, not a parameter), so they
        equal the plain Keras model's. Example: `model.summary()`."""
        with _step_counter_hidden(self):
            super().summary(*args, **kwargs)

    @property
    def privacy(self):
        """The privacy ledger: every release this model's training made.

        Example: `model.privacy.epsilon(delta=1e-5)`.
        """
        weight_ledgers.charge_held(self)  # what weights trained by another model carry
        # A statement never says "covered" for state changed since its provenance,
        # and counts every adaptation the model holds.
        self._privacy_ledger.before_statement = functools.partial(
            preprocessing.provenance.before_release_if_alive, weakref.ref(self))
        return self._privacy_ledger

    def export(self, filepath, *args, **kwargs):
        """Keras `export`, refused for preprocessing state changed since its provenance
        (and with every adaptation the model holds charged)."""
        preprocessing.provenance.before_release(self)
        return super().export(filepath, *args, **kwargs)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # tf.saved_model.save and keras.export.ExportArchive reach the model here.
        if save_type == "savedmodel":
            preprocessing.provenance.before_release(self)
        return super()._trackable_children(save_type, **kwargs)

    # -- compile -------------------------------------------------------------

    def __setattr__(self, name, value):
        # The traced step keeps the optimizer it was compiled with, while the
        # ledger would charge the assigned one's noise: only compile swaps it.
        if (
            name == "optimizer"
            and getattr(self, "compiled", False)
            and not self.__dict__.get("_dp_compiling", False)
            and value is not getattr(self, "optimizer", None)
        ):
            raise AttributeError(
                f"The optimizer of a compiled {type(self).__name__} cannot be replaced "
                "by assignment: the compiled train step keeps the optimizer it was "
                "traced with, so the privacy ledger would charge a noise level the "
                "step does not add. Call model.compile(optimizer=..., loss=...) with "
                "the new optimizer instead (the ledger keeps counting). Received: "
                f"optimizer={type(value).__name__}"
            )
        super().__setattr__(name, value)

    def compile(self, optimizer=None, loss=None, metrics=None, **kwargs):
        """Keras `compile`, requiring a tfdp optimizer and one loss.

        Mixed precision policies ("mixed_bfloat16", "mixed_float16") are
        supported: layers compute in the low precision, while the loss,
        per-example norms, clipping, noise, accounting and the update are in
        float32 (no loss scaling: `auto_scale_loss` is refused).

        `jit_compile="auto"` (the default) is resolved by
        `tfdp.models.jit.resolve_jit_compile`: True on GPU, where XLA measured
        faster, False on CPU, where the DP step measured faster without it,
        on devices not yet measured and for layers XLA cannot compile.
        `run_eagerly=True` is refused: the step's graph is what tfdp checks
        for layers that write training data into their variables.
        """
        from tfdp.optimizers import DPOptimizer

        if isinstance(optimizer, (str, dict)):
            optimizer = keras.optimizers.get(optimizer)
        if not isinstance(optimizer, DPOptimizer):
            raise ValueError(
                f"{type(self).__name__} trains with differential privacy and needs "
                "a tfdp optimizer (tfdp.optimizers.DPSGD, DPOptimizer, SADPSGD, "
                "DPIS, AdaDP). Received: optimizer="
                f"{type(optimizer).__name__ if optimizer is not None else None}"
            )
        check_per_example_support(self)
        if kwargs.get("run_eagerly"):
            raise ValueError(_EAGER_REFUSAL.format(name=type(self).__name__)
                             + " Received: run_eagerly=True")
        # Several outputs: each example's loss sums its heads' (multi_output.py).
        self._per_example_loss, self._per_token_loss = multi_output.compiled_losses(
            self, loss, kwargs.get("loss_weights"))
        kwargs["jit_compile"] = resolve_jit_compile(
            kwargs.get("jit_compile", "auto"), model=self
        )
        if kwargs.get("auto_scale_loss") and self.dtype_policy.name == "mixed_float16":
            raise ValueError(
                "A DP model computes its loss and per-example gradients in float32 "
                "and cannot train through Keras's LossScaleOptimizer. Received: "
                "auto_scale_loss=True"
            )
        kwargs["auto_scale_loss"] = False  # Keras would wrap the DP optimizer
        self.__dict__["_dp_compiling"] = True
        try:
            super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)
        finally:
            self.__dict__["_dp_compiling"] = False

    def compile_from_config(self, config):
        """Recompiles a loaded model (Keras skips models with a custom compile)."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)

    # -- the private step ----------------------------------------------------

    def train_step(self, data):
        """One private step: charged once its batch has arrived, before any
        of it is drawn, written or applied.

        A step the model refuses (a layer changed since compile, an
        optimizer that cannot run in physical batches) is refused first, and
        not charged. The write that advances the step counter the ledger
        reads waits for the batch, and everything else the step does (noise,
        DP-BandMF's noise stream, the update, the optimizer's iterations,
        metrics) waits for that write: it is created under a control
        dependency on the write itself (not on the value written), and reads
        the batch through identities made after it. A step whose read fails
        (an IOError of a record source, a short batch read, a pipeline
        shorter than its cardinality) is neither applied nor charged; one
        that fails after its read (out of memory) is charged and not
        applied: over-counted, never under. Without the dependency the
        counter could advance (and BandMF's noise be consumed) while the
        read was still failing.
        """
        self._check_step()
        # Every op the step runs is allowed, and what it writes to a saved
        # variable reads the batch only through the noise (released_writes).
        with state_writes.checked_train_step(self, then=released_writes.refuse_record_writes):
            with tf.control_dependencies(tf.nest.flatten(data)):
                charged = self._dp_steps.value.assign_add(1, read_value=False)
            with tf.control_dependencies([charged]):
                data = tf.nest.map_structure(tf.identity, data)
                return self._private_step(data)

    def _check_step(self):
        """The step's refusals that Python makes (when the step is traced),
        made before the step is charged."""
        # After every callback's on_train_begin: a layer changed since fit's
        # own checks (made stateful, its weights recast) is refused here. A
        # layer's writes are refused as the step's graph is traced
        # (state_writes.checked_per_example_pass, around the per-example
        # pass).
        check_per_example_support(self)
        if self._physical_batch_size is not None:
            chunked_step.check_splittable(self.optimizer, self._physical_batch_size)
        if tf.executing_eagerly():
            # No graph to check for writes: eager Python in a layer's call()
            # (.numpy(), a list, a file) would be invisible.
            raise ValueError(_EAGER_REFUSAL.format(name=type(self).__name__))

    def _private_step(self, data):
        arrays, step_info = data
        # The expected batch size is the sampler's, fixed by the dataset's size:
        # the noise's scale and adaptive clipping's next clip norm read it.
        released_writes.release(step_info["expected_batch_size"])
        x, y = arrays[0], arrays[1]
        mask = tf.cast(step_info["mask"], tf.float32)
        weights, loss_fn, targets = mask, self._per_example_loss, y
        if len(arrays) > 2 and tf.nest.is_nested(arrays[2]):  # a weight per output (multi_output)
            loss_fn, targets = self._per_example_loss.weighted_by_output, (y, arrays[2])
        elif len(arrays) > 2 and arrays[2].shape.rank > 1:
            # Per-token weights (a language model's padding mask): they weigh
            # tokens inside each sequence's loss (tfdp.models.sequence_loss).
            loss_fn, targets = self._per_token_loss, (y, arrays[2])
        elif len(arrays) > 2:
            weights = mask * tf.cast(tf.reshape(arrays[2], [-1]), tf.float32)
        # Compiled metrics read y, not (y, a language model's token weights or per-output weights).
        labels = (lambda t: t[0]) if targets is not y else (lambda t: t)  # noqa: E731

        def update_metrics(x, targets, y_pred, weights, mask, losses):
            # Unweighted metrics (compile(metrics=...)) ignore sample weights:
            # give them the drawn rows only, never the padding.
            drawn = lambda t: tf.boolean_mask(t, mask > 0)  # noqa: E731
            with state_writes.checked_metric_updates(self):  # they write only their own
                multi_output.update_output_loss_metrics(self, labels(targets), y_pred, weights * mask)
                return self.compute_metrics(
                    x, tf.nest.map_structure(drawn, labels(targets)),
                    tf.nest.map_structure(drawn, y_pred),
                    sample_weight=drawn(_finite_weights(losses, weights)),
                )

        per_user = self._examples_per_user
        if per_user is not None:  # a user's gradient: of the mean loss of their k records
            weights = weights / per_user
        augmentation = self._augmentation
        if augmentation is not None:  # k copies a row, each weighed 1/k (tfdp.models.augmentation)
            x, targets, weights, mask = augmentation.expand(
                x, targets, weights, mask, augmentation_key(self.optimizer),
                unit_rows=per_user or 1, vectorized=not self.jit_compile)
            step_info = dict(step_info, mask=mask)
            # A unit (an example, or a user) is its rows' copies, joined before clipping.
            per_user = (per_user or 1) * augmentation.copies
        if self._physical_batch_size is None:
            with state_writes.checked_per_example_pass(self):
                per_example, y_pred, losses = compute_per_example_gradients(
                    self, x, targets, weights, loss_fn, self.per_example_gradients
                )
            unit_info = step_info
            if per_user is not None:  # clipped per user, not per record
                per_example, unit_info = user_level.per_user_gradients(
                    per_example, step_info, per_user)
            grads, stats = self.optimizer.privatize(per_example, unit_info)
        else:
            grads, stats, losses = chunked_step.chunked_private_gradients(
                self, x, targets, weights, step_info, self._physical_batch_size, loss_fn,
                update_metrics=update_metrics, examples_per_user=per_user,
            )
            y_pred = None  # the metrics were updated chunk by chunk
        path = self.per_example_path
        (logger.warning if "vectorized_map (layer" in path else logger.info)("%s: %s", self.name, path)
        released_writes.release(grads)  # the noisy gradients: what the update may read
        logs = self.optimizer.apply_private_gradients(
            grads, self.trainable_variables, model=self
        )
        self._nonfinite_counter.update_state(stats["nonfinite_examples"])
        loss_weights = _finite_weights(losses, weights)
        safe_losses = tf.where(tf.math.is_finite(losses), losses, tf.zeros_like(losses))
        self._loss_tracker.update_state(
            tf.math.divide_no_nan(
                tf.reduce_sum(safe_losses * loss_weights), tf.reduce_sum(loss_weights)
            ),
            sample_weight=tf.reduce_sum(loss_weights),
        )
        if y_pred is None:
            metrics = self.get_metrics_result()
        else:
            metrics = update_metrics(x, targets, y_pred, weights, mask, losses)
        # Adaptive clipping's released clip norm and unclipped fraction.
        released = {k: v for k, v in stats.items() if k != "nonfinite_examples"}
        logs = {**metrics, **logs, **released,
                "nonfinite_examples": self._nonfinite_counter.result()}
        if not isinstance(tf.distribute.get_strategy(), tf.distribute.MultiWorkerMirroredStrategy):
            # Global values on every replica: Keras averages the replicas' step logs.
            # (Not yet across workers: the all-reduce fails there inside Keras's step.)
            total, count, nonfinite = distribute.sum_over_replicas(
                [tf.convert_to_tensor(v) for v in (self._loss_tracker.total, self._loss_tracker.count)]
                + [logs["nonfinite_examples"]]
            )
            # No finite weighted row yet (every row dropped as non-finite, or
            # nothing drawn): the loss is unknown, not a perfect 0.
            loss = tf.where(count > 0, tf.math.divide_no_nan(total, count), float("nan"))
            logs.update(loss=loss, nonfinite_examples=nonfinite)
        return distribute.logs_for_keras(logs)

    def make_train_function(self, force=False):
        """Keras's train function, its op errors withheld (`step_errors`)."""
        super().make_train_function(force)
        self.train_function = without_record_values(self.train_function)
        return self.train_function

    def make_predict_function(self, force=False):
        """Keras's predict function (its inputs may be private records), its
        op errors withheld (`step_errors`)."""
        super().make_predict_function(force)
        self.predict_function = without_record_values(self.predict_function, "predict step")
        return self.predict_function

    def make_test_function(self, force=False):
        """Keras's test function (validation data may be private), its op
        errors withheld (`step_errors`)."""
        super().make_test_function(force)
        self.test_function = without_record_values(self.test_function, "test step")
        return self.test_function

    def train_on_batch(self, x=None, y=None, sample_weight=None, class_weight=None,
                       return_dict=False):
        """Refused: a DP step trains on a Poisson-sampled batch that `fit`
        draws, pads and charges to the privacy ledger; a batch chosen by the
        caller has no sampling to account for."""
        raise NotImplementedError(
            f"{type(self).__name__}.train_on_batch is not supported: a DP step must "
            "train on a batch that fit() draws by Poisson sampling (padded, masked "
            "and charged to the privacy ledger), not on a batch chosen by the caller. "
            "Use model.fit(x, y, batch_size=..., epochs=1, steps_per_epoch=1) for a single step. "
            f"Received: x of type {type(x).__name__}"
        )

    def test_step(self, data):
        """Keras `test_step`; logs shaped for multi-worker reduction."""
        return distribute.logs_for_keras(super().test_step(data))

    # -- fit -----------------------------------------------------------------

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_split=0.0,
        validation_data=None,
        shuffle=True,
        class_weight=None,
        sample_weight=None,
        initial_epoch=0,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=1,
        physical_batch_size=None,
        user_ids=None,
        examples_per_user=None,
        augment=None,
        augmentations=None,
    ):
        """Keras `fit` on Poisson-sampled batches (docs/mechanisms/index.md#poisson-sampling).

        Each of `steps_per_epoch` steps (default: dataset size / batch_size)
        includes every training record independently with probability
        batch_size / N, so `batch_size` is the *expected* batch size. Data
        is NumPy arrays or tensors, memmaps (read row by row), or a
        `tfdp.data.RecordSource` / `read_records` source as `x` alone: a
        tf.data pipeline cannot be Poisson-sampled. `shuffle` is ignored (sampling is random).
        With a `tfdp.optimizers.DPBandMF` optimizer, `x` may also be a
        `tf.data.Dataset` read in a fixed order, and arrays or sources are
        sampled cyclically: step t draws only group t mod `bands` of the
        records, each member with probability batch_size * bands / N, so
        `batch_size` stays a step's expected batch size (at most N / bands).
        Everything else is as in Keras. Epsilon appears in the logs; add
        `tfdp.callbacks.PrivacyBudget` to set delta or stop at a budget.
        A `keras.callbacks.BackupAndRestore` is restored before any release
        (`tfdp.models.restore`); another callback that loads weights in
        `on_train_begin` is refused before the first step.

        `physical_batch_size=k` (default None: all at once) computes each
        logical batch's per-example gradients k examples at a time, summing
        the clipped chunks and adding noise once per logical step: same
        result and privacy, per-example memory bounded by k
        (`tfdp.models.chunked_step`).

        `user_ids=ids, examples_per_user=k` (one id per record) protect
        people instead of records (user-level DP, `tfdp.models.user_level`):
        each step samples users with probability batch_size / U (U distinct
        ids; `batch_size` is then the expected number of users a step and
        `physical_batch_size` counts users), takes k records of each, and
        clips each user's gradient of their mean loss as one unit. Epsilon
        is then per person.

        `augment=fn, augmentations=k` (augmentation multiplicity,
        `tfdp.models.augmentation`, docs/guides/augmentation.md) replaces
        each sampled example in the step by k copies `fn(x_i, seed)` (one
        example, no batch axis; a seed of its own for each copy, for
        `tf.random.stateless_*` ops) and clips the mean of the k copies'
        gradients as one unit: sampling, noise and epsilon are unchanged.
        With user_ids the unit is the user with every copy of each of their
        records, and `physical_batch_size` counts units, not copies.
        """
        # Every check in order, and what each decides (units, batch, chunking,
        # augmentation, validation, noise): a plan, which then runs.
        from tfdp.models.fit_plan import plan_fit  # (fit_plan imports this module)

        plan = plan_fit(
            self, x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
            callbacks=callbacks, validation_split=validation_split,
            validation_data=validation_data, class_weight=class_weight,
            sample_weight=sample_weight, initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch, physical_batch_size=physical_batch_size,
            user_ids=user_ids, examples_per_user=examples_per_user, augment=augment,
            augmentations=augmentations,
        )
        # Reads of records stop at Ctrl-C and when training ends (interrupts).
        with interrupts.reading_scope() as reads:
            try:
                return self._fit_in_scope(
                    reads, plan.arrays, plan.num_examples, plan.batch_size,
                    list(plan.callbacks), epochs, verbose, plan.validation_data,
                    initial_epoch, plan.steps_per_epoch, validation_steps,
                    validation_batch_size, validation_freq, plan.users,
                )
            except Exception as error:
                # SIGINT stopped the step's reads: the step failed for it (TF
                # may also mangle the error while KeyboardInterrupt is pending).
                if reads.interrupted:
                    raise KeyboardInterrupt("training interrupted (SIGINT)") from error
                raise
            finally:
                weight_ledgers.note_trained(self)

    def _fit_in_scope(self, reads, arrays, num_examples, batch_size, callbacks, epochs,
                      verbose, validation_data, initial_epoch, steps_per_epoch,
                      validation_steps, validation_batch_size, validation_freq, users):
        """The rest of `fit`, inside its `interrupts.reading_scope`."""
        from tfdp.callbacks import PrivacyBudget, ProgbarLogger, mark_step_log_readers

        by_user = {} if users is None else dict(
            users=users, examples_per_user=self._examples_per_user)
        dataset, steps = self.optimizer.make_training_data(
            self, arrays, batch_size, steps_per_epoch=steps_per_epoch,
            budgets=[c for c in callbacks if isinstance(c, PrivacyBudget)], **by_user,
        )
        self.optimizer.fix_planned_noise()  # the ledger's steps are open: sigma is final
        if not any(isinstance(c, PrivacyBudget) for c in callbacks):
            target = getattr(self.optimizer, "noise_target", None)
            callbacks.append(
                PrivacyBudget(epsilon=None, delta=min(DEFAULT_DELTA, 1.0 / num_examples))
                if target is None else PrivacyBudget.for_noise_target(target))
        # Ledger-reading callbacks go first so that every other callback
        # (progress bar, History, TensorBoard, checkpoints) sees epsilon.
        callbacks.sort(key=lambda c: not isinstance(c, PrivacyBudget))
        # The mechanism's own callbacks write the ledger (per-epoch releases),
        # so they run before its readers.
        callbacks = list(self.optimizer.training_callbacks()) + callbacks
        if verbose != 0 and not any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks):
            # Keras's own bar ends an epoch cut by the budget at "28/28".
            callbacks.append(ProgbarLogger())
        mark_step_log_readers(callbacks, verbose)  # no epsilon per step that nobody reads
        for callback in callbacks:
            if isinstance(callback, PrivacyBudget):
                callback.check_can_start(self.privacy, num_examples, optimizer=self.optimizer)
        callbacks.append(LedgerGuard(self.privacy, callbacks))
        callbacks.append(reads.callback())
        float32_precision.keep_float32_exact()  # per-example norms in float32, not TF32
        return super().fit(
            dataset,
            epochs=epochs,
            verbose=verbose,
            callbacks=callbacks,
            validation_data=validation_data,
            shuffle=False,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps,
            validation_steps=validation_steps,
            validation_batch_size=validation_batch_size,
            validation_freq=validation_freq,
        )

    def _check_training_arrays(self, x, y, sample_weight, class_weight):
        if isinstance(x, FixedOrderData):
            return x, None, None
        if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or callable(
            getattr(x, "__next__", None)
        ):
            raise ValueError(_NOT_SAMPLEABLE.format(type(x).__name__))
        if isinstance(x, (sources.ArraySource, sources.RecordSource)):
            if y is not None or sample_weight is not None:
                raise ValueError(
                    f"A {type(x).__name__} holds the labels (and weights): pass it as "
                    f"x alone. Received: y={type(y).__name__}, "
                    f"sample_weight={type(sample_weight).__name__}"
                )
        if isinstance(x, sources.ArraySource):  # its (memory-mapped) arrays
            x, y, sample_weight = (tuple(x.arrays) + (None,))[:3]
        elif isinstance(x, sources.RecordSource):
            if class_weight is not None:
                raise ValueError(
                    "class_weight is not applied to a RecordSource: return a "
                    "sample_weight from its transform. Received: class_weight given"
                )
            return x, None, None
        if x is None or y is None:
            raise ValueError(
                f"DP training needs inputs and labels. Received: x={type(x).__name__}, "
                f"y={type(y).__name__}"
            )
        if isinstance(x, (list, tuple)) and len(getattr(self, "inputs", None) or ()) <= 1:
            x = input_checks.as_array("x", x)  # one input given as a Python list
        # tf.data cannot carry lists: a multi-input model's x=[a, b] travels
        # as a tuple (Keras takes either).
        x = tf.nest.map_structure(
            lambda a: input_checks.as_array("x", a), _lists_to_tuples(x)
        )
        if multi_output.has_several_outputs(self):  # one target per output
            return multi_output.training_arrays(self, x, y, sample_weight, class_weight)
        y = input_checks.as_array("y", y)
        num_examples = _first_dim(x)
        if num_examples == 0:
            raise ValueError("Received empty training data: x has 0 examples.")
        for name, arr in [("y", y)] + (
            [("sample_weight", sample_weight)] if sample_weight is not None else []
        ):
            if len(arr) != num_examples:
                raise ValueError(
                    f"Expected `{name}` to have one entry per example of x "
                    f"({num_examples}). Received: {name} with {len(arr)} entries"
                )
        if any(len(a) != num_examples for a in tf.nest.flatten(x)):
            raise ValueError("All inputs in x must have the same number of examples.")
        input_checks.check_label_values(y, None)  # numbers; their range once built (fit)
        if sample_weight is not None:
            sample_weight = np.asarray(input_checks.as_array("sample_weight", sample_weight),
                                       np.float32)
            input_checks.check_sample_weight_shape(sample_weight, y)
            sample_weight = input_checks.one_weight_per_example(sample_weight)
        if class_weight is not None:
            weights = input_checks.class_weights_for(y, class_weight)
            sample_weight = weights if sample_weight is None else weights * sample_weight
        return x, y, sample_weight

    def _build_for(self, arrays):
        """Builds model, metrics and optimizer on a 1-example batch; returns it."""
        if isinstance(arrays, FixedOrderData):
            sample = arrays.sample_batch()
        elif isinstance(arrays, sources.RecordSource):
            sample = tf.nest.map_structure(lambda a: a[None], arrays[0])
        else:
            sample = _take(arrays, slice(0, 1))
        check_no_text(sample[0], self)  # raw text for a KerasHub task: say task.preprocessor
        data = text_as_tensors(tuple(sample) + ((None,) if len(sample) == 2 else ()))
        strategy = self.distribute_strategy
        try:
            with strategy.scope():
                self._symbolic_build(data_batch=data)
        except ValueError as error:
            if isinstance(arrays, sources.RecordSource):
                raise ValueError(
                    f"Record 0 of {arrays!r} does not fit the model: {error}"
                ) from error
            raise ValueError(
                f"Model '{self.name}' fails on a batch of one example (fit builds it on the "
                "first; tfdp's exact per-example path runs every example alone): "
                f"{error}\nIf the model holds a constant with one row per batch position (a "
                "mask, positions, a value per row), it cannot run on one example: give the "
                "constant a first axis of 1, or pass it as a model input."
            ) from error
        return sample

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Under a tf.distribute strategy Keras takes a batch from the iterator
        # to build on even when nothing is left to build: in fit (which built
        # everything in _build_for) that spends a Poisson draw, and Keras
        # 3.15 fails on it under MultiWorkerMirroredStrategy.
        parts = [getattr(self, "_compile_metrics", None), getattr(self, "_compile_loss", None),
                 self.optimizer]
        built = all(layer.built for layer in self._flatten_layers()) and all(
            part is None or part.built for part in parts
        )
        if iterator is not None and built:
            return
        super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    # -- saving: atomic, so a crash never destroys a good checkpoint ------

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Keras `save`, written to a temporary file then renamed over
        `filepath` (`tfdp.models.atomic_save`): a process killed mid-save
        leaves the previous file intact. `keras.callbacks.ModelCheckpoint`
        saves through this method, so its checkpoints are atomic too (and a
        file it keeps with `save_best_only` is rewritten with each check's
        ledger: `tfdp.models.chosen_checkpoint`)."""
        if not (is_local_path(filepath) and (overwrite or not os.path.exists(filepath))):
            result = super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)
        else:
            result = atomic_write(
                filepath, lambda tmp: super(DPTrainingMixin, self).save(
                    tmp, overwrite=True, zipped=zipped, **kwargs)
            )
        note_save(self, filepath)
        return result

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """Keras `save_weights`, atomic as `save` (unsharded files)."""
        if max_shard_size is not None or not (
            is_local_path(filepath) and (overwrite or not os.path.exists(filepath))
        ):
            result = super().save_weights(
                filepath, overwrite=overwrite, max_shard_size=max_shard_size)
        else:
            result = atomic_write(
                filepath, lambda tmp: super(DPTrainingMixin, self).save_weights(tmp, overwrite=True)
            )
        note_save(self, filepath)
        return result

    def load_weights(self, filepath, *args, **kwargs):
        """Keras `load_weights`; a refused ledger's error names the file."""
        with naming_the_file(filepath):
            return super().load_weights(filepath, *args, **kwargs)

    # -- the ledger travels with the weights ------------------------------

    def set_weights(self, weights):
        """Keras `set_weights`, except that the private step counter keeps its
        value: steps that ran stay counted when earlier weights are written
        back (e.g. by `EarlyStopping(restore_best_weights=True)`)."""
        steps = self._dp_steps.numpy()
        super().set_weights(weights)
        self._dp_steps.assign(steps)

    def save_own_variables(self, store):
        preprocessing.provenance.check_released(self)  # changed since its provenance: refused
        super().save_own_variables(store)
        preprocessing.charge_pending(self)  # the file holds adapted state: its charge too
        text = self.privacy.to_json().encode("utf-8")
        store[_LEDGER_KEY] = np.frombuffer(text, dtype=np.uint8)

    def load_own_variables(self, store):
        keys = list(store.keys())
        if _LEDGER_KEY not in keys:
            raise ValueError(
                "These weights hold no tfdp privacy ledger, so the privacy spent "
                "training them is unknown; tfdp refuses to resume from them."
            )
        # Bytes: from_json reports text that is not UTF-8 as a corrupt ledger.
        ledger_json = bytes(np.asarray(store[_LEDGER_KEY], dtype=np.uint8))
        super().load_own_variables({k: store[k] for k in keys if k != _LEDGER_KEY})
        ledger = PrivacyLedger.from_json(ledger_json, step_counter=self._read_dp_steps)
        # The ledger and the step counter are saved together, so they agree in
        # any file tfdp wrote; a difference means they were mixed from two.
        saved_steps = json.loads(ledger_json.decode("utf-8"))["steps"]
        if saved_steps != self._read_dp_steps():
            raise ValueError(
                f"Mismatched checkpoint: its privacy ledger was saved at step {saved_steps} "
                f"but its weights' step counter reads {self._read_dp_steps()}; they come "
                "from different checkpoints. tfdp refuses to resume from them."
            )
        self._privacy_ledger = ledger
        weight_ledgers.note_loaded(self)  # a layer reused from it carries this ledger

    def get_config(self):
        config = super().get_config()
        config["per_example_gradients"] = self.per_example_gradients
        if self.built:  # LoRA and which variables train (tfdp.models.training_state)
            config["training_state"] = training_state(self)
        return config

    @staticmethod
    def _restore_training_state(model, saved):
        """Sets back what `get_config` added and Keras's `from_config` lost."""
        model.per_example_gradients = saved.pop("per_example_gradients", "auto")
        state = saved.pop("training_state", None)
        if state is not None and model.built:
            restore_training_state(model, state)
        return model


_EAGER_REFUSAL = (
    "{name} does not run its private step eagerly (`run_eagerly=True`, or "
    "`tf.config.run_functions_eagerly(True)`): a layer's writes of training data "
    "into its own variables are refused by checking the step's graph, and eager "
    "Python in a layer's call() (`.numpy()`, a list, a file) has none. Compile "
    "without run_eagerly (to debug a layer, call it eagerly outside fit).")


@contextlib.contextmanager
def _step_counter_hidden(model):
    """Takes `dp_steps` out of the model's own variables meanwhile."""
    own = model._non_trainable_variables
    index = next(i for i, v in enumerate(own) if v is model._dp_steps)
    del own[index]
    try:
        yield
    finally:
        own.insert(index, model._dp_steps)


def _clone_sequential_keeping_dp(clone_sequential):
    """`keras.models.clone_model` builds a plain `keras.Sequential` from any
    Sequential (keras/src/models/cloning.py), which would train without
    privacy; this makes a DPSequential's clone a DPSequential (its class, name,
    `per_example_gradients` and compile settings; new weights, a new ledger),
    as Keras already clones a DPModel as a DPModel."""

    @functools.wraps(clone_sequential)
    def clone(model, *args, **kwargs):
        cloned = clone_sequential(model, *args, **kwargs)
        if not isinstance(model, DPTrainingMixin):
            return cloned
        private = type(model)(cloned._layers, per_example_gradients=model.per_example_gradients,
                              name=cloned.name, trainable=cloned.trainable)
        if model.compiled:
            private.compile_from_config(model.get_compile_config())
        return private

    return clone


cloning._clone_sequential_model = _clone_sequential_keeping_dp(cloning._clone_sequential_model)


def _check_train_step(model):
    """Refuses, before any release, a subclass whose `train_step` is its own.

    tfdp's guarantee is a property of its own step (each record's gradient
    clipped on its own, the noise added once, the ledger charging exactly
    that); an override can mix records (mixup's tf.roll over the batch moved
    one record's effect to 2.55 C) or release more, and nothing in the
    ledger would say so. A warning would leave the reported epsilon wrong, so
    the override is refused unless its class declares, with
    `train_step_is_private = True`, that it only wraps the DP step with each
    record's data unmixed and releases nothing more.
    """
    cls = type(model)
    if cls.train_step is DPTrainingMixin.train_step or cls.train_step_is_private:
        return
    owner = next(c for c in cls.__mro__ if "train_step" in vars(c))
    raise ValueError(
        f"{cls.__name__} overrides train_step() (in {owner.__module__}.{owner.__qualname__}), "
        "so tfdp cannot vouch for the epsilon its ledger would report: the guarantee holds "
        "for tfdp's own step, which clips each record's gradient on its own, and a step "
        "that mixes records (mixup, tf.roll or statistics over the batch) lets one record "
        "move the update by more than the clipping norm. Customise the loss, the model's "
        "call() or a callback instead; or, if your train_step only hands each record's own "
        "data to super().train_step() and releases nothing more, set "
        f"`train_step_is_private = True` on {cls.__name__}. Training was not started. "
        f"Received: a {cls.__name__} with its own train_step"
    )


def _finite_weights(losses, weights):
    """`weights` with 0 where the row's loss or weight is not finite (a NaN
    weight drops its row)."""
    finite = tf.math.is_finite(losses) & tf.math.is_finite(weights)
    return tf.where(finite, weights, tf.zeros_like(weights))


def _lists_to_tuples(structure):
    if isinstance(structure, (list, tuple)):
        return tuple(_lists_to_tuples(item) for item in structure)
    if isinstance(structure, dict):
        return {key: _lists_to_tuples(value) for key, value in structure.items()}
    return structure


def _split_validation(x, y, sample_weight, validation_split):
    if not 0.0 < validation_split < 1.0:
        raise ValueError(
            f"Expected `validation_split` in (0, 1). Received: validation_split={validation_split}"
        )
    num_examples = _first_dim(x)
    cut = int(num_examples * (1.0 - validation_split))
    if cut < 1 or cut >= num_examples:
        raise ValueError(
            f"validation_split={validation_split} leaves no training or no "
            f"validation examples out of {num_examples}."
        )
    train = (_take(x, slice(0, cut)), _take(y, slice(0, cut)))
    val = (_take(x, slice(cut, None)), _take(y, slice(cut, None)))
    sw_train = sw_val = None
    if sample_weight is not None:
        sw_train, sw_val = _take(sample_weight, slice(0, cut)), _take(sample_weight, slice(cut, None))
        val = val + (sw_val,)
    return train[0], train[1], sw_train, val


@keras.saving.register_keras_serializable(package="tfdp")
class DPModel(DPTrainingMixin, keras.Model):
    """A Keras model trained with differential privacy.

    Built as `keras.Model` is: from a graph, `DPModel(inputs, outputs)`, or
    subclassed, `class MyModel(tfdp.DPModel)` with `super().__init__()` and
    a `call()` (a subclassed model trains on the whole-model vectorized
    path, `per_example_path`).

    Args:
        inputs, outputs: as `keras.Model(inputs, outputs)`.
        per_example_gradients: "auto" (default: one batched pass with a
            rule per layer, `tfdp.per_example`, wherever every layer keeps
            examples independent, else the whole-model tf.vectorized_map),
            "batched" (refuse a model it cannot run; "fast" is an alias) or
            "vectorized". `model.per_example_path` says which one runs.
        **kwargs: passed to `keras.Model` (name, ...).

    Example:

    >>> import keras, tfdp
    >>> inputs = keras.Input((64,))
    >>> outputs = keras.layers.Dense(10)(keras.layers.Dense(32, activation="tanh")(inputs))
    >>> model = tfdp.DPModel(inputs, outputs)
    >>> model.compile(
    ...     optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.1),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    """

    def __new__(cls, *args, **kwargs):
        # DPModel(inputs, outputs) is a FunctionalDPModel: Keras would
        # otherwise rewrite DPModel's own bases (tfdp.models.functional_class).
        if wants_functional(cls, DPModel, args, kwargs):
            cls = make_functional(cls, DPModel, FunctionalDPModel)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, per_example_gradients="auto", **kwargs):
        check_graph_arguments(args, kwargs)  # DPModel(task): say DPModel(task.inputs, ...)
        super().__init__(*args, **kwargs)
        self._init_dp(per_example_gradients)

    def get_config(self):
        config = super().get_config()
        tied = tied_layers(self)
        if tied:  # a KerasHub causal LM's output projection (tfdp.models.tied_layers)
            config["tied_layers"] = tied
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        saved = {key: config.pop(key) for key in ("per_example_gradients", "training_state",
                                                  "tied_layers") if key in config}
        model = super().from_config(config, custom_objects=custom_objects)
        if saved.get("tied_layers"):
            model = cls(model.input, retie(model, saved["tied_layers"]), name=model.name)
        return cls._restore_training_state(model, saved)


class FunctionalDPModel(DPModel, Functional):
    """What `tfdp.DPModel(inputs, outputs)` builds: a `DPModel` that is a
    Keras `Functional` (tfdp.models.functional_class). Named "DPModel", so
    messages, default model names ("dp_model") and saved files
    ("tfdp>DPModel") read as they did. Example:
    `isinstance(tfdp.DPModel(i, o), tfdp.DPModel)` is True."""


FunctionalDPModel.__name__ = "DPModel"  # __qualname__ stays, for pickle's lookup
object_registration.GLOBAL_CUSTOM_NAMES[FunctionalDPModel] = "tfdp>DPModel"


@keras.saving.register_keras_serializable(package="tfdp")
class DPSequential(DPTrainingMixin, keras.Sequential):
    """A `keras.Sequential` model trained with differential privacy.

    Args:
        layers: list of layers, as `keras.Sequential`.
        per_example_gradients: see `DPModel`.
        **kwargs: passed to `keras.Sequential` (name, trainable).

    Example:

    >>> import keras, tfdp
    >>> model = tfdp.DPSequential([
    ...     keras.Input((64,)),
    ...     keras.layers.Dense(32, activation="tanh"),
    ...     keras.layers.Dense(10)])
    >>> model.compile(
    ...     optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.1),
    ...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ...     metrics=["accuracy"])
    """

    def __init__(self, layers=None, per_example_gradients="auto", **kwargs):
        super().__init__(layers=layers, **kwargs)
        self._init_dp(per_example_gradients)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        saved = {key: config.pop(key) for key in ("per_example_gradients", "training_state")
                 if key in config}
        model = super().from_config(config, custom_objects=custom_objects)
        return cls._restore_training_state(model, saved)
