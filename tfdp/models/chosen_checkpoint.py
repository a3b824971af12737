"""A checkpoint chosen by a metric carries the charge of every step it was compared on.

`keras.callbacks.ModelCheckpoint(save_best_only=True)` writes the model when
the monitored value improves and keeps the file at every later check that
does not improve. The file kept at the end was chosen by comparing every
checked epoch's model: it depends on all the steps up to the last check, yet
Keras leaves in it the ledger and step counter of the epoch it was written
(issue 34: 10 of 50 steps, epsilon 3.44 instead of 5.89). In memory,
`DPModel.set_weights` already keeps the step count when
`EarlyStopping(restore_best_weights=True)` writes earlier weights back.

The rule: a file that a `save_best_only` checkpoint keeps carries the
privacy ledger and step counter of the run at its latest check, with the
weights (and optimizer state) it was chosen for. `DPModel.fit` wraps each
such callback in `KeptCheckpoint`: when the checkpoint writes the file, the
wrapper keeps a copy of the model's and optimizer's variables; at every
check that keeps the file, and when training ends, it writes the file again
(atomically, through `DPModel.save` / `save_weights`) with those variables
and the current ledger and counter, then puts the current variables back.
So the ledger and the counter in the file agree (the load check still holds),
loading it reports every step up to the check, and training resumed from it
continues at the run's step count: its noise keys never repeat a step's.

Cost: one copy of the variables in host memory per such checkpoint, and a
save at each check that keeps the file (as many saves as
`save_best_only=False` would make).

Example:

```python
best = keras.callbacks.ModelCheckpoint("run/best.keras", save_best_only=True)
model.fit(x, y, epochs=5, validation_data=(xv, yv), callbacks=[best])
tfdp.load_model("run/best.keras").privacy.steps == model.privacy.steps  # True
```
"""

import contextlib
import weakref

import keras

_HOOKS = tuple(name for name in dir(keras.callbacks.Callback) if name.startswith("on_"))

# Paths each model saved to while a checkpoint's hook ran (see `note_save`).
_SAVES = {}

# The file each checkpoint callback keeps, across fits: callback -> _Kept.
_KEPT = weakref.WeakKeyDictionary()


def note_save(model, filepath):
    """Called by `DPModel.save` and `save_weights` after writing `filepath`."""
    saved = _SAVES.get(id(model))
    if saved is not None:
        saved.append(filepath)


@contextlib.contextmanager
def _saves_of(model):
    saved = []
    _SAVES[id(model)] = saved
    try:
        yield saved
    finally:
        del _SAVES[id(model)]


def _variables(model):
    """The variables a saved file holds that a step changes, except the step
    counter: the model's (weights, seed generators) and its optimizer's."""
    counter = getattr(model, "_dp_steps", None)
    variables = [v for v in model.variables if v is not counter]
    if getattr(model, "optimizer", None) is not None:
        variables += list(model.optimizer.variables)
    return variables


class _Kept:
    """The file a checkpoint keeps: its path, the variables written to it,
    and the ledger it was last written with."""

    def __init__(self, model, path, ledger_json):
        self.model = weakref.ref(model)
        self.path = path
        self.values = [(v, v.numpy()) for v in _variables(model)]
        self.ledger_json = ledger_json


class KeptCheckpoint(keras.callbacks.Callback):
    """Forwards every hook to a `ModelCheckpoint(save_best_only=True)` and
    rewrites the file it keeps at each check with the current ledger.

    Args:
        checkpoint: the `keras.callbacks.ModelCheckpoint`, with
            `save_best_only=True`.
    """

    def __init__(self, checkpoint):
        super().__init__()
        self.checkpoint = checkpoint
        self._last_batch = None
        self._batches = 0

    def set_model(self, model):
        super().set_model(model)
        self.checkpoint.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.checkpoint.set_params(params)

    def on_train_begin(self, logs=None):
        self.checkpoint.on_train_begin(logs)
        if self.checkpoint.save_freq != "epoch" and self.checkpoint.monitor_op is None:
            # Keras 3.15 sets the comparison at the first epoch's end, so a
            # batch-level check before it fails ("NoneType is not callable").
            self.checkpoint._set_monitor_op()

    # -- the checks --------------------------------------------------------

    def on_epoch_end(self, epoch, logs=None):
        self._check(self.checkpoint.on_epoch_end, self.checkpoint.save_freq == "epoch", epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._check(self.checkpoint.on_train_batch_end, self._checks_on_batch(batch), batch, logs)

    def on_train_end(self, logs=None):
        self.checkpoint.on_train_end(logs)
        self._keep_charged()

    def _checks_on_batch(self, batch):
        """Whether the checkpoint compares at this batch: its documented rule
        ("at end of this many batches", steps_per_execution aware), as
        Keras's `ModelCheckpoint._should_save_on_batch` counts."""
        if self.checkpoint.save_freq == "epoch":
            return False
        if self._last_batch is None or batch <= self._last_batch:
            self._batches += batch + 1
        else:
            self._batches += batch - self._last_batch
        self._last_batch = batch
        if self._batches >= self.checkpoint.save_freq:
            self._batches = 0
            return True
        return False

    def _check(self, hook, checks, *args):
        with _saves_of(self.model) as saved:
            hook(*args)
        if saved:  # the checkpoint wrote a file: it keeps that one now
            _KEPT[self.checkpoint] = _Kept(self.model, saved[-1], self.model.privacy.to_json())
        elif checks:  # compared and kept its file
            self._keep_charged()

    # -- the rewrite -------------------------------------------------------

    def _keep_charged(self):
        """Writes the kept file again with its variables and the current
        ledger and step counter, if the ledger changed since it was written."""
        kept = _KEPT.get(self.checkpoint)
        model = self.model
        if kept is None or kept.model() is not model:
            return
        ledger_json = model.privacy.to_json()
        if ledger_json == kept.ledger_json:
            return
        present = {id(v) for v in _variables(model)}
        chosen = [(v, value) for v, value in kept.values if id(v) in present]
        current = [(v, v.numpy()) for v, _ in chosen]
        try:
            for variable, value in chosen:
                variable.assign(value)
            if self.checkpoint.save_weights_only:
                model.save_weights(kept.path, overwrite=True)
            else:
                model.save(kept.path, overwrite=True)
        finally:
            for variable, value in current:
                variable.assign(value)
        kept.ledger_json = ledger_json


def _forward(name):
    def hook(self, *args, **kwargs):
        return getattr(self.checkpoint, name)(*args, **kwargs)

    hook.__name__ = name
    return hook


for _name in _HOOKS:
    if _name not in vars(KeptCheckpoint):
        setattr(KeptCheckpoint, _name, _forward(_name))


def keep_chosen_checkpoints_charged(callbacks):
    """`callbacks` with each `ModelCheckpoint(save_best_only=True)` wrapped
    in a `KeptCheckpoint` (other callbacks unchanged).

    Args:
        callbacks: the list of callbacks passed to `fit`.

    Returns:
        A new list.

    Example:

    >>> best = keras.callbacks.ModelCheckpoint("best.keras", save_best_only=True)
    >>> every = keras.callbacks.ModelCheckpoint("last.keras")
    >>> [type(c).__name__ for c in keep_chosen_checkpoints_charged([best, every])]
    ['KeptCheckpoint', 'ModelCheckpoint']
    """
    return [
        KeptCheckpoint(c)
        if isinstance(c, keras.callbacks.ModelCheckpoint) and c.save_best_only
        else c
        for c in callbacks
    ]
