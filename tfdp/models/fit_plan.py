"""What `DPModel.fit` decides before its first step, in the order it checks it.

`plan_fit(model, x, y, ...)` runs fit's checks top to bottom, one named call
a line, and returns a `FitPlan`: the data the sampler reads, the unit of
privacy and how many there are, the batch and its chunking, the
augmentation, the validation data, the epoch's steps, the steps the noise
was planned for and the callbacks. `DPModel.fit` builds the plan, then runs
it (`_fit_in_scope`, inside the reading scope of `tfdp.data.interrupts`).

Nothing in planning draws a batch or takes a step, so every refusal comes
before the first release. Planning does change the model where fit must
before it runs: it builds it on one example, sets the train step's grouping
(user-level), chunking (`physical_batch_size`) and augmentation (retracing
the step when one changed), marks held weights as trained, restores a
`keras.callbacks.BackupAndRestore` and, with a target epsilon, sets the
optimizer's sigma (fixed when the first step opens, `fix_planned_noise`).

Example:

>>> import keras, numpy as np, tfdp
>>> model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, seed=0),
...               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
>>> x, y = np.ones((40, 3), "float32"), np.zeros(40, "int64")
>>> plan = plan_fit(model, x, y, batch_size=8, physical_batch_size=4, validation_split=0.25)
>>> plan.num_examples, plan.unit, plan.batch_size, plan.physical_batch_size
(30, 'records', 8, 4)
>>> len(plan.validation_data[0]), plan.planned_steps, model.privacy.steps
(10, 4, 0)
"""

import dataclasses
from typing import Any, Optional

import numpy as np
import tensorflow as tf
from keras.src.utils import io_utils

from tfdp import preprocessing
from tfdp.accounting.calibration import steps_per_epoch as default_steps_per_epoch
from tfdp.data import sources
from tfdp.data.fixed_order import FixedOrderData
from tfdp.models import (
    chunked_step, input_checks, keras_file_ledgers, multi_output, state_writes, user_level,
    weight_ledgers,
)
from tfdp.models.augmentation import check_augmentation
from tfdp.models.chosen_checkpoint import keep_chosen_checkpoints_charged
from tfdp.models.debug_dumping import refuse_op_callbacks
from tfdp.models.dp_model import _check_train_step, _first_dim, _split_validation
from tfdp.models.executions import whole_executions
from tfdp.models.matmul_precision import refuse_rewritten_matmuls
from tfdp.models.restore import restore_backups
from tfdp.models.step_errors import warn_if_tf_logs_op_errors
from tfdp.models.task_inputs import text_as_tensors
from tfdp.per_example import check_per_example_support


@dataclasses.dataclass(frozen=True, eq=False)
class FitPlan:
    """What `fit` decided, each field by the check that decides it.

    Attributes:
        arrays: what the sampler reads: `(x, y)` or `(x, y, sample_weight)`
            after `_check_training_arrays` and the validation split, a
            `RecordSource` (checked against the outputs), or the
            `FixedOrderData` a fixed-order pipeline became (DP-BandMF).
        num_examples: the units sampled and counted: training records after
            the split, or distinct users with `user_ids`.
        users: the user-level grouping (`user_level.check_user_level`), or
            None for record-level DP.
        examples_per_user: the records a step takes of each sampled user
            (`examples_per_user`), or None.
        batch_size: the expected units a step (default 32; a fixed-order
            pipeline's own batch size), at most `num_examples`.
        physical_batch_size: the units a chunk of the step computes at once
            (`chunked_step.check_physical_batch_size`), or None: all at once.
        augmentation: the `Augmentation` of `augment=`/`augmentations=`
            (`check_augmentation`), or None.
        validation_data: what Keras evaluates on: `validation_data`, or the
            records `validation_split` cut off the end of x, checked
            against the model and with text as tensors.
        steps_per_epoch: the epoch's steps rounded up to whole executions
            (`whole_executions`); None for the default epoch (or for a
            fixed-order pipeline, which counts its own).
        planned_steps: the steps this fit will take, which a target epsilon
            calibrated sigma for (`optimizer.plan_noise`); None for a
            fixed-order pipeline, whose optimizer planned them.
        callbacks: the user's callbacks with any backup restored
            (`restore_backups`), a `ProvenanceWatch`, and checkpoints kept by
            `save_best_only` charged (`keep_chosen_checkpoints_charged`).
    """

    arrays: Any
    num_examples: int
    users: Any
    examples_per_user: Optional[int]
    batch_size: int
    physical_batch_size: Optional[int]
    augmentation: Any
    validation_data: Any
    steps_per_epoch: Optional[int]
    planned_steps: Optional[int]
    callbacks: tuple

    @property
    def unit(self):
        """What one unit of privacy is: "records", or "people" with user_ids."""
        return "records" if self.users is None else "people"


