"""Where the compiled noise kernel runs instead of the graph generator.

`tfdp.mechanisms.gaussian` draws its noise with a compiled TensorFlow op
(`native/gaussian_noise.cc`, built on first use by `native.build`) that
computes the graph generator's values bit for bit, several times faster. The
graph generator stays the reference and runs instead:

- when the op cannot be had: no C++ compiler, no TensorFlow headers, a
  compile error, or `TFDP_NOISE_KERNEL=graph` (`noise_path` names the
  reason);
- when the loaded op fails its self-check against the graph (a TensorFlow
  build whose kernels round differently: the values must not depend on the
  path);
- under XLA (`jit_compile=True`: the op has no XLA kernel) and on machines
  with a GPU (the op has a CPU kernel only);
- for the rare call where a radius word is 0 (probability 2^-32 a pair):
  the op reports it and the graph's deep-tail rounds draw the whole call.

Example:

>>> noise_path().startswith(("compiled kernel", "graph generator"))
True
"""

import logging
import os

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tfdp.mechanisms.native import build

logger = logging.getLogger("tfdp")

_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_loaded = None  # build.NativeOps once decided in this process (self-check included)

# The self-check's draws: sizes whose last packets are partial in every way
# the op handles (4 doubles, 8 floats a packet), both working precisions.
_CHECK_SIZES = (1, 2, 9, 31, 1031, 4101)
_CHECK_DTYPES = (tf.float32, tf.float64, tf.bfloat16, tf.float16)


def _self_check(library):
    """None if the op draws the graph's values here, else what differed."""
    from tfdp.mechanisms import gaussian  # the reference (imports this module)

    with tf.init_scope():
        for dtype in _CHECK_DTYPES:
            for size in _CHECK_SIZES:
                seed = tf.constant([size, 0x5EED], tf.int64)
                reference = gaussian._graph_draws([([size], 0, dtype, [0])], [seed], 1.0)[0]
                factor = gaussian._radius_factor(1.0, gaussian._work_dtype(dtype))
                value, _ = draw(library, [size], seed, dtype, factor)
                if not np.array_equal(_bits(reference), _bits(value)):
                    return (f"the compiled op's {dtype.name} draw of {size} differs from the "
                            f"graph generator's on TensorFlow {tf.__version__}")
    return None


def _bits(tensor):
    return tensor.numpy().view(f"u{tensor.dtype.size}")


@tf.autograph.experimental.do_not_convert  # plain Python: compiles, loads, checks
def _load():
    global _loaded
    if _loaded is None:
        ops = build.load()
        if ops.library is not None:
            mismatch = _self_check(ops.library)
            if mismatch is not None:
                ops = build.NativeOps(reason=mismatch)
        _loaded = ops
        logger.info("tfdp noise: %s", noise_path())
    return _loaded


def noise_path():
    """Which generator draws tfdp's Gaussian noise in this process, in one line.

    "compiled kernel (built in N s, or cached: the library's path)" or
    "graph generator (why)". Also logged once (logger "tfdp", INFO) when the
    first noise is drawn.

    Example: `print(tfdp.mechanisms.native_noise.noise_path())`.
    """
    if _forced_graph():
        return f"graph generator ({build.ENV_SWITCH}=graph)"
    ops = _load()
    if ops.library is None:
        return f"graph generator ({ops.reason})"
    origin = "cached" if ops.build_seconds is None else f"built in {ops.build_seconds:.1f} s"
    where = "; the graph generator under XLA" + (" and on GPUs" if _gpus() else "")
    return f"compiled kernel ({origin}: {ops.path}){where}"


def _forced_graph():
    return os.environ.get(build.ENV_SWITCH, "").strip().lower() == "graph"


def _gpus():
    return bool(tf.config.list_logical_devices("GPU"))


def library_here(dtypes):
    """The op library if it may draw `dtypes` in the current context, else None."""
    if _forced_graph() or any(tf.as_dtype(d) not in _DTYPES for d in dtypes):
        return None
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        return None
    if _gpus():
        return None
    return _load().library


def draw(library, shape, seed, dtype, factor):
    """(noise of `shape` and `dtype`, deep flag) from the op."""
    shape = tf.convert_to_tensor(shape) if isinstance(shape, tf.Tensor) else tf.constant(
        tf.TensorShape(shape).as_list(), tf.int64)
    return library.tfdp_gaussian_noise(shape, tf.cast(seed, tf.int64),
                                       tf.cast(factor, tf.float64), dtype=dtype)


def add(library, tensor, seed, factor):
    """(`tensor` + its noise, deep flag) from the fused op."""
    divisor = tf.ones([], tensor.dtype)  # unused: the division stays a TensorFlow op
    return library.tfdp_gaussian_noise_add(tensor, tf.cast(seed, tf.int64),
                                           tf.cast(factor, tf.float64), divisor)


def add_group(library, tensors, seed, factor):
    """([each tensor + its piece of one draw of their total size], deep flag)
    from the grouped op."""
    divisor = tf.ones([], tensors[0].dtype)  # unused, as in `add`
    noised, deep = library.tfdp_gaussian_noise_add_group(
        tensors, tf.cast(seed, tf.int64), tf.cast(factor, tf.float64), divisor)
    return list(noised), deep


def unless_deep(values, deeps, graph):
    """`values`, or `graph()` where some radius word was 0 (the deep tail)."""
    deep = tf.reduce_any(tf.stack(deeps))
    return tf.cond(deep, graph, lambda: list(values))
