"""Whether the factored norms' float32 Gram matmuls round as float32 here.

The float32 Gram bound (`rounding.float32_dot_error`; the per-example page's
"Why clipping holds", step 1) assumes that the batched matmul of
`rounding.float32_gram` reads its float32 operands as float32 and rounds each
product and sum to float32 (unit roundoff 2^-24). A float32 matmul can do
less: oneDNN's "fpmath" modes read float32 operands as bfloat16 (measured on
an AMX CPU: a crafted record then moved a clipped sum 1.5 times the clip
norm), GPUs' TensorFloat-32 reads them with 10-bit mantissas, TPUs pass
bfloat16, Grappler's automatic mixed precision rewrites the op. Three checks
stand between those and the float32 bound; each alone sends the Gram
matrices to float64 (`rounding._float64_factored`, exact products):

1. Settings (`reduced_precision_settings`), read when the step is traced:
   oneDNN's math mode under both of its spellings
   (`ONEDNN_DEFAULT_FPMATH_MODE`, the legacy `DNNL_DEFAULT_FPMATH_MODE`) and
   TensorFlow's `TF_SET_ONEDNN_FPMATH_MODE`, any value but STRICT or F32
   (also under `TF_ENABLE_ONEDNN_OPTS=0`, where it measured without
   effect: the setting says what the user allows); XLA flags that allow
   split-bfloat16 or fast-math dots; Grappler's `auto_mixed_precision*`
   options (which `fit` also refuses); a visible TPU; a visible GPU while
   TensorFloat-32 is on.
2. A probe (`gram_rounds_as_float32`), once per process, Gram shape and
   configuration, before the step runs: the very function the step uses
   (`checked_gram`, compiled with XLA where the step is), on the same
   device, at the step's row shape (its batch capped to keep the probe
   small), on crafted rows whose reduced-precision readings all round the
   same way. Every entry must lie within the proved float32 error of the
   exact product (NumPy, float64), and the canaries below must be exact.
3. Canaries in the step itself (`checked_gram`): two crafted examples go
   through the same Gram function in the step's graph, at the step's S
   and C, every step, so that what the graph's optimizers and the kernel
   library do to the step's matmuls they do to the canaries' too (but
   for the batch size: the canaries are a batch of 2). Their Gram entries
   are exact in float32 arithmetic in any order, with or without fused
   multiply-adds, and differ under any narrower reading or accumulation;
   where they are not exact the step takes the float64 route (`tf.cond`),
   as it does for an overflow.

`gram_path()` names the route, like `per_example_path` and `noise_path`, and
each probe's verdict is logged once (logger "tfdp", INFO).

Example:

>>> gram_path().startswith(("float32 Gram", "float64 Gram"))
True
"""

import logging
import os

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tfdp.per_example import rounding

logger = logging.getLogger("tfdp")

# Environment variables that let oneDNN (or TensorFlow's oneDNN kernels) run
# float32 matmuls on narrower inputs, and the values that keep float32.
FPMATH_ENV = ("ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE", "TF_SET_ONEDNN_FPMATH_MODE")
_STRICT_VALUES = ("", "STRICT", "F32")

# XLA flags that compute float32 dots from bfloat16 pieces, or let the
# compiler assume away non-finite values (which the overflow check reads).
_XLA_FLAGS = ("xla_gpu_enable_bf16_3way_gemm", "xla_gpu_enable_bf16_6way_gemm",
              "xla_cpu_enable_fast_math", "xla_gpu_enable_fast_math")

# The probe's rows, at most this many float32 entries (its batch is cut).
PROBE_ENTRIES = 1 << 22

# The canaries' values: float32 numbers whose every mantissa bit matters.
_A = np.float32(2.0 - 2.0**-23)
_B = np.float32(1.0) / np.float32(3.0) * np.float32(4.0)

_probes = {}  # (shape, configuration) -> None (float32 held) or the reason it did not
_logged = set()  # the settings lines logged


