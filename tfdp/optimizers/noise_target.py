"""A target epsilon where the noise is set: the noise multiplier chosen by `fit`.

`DPSGD(..., target_epsilon=3.0, target_delta=1e-5)` (and `DPOptimizer`,
`SADPSGD`, `AdaDP`) leaves `noise_multiplier` open until the first `fit`,
which knows what the accounting needs: the number of records N (or of
people U with `user_ids`), the expected batch size b and the planned steps
(epochs x steps per epoch). `NoiseTarget.plan` then picks the smallest
noise multiplier whose epsilon, composed with everything the model's ledger
has already spent, stays within the target after the planned steps
(`tfdp.accounting.calibrate_noise_multiplier`), says which sigma it chose,
and fixes it: the compiled step adds that noise from then on. A later `fit`
that would take epsilon past the target is refused before its first step,
and training with the chosen sigma stops at the target like a
`PrivacyBudget` does.

Example:

>>> import keras, tfdp
>>> optimizer = tfdp.optimizers.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
...                                         target_epsilon=3.0, target_delta=1e-5)
>>> optimizer.noise_multiplier is None
True
>>> sigma = optimizer.noise_target.plan(optimizer, tfdp.accounting.PrivacyLedger(),
...     num_units=10000, batch_size=100, steps=1000, unit_name="records", say=print)
tfdp: noise_multiplier=0.8646 calibrated for epsilon=3 at delta=1e-05 over 1000 steps ...
>>> round(sigma, 3)
0.865
"""

import logging

from tfdp.accounting._validation import check_delta, check_real
from tfdp.accounting.calibration import calibrate_noise_multiplier

logger = logging.getLogger("tfdp")

# A later fit may spend up to the target; float rounding of the accountant
# (same inputs, same bits) never needs more slack than this.
_OVERSPEND_TOLERANCE = 1e-9


class NoiseTarget:
    """The (epsilon, delta) a run must end within, and its planning at `fit`.

    Args:
        epsilon: target epsilon, a finite number > 0.
        delta: target delta in (0, 1).
    """

    def __init__(self, epsilon, delta):
        self.epsilon = check_real("target_epsilon", epsilon, low=0.0)
        if delta is None:
            raise ValueError(
                "`target_epsilon` needs `target_delta` (the delta of the guarantee, "
                "e.g. 1e-5, below 1 / the number of records). Received: target_delta=None"
            )
        self.delta = check_delta(delta, "target_delta")

    def epsilon_after(self, ledger, event, steps):
        """Epsilon at the target delta of `ledger`'s releases (its
        preprocessing thresholds' delta included) and `steps` more of `event`."""
        parts = ledger._spent_parts() + [(event, steps)]  # pylint: disable=protected-access
        return ledger._epsilon_of(parts, self.delta)  # pylint: disable=protected-access

    def plan(self, optimizer, ledger, num_units, batch_size, steps, unit_name, say):
        """The noise multiplier for a `fit` that plans `steps` steps: sigma
        calibrated now when `optimizer.noise_multiplier` is None, else the
        optimizer's own after checking that the fit keeps within the target.

        Args:
            optimizer: the `DPOptimizer` (its `step_event(q)` is charged).
            ledger: the model's `PrivacyLedger`.
            num_units: N records, or U people with user-level DP (treated as
                public, as the sampling rate b / N already is).
            batch_size: the expected batch size b (records or people).
            steps: the steps this `fit` plans.
            unit_name: "records" or "people", for messages.
            say: a function printing a line to the user (or nothing).

        Returns:
            The noise multiplier (a float), or None for a fit of no steps
            before any sigma was chosen.

        Raises:
            ValueError: no sigma reaches the target, or the fit would pass it.
        """
        sigma = optimizer.noise_multiplier
        if steps < 1:
            return sigma
        q = batch_size / num_units
        if sigma is None:
            try:
                sigma = calibrate_noise_multiplier(self.epsilon, self.delta, q, steps,
                                                   ledger=ledger)
            except ValueError as error:
                raise ValueError(
                    f"No noise_multiplier reaches target_epsilon={self.epsilon:g} at "
                    f"target_delta={self.delta:g} for this fit's {steps} planned steps "
                    f"(batch_size={batch_size} of {num_units} {unit_name}): {error} Plan "
                    "fewer epochs, a smaller batch_size, or a larger target_epsilon."
                ) from None
            after = self.epsilon_after(ledger, optimizer.step_event(q, sigma), steps)
            message = (
                f"tfdp: noise_multiplier={sigma:.4g} calibrated for epsilon={self.epsilon:g} "
                f"at delta={self.delta:g} over {steps} steps (batch_size={batch_size} of "
                f"{num_units} {unit_name}, sampling rate {q:.4g}); epsilon after them: "
                f"{after:.4f}."
            )
            logger.info(message)
            say(message)
            return sigma
        after = self.epsilon_after(ledger, optimizer.step_event(q), steps)
        if after > self.epsilon * (1.0 + _OVERSPEND_TOLERANCE):
            already = ledger.epsilon(self.delta)
            raise ValueError(
                f"This fit would overspend the optimizer's target_epsilon={self.epsilon:g}: "
                f"its {steps} planned steps at noise_multiplier={sigma:.4g} "
                f"(batch_size={batch_size} of {num_units} {unit_name}) take epsilon from "
                f"{already:.4g} to {after:.4g} at delta={self.delta:g}. Nothing was trained. "
                "Plan fewer epochs (`epochs` counts from `initial_epoch`), or compile with a "
                "new optimizer and a new, larger target (the ledger keeps counting)."
            )
        return sigma

    def get_config(self):
        return {"target_epsilon": self.epsilon, "target_delta": self.delta}
