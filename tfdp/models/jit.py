"""What `jit_compile="auto"` means for a DP model: the measured choice per device.

Keras's own "auto" turns XLA on wherever the layers allow it. For the DP
step the choice was measured (benchmarks/throughput.py): on the 2-core CPU
the step ran faster without XLA, so "auto" is False there; on an H100 GPU
XLA made DP's whole fit 1.02x to 1.79x faster in float32 on every zoo
model but the LSTM (0.90x, within noise; benchmarks/results/
throughput_gpu_h100.md), so "auto" is True on GPU. Device types without a
measurement (TPU) get False, the path that needs no fixed batch shape;
pass `jit_compile=True` to `compile` to use XLA there.

Example:

>>> resolve_jit_compile("auto", device_types=["CPU"])
False
>>> resolve_jit_compile(True, device_types=["CPU"])
True
"""

import tensorflow as tf
from keras.src.trainers.trainer import model_supports_jit

# Device type -> whether XLA measured faster for the DP step on it.
MEASURED_XLA_FASTER = {"CPU": False, "GPU": True}


def present_device_types():
    """The device types TensorFlow computes on here, e.g. ["CPU", "GPU"]."""
    return [device.device_type for device in tf.config.list_logical_devices()]


def resolve_jit_compile(jit_compile, device_types=None, model=None, run_eagerly=False):
    """The `jit_compile` a DP model compiles with.

    Args:
        jit_compile: True, False or "auto".
        device_types: the device types training runs on (e.g. ["CPU"],
            ["CPU", "GPU"]); default: TensorFlow's logical devices.
        model: the model compiling, if any: "auto" stays False when one of
            its layers cannot run under XLA (Keras's own test,
            `supports_jit`).
        run_eagerly: "auto" is False for an eager run.

    Returns:
        bool. "auto" is True only when every accelerator present (else the
        CPU) is a device type on which XLA measured faster, and the model
        and run allow XLA.

    Raises:
        ValueError: for anything but True, False or "auto".

    Example:

    >>> resolve_jit_compile("auto", device_types=["CPU", "GPU"])
    True
    """
    if isinstance(jit_compile, bool):
        return jit_compile
    if jit_compile != "auto":
        raise ValueError(
            f"Expected `jit_compile` to be True, False or 'auto'. Received: jit_compile={jit_compile!r}"
        )
    if run_eagerly or (model is not None and not model_supports_jit(model)):
        return False
    if device_types is None:
        device_types = present_device_types()
    kinds = set(device_types)
    accelerators = kinds - {"CPU"}
    relevant = accelerators or {"CPU"}
    return all(MEASURED_XLA_FASTER.get(kind, False) for kind in relevant)
