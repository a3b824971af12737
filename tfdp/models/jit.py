"""What `jit_compile="auto"` means for a DP model: the measured choice per device.

Keras's own "auto" turns XLA on wherever the layers allow it. For the DP
step the choice was measured (benchmarks/throughput.py): on the 2-core CPU
the step ran faster without XLA, so "auto" is False there. Device types
without a measurement (GPU, TPU: no accelerator was available when this was
written) also get False, the path that needs no fixed batch shape; pass
`jit_compile=True` to `compile` to use XLA there.

Example:

>>> resolve_jit_compile("auto", device_types=["CPU"])
False
>>> resolve_jit_compile(True, device_types=["CPU"])
True
"""

import tensorflow as tf

# Device type -> whether XLA measured faster for the DP step on it.
MEASURED_XLA_FASTER = {"CPU": False}


def resolve_jit_compile(jit_compile, device_types=None):
    """The `jit_compile` a DP model compiles with.

    Args:
        jit_compile: True, False or "auto".
        device_types: the device types training runs on (e.g. ["CPU"],
            ["CPU", "GPU"]); default: TensorFlow's logical devices.

    Returns:
        bool. "auto" is True only when every accelerator present (else the
        CPU) is a device type on which XLA measured faster.

    Raises:
        ValueError: for anything but True, False or "auto".

    Example:

    >>> resolve_jit_compile("auto", device_types=["CPU", "GPU"])
    False
    """
    if isinstance(jit_compile, bool):
        return jit_compile
    if jit_compile != "auto":
        raise ValueError(
            f"Expected `jit_compile` to be True, False or 'auto'. Received: jit_compile={jit_compile!r}"
        )
    if device_types is None:
        device_types = [device.device_type for device in tf.config.list_logical_devices()]
    kinds = set(device_types)
    accelerators = kinds - {"CPU"}
    relevant = accelerators or {"CPU"}
    return all(MEASURED_XLA_FASTER.get(kind, False) for kind in relevant)
