"""The float32 Gram route only where its matmul rounds as float32
(`tfdp.per_example.gram_precision`): settings, the precision probe and the
canaries in the step, each against a matmul that reads bfloat16 inputs, on
the review's crafted record (a cancelling Dense-over-positions example whose
float32 Gram products, read as bfloat16, put its norm 11 times too low)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfdp.per_example import gram_precision, rounding


def _crafted_record():
    """The review's record (bf16_grappler.py): two equal x rows, g rows
    v and -(v - d) with d about v 2^-9, so the true norm is |x| d while a
    bfloat16 reading of g (8 bits) rounds v - d to v."""
    rng = np.random.default_rng(0)
    x = np.zeros((8, 2, 3), np.float32)
    g = np.zeros((8, 2, 2), np.float32)
    for b in range(8):
        x[b, 0] = x[b, 1] = rng.standard_normal(3).astype(np.float32)
        v = np.float32(10000.0 + b)
        g[b, 0, 0], g[b, 1, 0] = v, -(v - np.float32(v * 2**-9 * (1 + b / 8)))
    return x, g


def _exact(x, g):
    m = np.einsum("bsk,bso->bko", x.astype(np.float64), g.astype(np.float64))
    return np.sum(m**2, (1, 2))


def _bound(x, g):
    return tf.function(rounding.factored_norm_bounds)(tf.constant(x), tf.constant(g))[0].numpy()


def _float64_route(x, g):
    reference = tf.function(rounding._float64_factored)(tf.constant(x), tf.constant(g))[0]
    return np.maximum(reference.numpy(), 0.0)


def _bfloat16_products(block):
    """A float32 matmul that reads its inputs as bfloat16 (oneDNN's BF16
    fpmath mode, Grappler's rewrite)."""
    narrow = tf.cast(tf.cast(block, tf.bfloat16), tf.float32)
    return tf.matmul(narrow, narrow, transpose_b=True)


@pytest.fixture
def fresh_probes(monkeypatch):
    monkeypatch.setattr(gram_precision, "_probes", {})


def test_the_default_configuration_takes_float32_grams(fresh_probes):
    x, g = _crafted_record()
    assert gram_precision.reduced_precision_settings() == []
    assert gram_precision.gram_rounds_as_float32(x.shape, g.shape)
    assert gram_precision.gram_path().startswith(
        "float32 Gram products (the precision probe passed")
    bound = _bound(x, g)
    assert np.all(bound >= _exact(x, g))
    assert not np.array_equal(bound, _float64_route(x, g))  # the float32 route ran


@pytest.mark.parametrize("name", gram_precision.FPMATH_ENV)
@pytest.mark.parametrize("value", ["BF16", "bf16", "ANY", "TF32", "F16", "unknown"])
def test_every_fpmath_setting_but_strict_keeps_float64_grams(monkeypatch, fresh_probes, name,
                                                             value):
    """Both spellings of oneDNN's math mode (DNNL_ is the one the review
    found missing) and TensorFlow's: any value but STRICT or F32."""
    monkeypatch.setenv(name, value)
    assert gram_precision.reduced_precision_settings() == [f"{name}={value}"]
    assert gram_precision.gram_path() == f"float64 Gram products ({name}={value})"
    x, g = _crafted_record()
    assert np.array_equal(_bound(x, g), _float64_route(x, g))
    assert gram_precision._probes == {}  # decided without a probe


@pytest.mark.parametrize("value", ["STRICT", "strict", "F32", ""])
def test_strict_fpmath_settings_keep_float32_grams(monkeypatch, value):
    monkeypatch.setenv("DNNL_DEFAULT_FPMATH_MODE", value)
    assert gram_precision.reduced_precision_settings() == []


def test_xla_flags_that_split_or_relax_dots_keep_float64_grams(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_bf16_3way_gemm=true --xla_dump_to=/tmp")
    assert gram_precision.reduced_precision_settings() == [
        "XLA_FLAGS --xla_gpu_enable_bf16_3way_gemm"]


@pytest.mark.parametrize("flags, on", [
    ("--xla_cpu_enable_fast_math", True),        # a bare boolean flag is true (review 8, G6)
    ("--xla_cpu_enable_fast_math=t", True),
    ("--xla_cpu_enable_fast_math=yes", True),
    ("--xla_cpu_enable_fast_math=false", False),  # negative controls
    ("--xla_cpu_enable_fast_math=0 --xla_dump_to=/tmp", False),
])
def test_xla_flags_are_read_one_flag_at_a_time(monkeypatch, flags, on):
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert gram_precision.reduced_precision_settings() == (
        ["XLA_FLAGS --xla_cpu_enable_fast_math"] if on else [])


def test_grappler_mixed_precision_never_takes_float32_grams():
    """Grappler's bfloat16 rewrite ran the float32 Gram matmul in bfloat16
    (the review: true/bound 11.3). `fit` refuses it; the norms never trust
    float32 Gram products under it either."""
    name = "auto_mixed_precision_onednn_bfloat16"
    tf.config.optimizer.set_experimental_options({name: True})
    try:
        assert gram_precision.reduced_precision_settings() == [f"{name}=True"]
        x, g = _crafted_record()
        bound = _bound(x, g)
    finally:
        tf.config.optimizer.set_experimental_options({name: False})
    assert np.all(bound >= _exact(x, g))
    assert np.array_equal(bound, _float64_route(x, g))


@pytest.mark.parametrize("tf32, settings", [(True, ["a GPU is visible with TensorFloat-32 on"]),
                                            (False, [])])
def test_a_gpu_takes_float32_grams_only_without_tf32(monkeypatch, tf32, settings):
    visible = {"GPU": ["GPU:0"], "TPU": []}
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: visible.get(kind, []))
    monkeypatch.setattr(tf.config.experimental, "tensor_float_32_execution_enabled", lambda: tf32)
    assert gram_precision.reduced_precision_settings() == settings


def test_a_tpu_keeps_float64_grams(monkeypatch):
    visible = {"GPU": [], "TPU": ["TPU:0"]}
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: visible.get(kind, []))
    assert gram_precision.reduced_precision_settings() == [
        "a TPU is visible (bfloat16 matmul passes)"]