def plan_fit(model, x=None, y=None, *, batch_size=None, epochs=1, verbose="auto",
             callbacks=None, validation_split=0.0, validation_data=None, class_weight=None,
             sample_weight=None, initial_epoch=0, steps_per_epoch=None,
             physical_batch_size=None, user_ids=None, examples_per_user=None, augment=None,
             augmentations=None):
    """Runs `fit`'s checks in order; returns what they decided as a `FitPlan`.

    Args:
        model: the compiled `DPModel` / `DPSequential`.
        x, y, ...: `DPModel.fit`'s arguments of the same names.

    Returns:
        A `FitPlan`.

    Raises:
        ValueError: the first check that refuses, naming the argument, the
            value and the fix, before any batch is drawn.

    Example: `plan_fit(model, x, y, batch_size=8).num_examples` -> 40 for 40
    records (the module's Example runs one).
    """
    _refuse_unsupported_model(model)
    if isinstance(x, tf.data.Dataset) and getattr(model.optimizer, "trains_on_datasets", False):
        x = model.optimizer.fixed_order_data(  # a pipeline in a fixed order (DP-BandMF)
            x, y, batch_size, sample_weight, class_weight, validation_split,
            steps_per_epoch, epochs, initial_epoch)
        y = sample_weight = class_weight = steps_per_epoch = None
        validation_split, batch_size = 0.0, x.batch_size
    elif hasattr(model.optimizer, "plan_epochs"):  # DP-BandMF's amplified mode
        model.optimizer.plan_epochs(epochs, initial_epoch)
    x, y, sample_weight = model._check_training_arrays(  # pylint: disable=protected-access
        x, y, sample_weight, class_weight)
    x, y, sample_weight, validation_data, split_at = _split_off_validation(
        x, y, sample_weight, validation_split, validation_data)
    num_examples, users, per_user = _units(
        model, _first_dim(x), user_ids, examples_per_user, validation_split)
    batch_size = _checked_batch_size(batch_size, num_examples, users)
    physical_batch_size = _chunking(model, physical_batch_size, num_examples, batch_size)
    arrays = x if isinstance(x, (sources.RecordSource, FixedOrderData)) else (
        (x, y) if sample_weight is None else (x, y, sample_weight))
    # Workers agree (settings checked, sampling seed shared) before any of
    # them builds variables: differing optimizers would break that.
    model.optimizer.agree_with_workers(model, num_examples, batch_size, steps_per_epoch)
    sample = model._build_for(arrays)  # pylint: disable=protected-access
    _check_built_model(model, sample, users, augment)
    augmentation = _augmentation(model, augment, augmentations, sample,
                                 rows=(physical_batch_size or batch_size) * (per_user or 1))
    # Outputs are known once built (a model without keras.Input has none before).
    units = multi_output.label_units(model)  # per output name for several outputs
    arrays = _check_labels(model, x, y, arrays, units)
    validation_data = text_as_tensors(input_checks.check_validation_data_fits(
        model, validation_data, units, split_at))  # Keras evaluates text as tensors
    _refuse_nothing_to_train(model)
    callbacks = _fit_callbacks(model, callbacks)
    steps_per_epoch, planned_steps = _noise_plan(
        model, x, num_examples, users, batch_size, steps_per_epoch, epochs, initial_epoch,
        verbose)
    return FitPlan(
        arrays=arrays, num_examples=num_examples, users=users, examples_per_user=per_user,
        batch_size=batch_size, physical_batch_size=physical_batch_size,
        augmentation=augmentation, validation_data=validation_data,
        steps_per_epoch=steps_per_epoch, planned_steps=planned_steps,
        callbacks=tuple(callbacks),
    )


def _refuse_unsupported_model(model):
    """Compiled with a tfdp optimizer, nothing that would see records outside
    tfdp's bounds, tfdp's own train step, and every layer still supported."""
    # An uncompiled Keras model has no `optimizer` attribute at all.
    # pylint: disable-next=protected-access
    if getattr(model, "optimizer", None) is None or model._per_example_loss is None:
        raise ValueError("Compile the model with a tfdp optimizer before calling fit().")
    refuse_op_callbacks(model)  # TensorFlow's debug dumping: before any op sees a record
    warn_if_tf_logs_op_errors()  # TensorFlow's C++ log would print a failing op's message
    refuse_rewritten_matmuls(model)  # Grappler's float16/bfloat16 matmuls: outside the bounds
    _check_train_step(model)
    check_per_example_support(model)  # a layer changed since compile


def _split_off_validation(x, y, sample_weight, validation_split, validation_data):
    """Checks `validation_data`; cuts `validation_split` off the end of x when
    no validation_data is given. Returns x, y, sample_weight, the validation
    data and where the cut was (the validation records' first index, or None)."""
    input_checks.check_validation_data(validation_data)
    if validation_split and isinstance(x, sources.RecordSource):
        raise ValueError(
            "validation_split cannot split a RecordSource; pass validation_data. "
            f"Received: validation_split={validation_split}"
        )
    split_at = None  # where validation_split cut x: the validation records' first index
    if validation_split and validation_data is None:
        x, y, sample_weight, validation_data = _split_validation(
            x, y, sample_weight, validation_split
        )
        split_at = _first_dim(x)
    return x, y, sample_weight, validation_data, split_at


