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
# the op handles (4 doubles, 8 floats a packet), both working precisions, and
# sizes past one chunk (256 pairs) and one shard; each process adds random
# sizes, seeds (os.urandom) and a random stddev, so that no library can know
# the check's draws in advance.
_CHECK_SIZES = (1, 2, 9, 31, 1031)
_CHECK_DTYPES = (tf.float32, tf.float64, tf.bfloat16, tf.float16)


def _random_check(entropy=None):
    """(sizes, seeds, stddev) of one self-check, from `entropy` (bytes, else
    os.urandom): the fixed sizes plus a random small, chunk-sized and
    multi-shard size; a 64-bit random seed per size; stddev in [0.5, 4)."""
    rng = np.random.default_rng(int.from_bytes(entropy or os.urandom(32), "little"))
    sizes = _CHECK_SIZES + (int(rng.integers(3, 64)), int(rng.integers(513, 4096)),
                            int(rng.integers(20_000, 40_000)))
    seeds = [tf.constant(rng.integers(-2**63, 2**63 - 1, size=2), tf.int64) for _ in sizes]
    return sizes, seeds, float(rng.uniform(0.5, 4.0))


def _self_check(library, entropy=None):
    """None if the op draws, adds and adds by groups the graph's values here
    (random seeds, sizes and stddev), else what differed."""
    from tfdp.mechanisms import gaussian  # the reference (imports this module)

    with tf.init_scope():  # eagerly, also when the first noise is traced
        sizes, seeds, stddev = _random_check(entropy)
        for dtype in _CHECK_DTYPES:
            factor = gaussian._radius_factor(stddev, gaussian._work_dtype(dtype))
            references = gaussian._graph_draws(
                [([size], i, dtype, [i]) for i, size in enumerate(sizes)], seeds, stddev)
            sums = [tf.cast(tf.range(size) % 13 - 6, dtype) for size in sizes]
            for size, seed, reference, total in zip(sizes, seeds, references, sums):
                for name, run, want in [
                        ("draw", lambda: draw(library, [size], seed, dtype, factor), reference),
                        ("fused add", lambda: add(library, total, seed, factor), total + reference)]:
                    if not np.array_equal(_bits(want), _bits(run()[0])):
                        return (f"the compiled op's {dtype.name} {name} of {size} differs from "
                                f"the graph generator's on TensorFlow {tf.__version__}")
            pieces = sums[:4]  # one draw of their total size, cut in order
            whole = gaussian._graph_draws([([sum(sizes[:4])], 0, dtype, [0])], seeds, stddev)[0]
            grouped, _ = add_group(library, pieces, seeds[0], factor)
            wanted = [t + n for t, n in zip(pieces, tf.split(whole, list(sizes[:4])))]
            if not all(np.array_equal(_bits(w), _bits(g)) for w, g in zip(wanted, grouped)):
                return (f"the compiled op's {dtype.name} grouped add differs from the graph "
                        f"generator's on TensorFlow {tf.__version__}")
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
    if forced_graph():
        return f"graph generator ({build.ENV_SWITCH}=graph)"
    ops = _load()
    if ops.library is None:
        return f"graph generator ({ops.reason})"
    origin = "cached" if ops.build_seconds is None else f"built in {ops.build_seconds:.1f} s"
    where = "; the graph generator under XLA" + (" and on GPUs" if _gpus() else "")
    return f"compiled kernel ({origin}: {ops.path}){where}"


def forced_graph():
    """Whether TFDP_NOISE_KERNEL=graph asks for TensorFlow's ops instead of
    every compiled op."""
    return os.environ.get(build.ENV_SWITCH, "").strip().lower() == "graph"


def _gpus():
    return bool(tf.config.list_logical_devices("GPU"))


def compiled_ops_may_run():
    """Whether tfdp's compiled ops (CPU kernels, no XLA kernels) may run in
    the current context: not forced off (`forced_graph`), not under XLA, no
    GPU on the machine."""
    if forced_graph() or _gpus():
        return False
    return not control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def library_here(dtypes):
    """The op library if it may draw `dtypes` in the current context, else None."""
    if any(tf.as_dtype(d) not in _DTYPES for d in dtypes) or not compiled_ops_may_run():
        return None
    return _load().library


def draw(library, shape, seed, dtype, factor):
    """(noise of `shape` and `dtype`, deep flag) from the op."""
    shape = tf.convert_to_tensor(shape) if isinstance(shape, tf.Tensor) else tf.constant(
        tf.TensorShape(shape).as_list(), tf.int64)
    return library.tfdp_gaussian_noise(shape, tf.cast(seed, tf.int64),
                                       tf.cast(factor, tf.float64), dtype=dtype)


def add(library, tensor, seed, factor):
    """(`tensor` + its noise, deep flag) from the fused op (a division after
    it stays a TensorFlow op: `gaussian.add_normals`)."""
    return library.tfdp_gaussian_noise_add(tensor, tf.cast(seed, tf.int64),
                                           tf.cast(factor, tf.float64))


def add_group(library, tensors, seed, factor):
    """([each tensor + its piece of one draw of their total size], deep flag)
    from the grouped op."""
    noised, deep = library.tfdp_gaussian_noise_add_group(
        tensors, tf.cast(seed, tf.int64), tf.cast(factor, tf.float64))
    return list(noised), deep


def unless_deep(values, deeps, graph):
    """`values`, or `graph()` where some radius word was 0 (the deep tail)."""
    deep = tf.reduce_any(tf.stack(deeps))
    return tf.cond(deep, graph, lambda: list(values))