def test_the_probe_detects_a_bfloat16_matmul(monkeypatch, fresh_probes):
    """No setting says so, but the matmul reads bfloat16: the probe sends
    the norms to float64, and the crafted record is bounded."""
    monkeypatch.setattr(rounding, "float32_products", _bfloat16_products)
    x, g = _crafted_record()
    assert not gram_precision.gram_rounds_as_float32(x.shape, g.shape)
    assert gram_precision.gram_path().startswith("float64 Gram products (the precision probe")
    bound = _bound(x, g)
    assert np.all(bound >= _exact(x, g))
    assert np.array_equal(bound, _float64_route(x, g))


@pytest.mark.parametrize("shape", [(8, 2, 3), (4, 5, 300)])
def test_the_probe_checks_the_bound_not_only_the_canaries(monkeypatch, shape):
    """With the canaries' verdict forced to "exact", the probe's entries
    alone (crafted rows, against the float32 bound) still catch a bfloat16
    matmul; the float32 one passes (the control)."""
    original = gram_precision.checked_gram
    monkeypatch.setattr(gram_precision, "checked_gram",
                        lambda rows: (original(rows)[0], tf.constant(True)))
    assert gram_precision._probe(shape, xla=False) is None
    monkeypatch.setattr(rounding, "float32_products", _bfloat16_products)
    assert "times the float32 bound" in gram_precision._probe(shape, xla=False)


