"""Keras callbacks that read the privacy ledger.

`PrivacyBudget` puts epsilon into the logs (progress bar, History,
TensorBoard, CSVLogger) and stops training before a budget is exceeded.
"""

import math

import keras


class PrivacyBudget(keras.callbacks.Callback):
    """Shows epsilon as training goes and stops before the budget is spent.

    At the start of training and of every epoch it asks the ledger how many
    more steps of the current mechanism fit in (epsilon, delta); training
    stops after the last such step, so the final epsilon never exceeds the
    budget. A budget already spent stops training before its first step.
    `DPModel.fit` runs this callback before all others, so every logger sees
    "epsilon".

    Args:
        epsilon: the budget, a float > 0, or None to only report epsilon.
        delta: the target delta in (0, 1) (default 1e-5).
        accountant: "rdp" (default) or "pld".

    Example:

    >>> import tfdp
    >>> budget = tfdp.callbacks.PrivacyBudget(epsilon=3.0, delta=1e-5)
    >>> # model.fit(x, y, batch_size=256, epochs=40, callbacks=[budget])
    """

    def __init__(self, epsilon=None, delta=1e-5, accountant="rdp"):
        super().__init__()
        if epsilon is not None and (
            isinstance(epsilon, bool)
            or not isinstance(epsilon, (int, float))
            or not math.isfinite(epsilon)
            or epsilon <= 0
        ):
            raise ValueError(
                f"Expected `epsilon` to be a finite number > 0 or None. Received: epsilon={epsilon!r}"
            )
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
            raise ValueError(f"Expected `delta` in (0, 1). Received: delta={delta!r}")
        self.epsilon = epsilon
        self.delta = delta
        self.accountant = accountant
        self.stopped_for_budget = False
        self._step_limit = None

    def _ledger(self):
        return self.model.privacy

    def _plan(self):
        if self.epsilon is None:
            return
        ledger = self._ledger()
        room = ledger.steps_within_budget(self.epsilon, self.delta, accountant=self.accountant)
        self._step_limit = ledger.steps + room
        if room == 0:
            self._stop()

    def _stop(self):
        self.stopped_for_budget = True
        self.model.stop_training = True

    def check_can_start(self, ledger):
        """Raises ValueError if the budget leaves no room for one more step."""
        if self.epsilon is None:
            return
        if ledger.steps_within_budget(self.epsilon, self.delta, accountant=self.accountant) == 0:
            spent = ledger.epsilon(self.delta, accountant=self.accountant, extra_steps=1)
            raise ValueError(
                f"The privacy budget epsilon={self.epsilon} (delta={self.delta}) "
                f"leaves no room for another step: one more step would reach "
                f"epsilon={spent:.4g}. Training was not started."
            )

    def on_train_begin(self, logs=None):
        if self.epsilon is not None and getattr(self.model, "steps_per_execution", 1) > 1:
            raise ValueError(
                "PrivacyBudget stops training between steps, so it needs "
                "steps_per_execution=1. Received: steps_per_execution="
                f"{self.model.steps_per_execution}"
            )
        self.stopped_for_budget = False
        self._plan()

    def on_epoch_begin(self, epoch, logs=None):
        self._plan()

    def on_train_batch_end(self, batch, logs=None):
        if self._step_limit is not None and self._ledger().steps >= self._step_limit:
            self._stop()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["epsilon"] = self._ledger().epsilon(self.delta, accountant=self.accountant)