def _xla_flags_on(xla_flags):
    """The flags of an `XLA_FLAGS` value that are on: `--name` alone or with
    a value other than false/0/no (XLA reads a bare boolean flag as true)."""
    on = set()
    for token in xla_flags.split():
        name, _, value = token.lstrip("-").partition("=")
        if value.strip().lower() not in ("false", "0", "no", "f", "n"):
            on.add(name.lower())
    return on


def reduced_precision_settings():
    """The settings in force that allow a float32 matmul to round to fewer
    bits than float32, as "NAME=value" strings (empty: none).

    Example:

    >>> isinstance(reduced_precision_settings(), list)
    True
    """
    found = [f"{name}={os.environ[name]}" for name in FPMATH_ENV
             if os.environ.get(name, "").strip().upper() not in _STRICT_VALUES]
    switched_on = _xla_flags_on(os.environ.get("XLA_FLAGS", ""))
    found += [f"XLA_FLAGS --{flag}" for flag in _XLA_FLAGS if flag in switched_on]
    found += [f"{name}=True" for name, value in
              sorted(tf.config.optimizer.get_experimental_options().items())
              if name.startswith("auto_mixed_precision") and value]
    if tf.config.list_logical_devices("TPU"):
        found.append("a TPU is visible (bfloat16 matmul passes)")
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    if tf.config.list_logical_devices("GPU") and tf32:
        found.append("a GPU is visible with TensorFloat-32 on")
    return found


def _marked_columns(width):
    """The canaries' columns of rows `width` wide: the first and last column
    of each block `rounding.float32_gram` multiplies in one matmul op."""
    columns = []
    for start in range(0, width, rounding.GRAM_CHUNK):
        end = min(start + rounding.GRAM_CHUNK, width) - 1
        columns += [start] if end == start else [start, end]
    return columns


def canaries(positions, width):
    """([2, S, C] float32 canary rows, [2, S, S] float64 exact Gram matrices).

    The first reads: rows 0 and 1 hold _A and _B at the marked columns
    (`_marked_columns`), at most two in one float32 dot, so that an entry is
    k round32(p) for one product p of two float32 numbers in any order with
    or without a fused multiply-add (round32(p) + p rounds to 2 round32(p));
    a narrower reading of _A (all 23 fraction bits set) or _B changes it. The
    second accumulates: rows 0 and 1 hold 1 and 2^-11 (exact in bfloat16,
    float16 and TF32), whose dot 1 + 2^-22 is exact in float32 and is 1 in a
    narrower accumulator.
    """
    rows = np.zeros((2, positions, width), np.float32)
    gram = np.zeros((2, positions, positions))
    marked = _marked_columns(width)
    rows[0, 0, marked], rows[0, 1, marked] = _A, _B
    values = np.array([_A, _B], np.float64)
    products = np.float32(np.outer(values, values)).astype(np.float64)  # one rounding each
    gram[0, :2, :2] = len(marked) * products
    if width >= 2:
        rows[1, :2, 0], rows[1, :2, 1] = 1.0, 2.0**-11
        gram[1, :2, :2] = 1.0 + 2.0**-22
    return rows, gram


def checked_gram(rows):
    """(`rounding.float32_gram(rows)`, whether its canaries came out exact).

    The canaries (`canaries`) go through `rounding.float32_gram` in the
    same graph, at the same S and C (the same chunking and matmul calls),
    as a batch of 2: joining them to the rows themselves would copy the
    rows, which measured as slow as the Gram matmul. They are made to
    depend on the rows (plus 0 times one entry, or 0 where that entry is
    not finite), so that no graph optimizer can compute them ahead of the
    step, and no record decides the batch's route through them. Static S
    and C; the second result is a scalar bool tensor."""
    positions, width = rows.shape[1], rows.shape[2]
    canary_rows, expected = canaries(positions, width)
    first = tf.reduce_sum(rows[:1, :1, :1])
    zero = tf.where(tf.math.is_finite(first), 0.0 * first, 0.0)  # 0 whatever the record
    gram = rounding.float32_gram(canary_rows + zero)
    return rounding.float32_gram(rows), tf.reduce_all(tf.equal(gram, expected))