def test_the_canaries_catch_what_the_probe_missed(monkeypatch):
    """A probe fooled into passing (a kernel that reads bfloat16 only at the
    step's shapes): the canaries, computed by the step's own matmuls, send
    that step to float64. The control: with their verdict forced to "exact"
    the same record escapes its bound 11 times over."""
    monkeypatch.setattr(gram_precision, "_probe", lambda shape, xla: None)
    monkeypatch.setattr(gram_precision, "_probes", {})
    monkeypatch.setattr(rounding, "float32_products", _bfloat16_products)
    x, g = _crafted_record()
    truth = _exact(x, g)
    assert np.all(_bound(x, g) >= truth)
    original = gram_precision.checked_gram
    monkeypatch.setattr(gram_precision, "checked_gram",
                        lambda rows: (original(rows)[0], tf.constant(True)))
    assert np.max(truth / _bound(x, g)) > 10.0


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shape", [(3, 2, 1), (3, 2, 2), (2, 5, 256), (2, 3, 300), (1, 2, 4097)])
def test_the_canaries_are_exact_in_float32(shape, jit):
    """One column, one chunk, two chunks (the last padded), two matmul
    blocks; with and without XLA: float32 arithmetic gives exactly the
    expected entries; a bfloat16 reading changes the first canary's, an
    11-bit (float16) accumulator the second's."""
    rows = tf.constant(np.random.default_rng(0).random(shape, np.float32))
    gram, exact = tf.function(gram_precision.checked_gram, jit_compile=jit)(rows)
    assert bool(exact.numpy())
    alone = tf.function(rounding.float32_gram, jit_compile=jit)(rows)  # the same summation order
    np.testing.assert_array_equal(gram.numpy(), alone.numpy())
    canary_rows, expected = gram_precision.canaries(*shape[1:])
    narrow = tf.function(_bfloat16_products)(tf.constant(canary_rows)).numpy()
    assert not np.array_equal(narrow.astype(np.float64)[0], expected[0])
    if shape[2] >= 2:
        products = canary_rows[1, 0].astype(np.float16) * canary_rows[1, 1].astype(np.float16)
        accumulated = np.float16(0.0)
        for product in products:
            accumulated = np.float16(accumulated + product)
        assert expected[1, 0, 1] == 1.0 + 2.0**-22 and accumulated == 1.0


_SUBPROCESS = r"""
import os, sys, numpy as np, tensorflow as tf
sys.path.insert(0, {tests!r})
from test_gram_precision import _crafted_record, _exact, _bound
from tfdp.per_example import gram_precision
x, g = _crafted_record()
truth = _exact(x, g)
print("settings", gram_precision.gram_path())
print("settings_ratio", np.max(truth / _bound(x, g)))
# oneDNN reads the variable when it makes its first float32 matmul: make
# one, then hide the variable from tfdp; only the probe (and the canaries)
# can then see what the matmul does.
rows = np.float32(1.0 + np.arange(1, 25) * 2.0**-20).reshape(4, 2, 3)
product = tf.function(lambda r: tf.matmul(r, r, transpose_b=True))(tf.constant(rows)).numpy()
reduced = not np.array_equal(product, np.float32(np.einsum("bsk,btk->bst", rows, rows)))
del os.environ["DNNL_DEFAULT_FPMATH_MODE"]
print("reduced", reduced)
print("probe", gram_precision.gram_rounds_as_float32(x.shape, g.shape), gram_precision.gram_path())
print("probe_ratio", np.max(truth / _bound(x, g)))
"""


def test_dnnl_bf16_mode_takes_float64_grams_in_a_real_process():
    """DNNL_DEFAULT_FPMATH_MODE=BF16 (read by oneDNN when TensorFlow
    starts, so a subprocess): the settings check names it and the crafted
    record stays within its bound; with the variable hidden from tfdp, the
    probe sees the bfloat16 matmul where this CPU runs one (AMX, AVX512-BF16)
    and the record stays within its bound again."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, DNNL_DEFAULT_FPMATH_MODE="BF16", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", _SUBPROCESS.format(tests=tests)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["settings"] == "float64 Gram products (DNNL_DEFAULT_FPMATH_MODE=BF16)"
    assert float(lines["settings_ratio"]) <= 1.0
    assert float(lines["probe_ratio"]) <= 1.0
    if lines["reduced"] == "True":  # this CPU runs float32 batched matmuls in bfloat16
        assert lines["probe"].startswith("False float64 Gram products (the precision probe")
    else:
        assert lines["probe"].startswith("True float32")