def _units(model, num_records, user_ids, examples_per_user, validation_split):
    """The units sampled and counted (records, or people with `user_ids`):
    their number, the user grouping (or None) and the records a step takes of
    each user (or None). Sets the step's grouping."""
    users = user_level.check_user_level(
        model, user_ids, examples_per_user, num_records, validation_split)
    num_examples = num_records if users is None else users.num_users
    per_user = None if users is None else int(examples_per_user)
    _set_step_setting(model, "_examples_per_user", per_user)  # the step's grouping
    return num_examples, users, per_user


def _checked_batch_size(batch_size, num_examples, users):
    """The expected units a step: 32 by default, an int in [1, num_examples]."""
    batch_size = 32 if batch_size is None else batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"Expected `batch_size` to be an int >= 1. Received: batch_size={batch_size!r}")
    if batch_size > num_examples:
        raise ValueError(
            f"Expected `batch_size` <= the number of training "
            f"{'examples' if users is None else 'users (distinct user_ids)'} "
            f"({num_examples}). Received: batch_size={batch_size}"
        )
    return batch_size


def _chunking(model, physical_batch_size, num_examples, batch_size):
    """The units a chunk computes at once (None: the whole batch); sets the
    step's chunking."""
    physical_batch_size = chunked_step.check_physical_batch_size(
        model.optimizer, physical_batch_size, num_examples, batch_size
    )
    _set_step_setting(model, "_physical_batch_size", physical_batch_size)
    return physical_batch_size


def _check_built_model(model, sample, users, augment):
    """The checks that need the built model, before any array meets it."""
    # A layer that writes a variable in training would keep records' data (issue 43).
    state_writes.check_dp_model(model, sample)
    # Preprocessing state (vocabularies, means, bins) needs a provenance (issue 52).
    preprocessing.check_model(model, users=users, augment=augment)
    weight_ledgers.mark_trained(model)  # charges what held weights carry; they carry this
    input_checks.check_input_names(model)  # before any array meets an input


def _augmentation(model, augment, augmentations, sample, rows):
    """The `Augmentation` of `augment`/`augmentations` (or None); sets the
    step's copies."""
    augmentation = check_augmentation(augment, augmentations, sample[0], model.optimizer,
                                      rows=rows)
    _set_step_setting(model, "_augmentation", augmentation)
    return augmentation


def _check_labels(model, x, y, arrays, units):
    """Labels in the outputs' range and embedding ids in their tables; a
    `RecordSource` becomes its checked reader. Returns what the sampler reads."""
    if isinstance(x, sources.RecordSource):
        return input_checks.check_record_source(x, units)
    if not isinstance(x, FixedOrderData):  # a pipeline's labels arrive as it runs
        input_checks.check_label_values(y, units)
        input_checks.check_embedding_ids(model, x)
    return arrays


def _refuse_nothing_to_train(model):
    if not model.trainable_variables:
        raise ValueError(
            f"Model '{model.name}' has no trainable weights, so there is nothing to "
            "train privately (are all its layers frozen with trainable=False?). "
            "Received: 0 trainable variables"
        )


def _fit_callbacks(model, callbacks):
    """The user's callbacks, any backup restored, with the watches fit adds."""
    callbacks = list(callbacks or [])
    keras_file_ledgers.refuse_legacy_h5_checkpoints(model, callbacks)  # else refused at its save
    # Keras would restore a backup (weights, ledger) after the releases below.
    callbacks = restore_backups(model, callbacks)
    callbacks.append(preprocessing.provenance.ProvenanceWatch())  # re-adapted mid-fit: refused
    # A file kept by save_best_only is rewritten with the ledger of each check.
    return keep_chosen_checkpoints_charged(callbacks)


def _noise_plan(model, x, num_examples, users, batch_size, steps_per_epoch, epochs,
                initial_epoch, verbose):
    """The epoch's steps in whole executions and the steps this fit takes,
    for which a target epsilon sets sigma now (after any backup is restored:
    its ledger and epoch are what this fit continues). A fixed-order pipeline
    planned its own: (steps_per_epoch, None)."""
    if isinstance(x, FixedOrderData):
        return steps_per_epoch, None
    steps_per_epoch = whole_executions(model, num_examples, batch_size, steps_per_epoch)
    first_epoch = getattr(model, "_initial_epoch", None) or initial_epoch
    planned = (steps_per_epoch or default_steps_per_epoch(num_examples, batch_size)) * max(
        0, epochs - first_epoch)
    model.optimizer.plan_noise(
        model, num_examples, batch_size, planned, "records" if users is None else "people",
        say=io_utils.print_msg if verbose != 0 else lambda message: None)
    return steps_per_epoch, planned


def _set_step_setting(model, name, value):
    """Sets one of the train step's settings; a change retraces the step."""
    if value != getattr(model, name):
        setattr(model, name, value)
        model.train_function = None  # retrace the step with the new setting