def _probe_rows(shape):
    """Crafted float32 rows [n, S, C] for the probe, n the step's batch
    (8 where unknown) cut to PROBE_ENTRIES entries: positive, with the
    fraction bits 1 + h 2^-7 + 2^-8 + 2^-11 + r 2^-23, which bfloat16, TF32
    and float16 each round up (truncation: down) in every entry, so a
    narrower reading errs by about 2^-9 relative in the same direction
    across a dot, far beyond gamma(256) = 1.5e-5."""
    batch, positions, width = shape
    batch = max(1, min(batch or 8, PROBE_ENTRIES // max(1, positions * width)))
    rng = np.random.default_rng(0)
    size = (batch, positions, width)
    fraction = (rng.integers(0, 128, size) * 2.0**-7 + 2.0**-8 + 2.0**-11
                + rng.integers(1, 2**12, size) * 2.0**-23)
    return ((1.0 + fraction) * 2.0 ** rng.integers(-2, 3, size)).astype(np.float32)


def _probe(shape, xla):
    """None if `checked_gram` rounds as float32 at `shape`, else why not."""
    rows = _probe_rows(shape)
    with tf.init_scope():  # eagerly, also while the step is traced
        gram, exact = tf.function(checked_gram, jit_compile=xla)(tf.constant(rows))
        gram, exact = gram.numpy(), bool(exact.numpy())
    if not exact:
        return "its canary Gram entries were not exact in float32"
    rows64 = rows.astype(np.float64)
    truth = np.einsum("bsk,btk->bst", rows64, rows64)
    norms = np.sqrt(np.einsum("bsk,bsk->bs", rows64, rows64))
    relative, absolute = rounding.float32_dot_error(shape[2])
    allowed = (relative + 1e-12) * norms[:, :, None] * norms[:, None, :] + absolute
    excess = np.max(np.abs(gram - truth) / allowed)
    if excess > 1.0:
        return f"an entry erred by {excess:.3g} times the float32 bound"
    return None


def _configuration(xla):
    """What a probe's verdict depends on besides the shape."""
    return (xla, tf.config.experimental.tensor_float_32_execution_enabled(),
            tuple(sorted(tf.config.optimizer.get_experimental_options().items())),
            tuple(device.name for device in tf.config.list_logical_devices()))


def gram_rounds_as_float32(*shapes):
    """Whether `rounding.float32_gram`'s matmuls at rows of each of `shapes`
    ([B, S, C], static S and C) round as float32 here: no
    `reduced_precision_settings`, and a passed probe at each shape (run once
    per shape and configuration, cached). Read when the step is traced; the
    canaries check every run (`checked_gram`).

    Example:

    >>> gram_rounds_as_float32((4, 2, 3), (4, 2, 5)) in (True, False)
    True
    """
    settings = reduced_precision_settings()
    if settings:
        line = f"float64 Gram products ({'; '.join(settings)})"
        if line not in _logged:
            _logged.add(line)
            logger.info("tfdp factored norms: %s", line)
        return False
    xla = control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    configuration = _configuration(xla)
    for shape in shapes:
        key = (tuple(shape), configuration)
        if key not in _probes:
            _probes[key] = reason = _probe(tuple(shape), xla)
            logger.info("tfdp factored norms: the precision probe at rows %s: %s", list(shape),
                        "float32 Gram products" if reason is None else f"float64 ({reason})")
    return all(_probes[(tuple(shape), configuration)] is None for shape in shapes)


def gram_path():
    """Which Gram products the factored norms take here, in one line: float32
    (with the probes passed so far) or float64 (and why).

    Example: `print(tfdp.per_example.gram_precision.gram_path())`.
    """
    settings = reduced_precision_settings()
    if settings:
        return f"float64 Gram products ({'; '.join(settings)})"
    failed = [(key[0], reason) for key, reason in _probes.items() if reason is not None]
    if failed:
        shape, reason = failed[-1]
        return (f"float64 Gram products (the precision probe of the float32 matmul at rows "
                f"{list(shape)}: {reason})")
    if not _probes:
        return "float32 Gram products where the precision probe passes (none run yet)"
    return (f"float32 Gram products (the precision probe passed at {len(_probes)} row "
            "shapes; canaries in every step fall back to float64)")
