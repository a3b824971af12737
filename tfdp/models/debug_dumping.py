"""TensorFlow's debug dumping is refused in a DP fit.

`tf.debugging.experimental.enable_dump_debug_info` (and any other op
callback: `tf.debugging.enable_check_numerics`, a callback of one's own)
sees every tensor TensorFlow makes, eager or in a traced function, and
writes them to its dump directory: a training record's raw values, the
per-example gradients before clipping, the noise. None of that is covered
by the epsilon the fit reports. `DPModel.fit` refuses it before any of its
ops sees a record, so a refused fit writes nothing of the data there; the
step's own scan (`tfdp.models.state_writes`) also refuses the debug ops
(`DebugIdentityV2`, ...) that such a callback puts in a traced step.

Example:

>>> import keras, tensorflow as tf, tfdp
>>> model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> refuse_op_callbacks(model)  # nothing is watching: no error
"""

from tensorflow.python.eager import context
from tensorflow.python.eager.polymorphic_function import transform


def refuse_op_callbacks(model):
    """Raises if an op callback (TensorFlow's debug dumping, check_numerics)
    watches the ops of this thread.

    Args:
        model: the DP model about to fit (named in the error).

    Raises:
        ValueError: naming the callback and how to turn it off.
    """
    watching = [*context.context().op_callbacks,
                *getattr(transform, "CONCRETE_FUNCTION_CALLBACKS", ())]
    if not watching:
        return
    names = sorted({_name(callback) for callback in watching})
    raise ValueError(
        f"Model '{model.name}' does not train with differential privacy while TensorFlow "
        "watches its ops: debug dumping (tf.debugging.experimental.enable_dump_debug_info) "
        "or another op callback (tf.debugging.enable_check_numerics) sees every tensor "
        "the fit makes, a training record's raw values and its unclipped gradient "
        "included, and writes them (or stops on them) where no clipping or noise "
        "reaches: the epsilon would not cover them. Turn it off before fit "
        "(tf.debugging.experimental.disable_dump_debug_info(), "
        "tf.debugging.disable_check_numerics()), or debug on public data. "
        f"Received: op callbacks {names}"
    )


def _name(callback):
    owner = getattr(callback, "__self__", None)
    if owner is not None:
        return f"{type(owner).__name__}.{callback.__name__}"
    return getattr(callback, "__qualname__", type(callback).__name__)
