"""Full float32 precision for the private step on GPUs: TensorFloat-32 off.

TensorFlow runs float32 matrix products and convolutions on NVIDIA GPUs
from Ampere on in TensorFloat-32 (10-bit mantissa) by default. On an H100
that made tfdp's per-example squared norms differ from their reference
computations by up to 3.7e-4 relative (tests/per_example, README "On a
GPU"); where a norm comes out low, an example clipped to "norm C" adds a
little more than C: more than the sensitivity the accountant charges for.
Before a DP model trains where a GPU is present, tfdp turns TensorFloat-32
off for the process (TensorFlow has no per-op switch) and logs a warning
whenever that changes the setting; matrix products under a mixed precision policy
(mixed_bfloat16) run in bfloat16 as before.

Example:

>>> keep_float32_exact(device_types=["CPU"])  # no GPU: nothing to change
False
"""

import logging

import tensorflow as tf

from tfdp.models.jit import present_device_types

logger = logging.getLogger("tfdp")


def keep_float32_exact(device_types=None):
    """Turns TensorFloat-32 off if a GPU is present and it is on.

    Args:
        device_types: the device types training runs on; default:
            `present_device_types()`.

    Returns:
        bool: whether the setting was changed.

    Example:

    >>> keep_float32_exact(device_types=["CPU", "GPU"])  # doctest: +SKIP
    True
    """
    if device_types is None:
        device_types = present_device_types()
    if "GPU" not in device_types or not tf.config.experimental.tensor_float_32_execution_enabled():
        return False
    tf.config.experimental.enable_tensor_float_32_execution(False)
    logger.warning(
        "tfdp turned TensorFloat-32 off for this process "
        "(tf.config.experimental.enable_tensor_float_32_execution(False)): in "
        "TF32 a GPU computes per-example norms up to about 4e-4 off, so a "
        "clipped gradient could exceed l2_norm_clip. Float32 matrix products of other "
        "models in this process now run in full float32 too; a mixed_bfloat16 "
        "policy keeps the layers' products in bfloat16."
    )
    return True
