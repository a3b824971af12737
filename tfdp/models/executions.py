"""An epoch of whole executions when `compile(steps_per_execution=k)`.

Keras runs k steps per call, and tfdp's training data never runs out (it is
sampled, step after step), so an epoch of s steps runs ceil(s / k) whole
calls: k * ceil(s / k) steps, while the progress bar shows s. `fit` rounds
the epoch up to that multiple of k beforehand, so that the steps shown, the
steps planned (a target epsilon's calibration) and the steps run and charged
are one number.

Example:

>>> import keras, tfdp
>>> model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
>>> model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0),
...               loss="mse", steps_per_execution=8)
>>> whole_executions(model, num_units=1000, batch_size=32, steps_per_epoch=None)
32
"""

import logging

from tfdp.accounting.calibration import steps_per_epoch as default_steps_per_epoch

logger = logging.getLogger("tfdp")


def whole_executions(model, num_units, batch_size, steps_per_epoch):
    """`steps_per_epoch` (or the default epoch) rounded up to a multiple of
    the model's `steps_per_execution`; unchanged (possibly None) when it
    already is one. Logs the rounding (logger "tfdp", INFO)."""
    per_call = int(getattr(model, "steps_per_execution", 1) or 1)
    steps = steps_per_epoch or default_steps_per_epoch(num_units, batch_size)
    if per_call <= 1 or steps % per_call == 0:
        return steps_per_epoch
    rounded = -(-steps // per_call) * per_call
    logger.info("steps per epoch rounded up from %d to %d, a multiple of steps_per_execution=%d: "
                "Keras runs whole executions, and each step is charged", steps, rounded, per_call)
    return rounded
