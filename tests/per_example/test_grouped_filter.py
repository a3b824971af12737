"""The grouped-convolution route to a Conv2D's per-example kernels."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.per_example import grouped_filter, onednn
from tfdp.per_example.grads import LinearGrads
from tfdp.per_example.patches import as_rows, extract_patches
from tfdp.per_example.rules.conv import ConvRule

L = keras.layers


# TensorFlow runs its CPU kernels through oneDNN by default on some CPUs only
# (on an AMD EPYC with AVX2 it does not), and the route needs oneDNN: its
# tests run here where it is on, and in a process that turns it on where it
# is off (`test_the_route_tests_pass_with_onednn_on`).
needs_onednn = pytest.mark.skipif(
    not onednn.onednn_enabled(),
    reason="oneDNN is off here; test_the_route_tests_pass_with_onednn_on runs this test with it on")


def _call(layer, input_shape, seed=0):
    """(layer, x, g): a built layer, an input batch of 3 and an output gradient."""
    layer.build((None,) + input_shape)
    x = tf.random.stateless_normal((3,) + input_shape, [seed, 1])
    out = layer.compute_output_shape((3,) + input_shape)
    g = tf.random.stateless_normal(out, [seed, 2])
    return layer, x, g


@needs_onednn
@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize("kernel_size", [1, 3, (5, 3)])
def test_the_route_computes_the_einsum_of_patches_and_gradients(padding, kernel_size):
    layer, x, g = _call(L.Conv2D(12, kernel_size, padding=padding), (10, 9, 8))
    assert grouped_filter.applies(layer, x, g)
    patches = as_rows(extract_patches(x, layer.kernel_size, layer.strides,
                                      layer.dilation_rate, padding))
    expected = tf.einsum("bsk,bso->bko", patches, as_rows(g))
    got = grouped_filter.per_example_kernels(layer, x, g)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name, layer, input_shape", [
    ("one input channel", L.Conv2D(16, 3), (16, 16, 1)),
    ("64 output channels", L.Conv2D(64, 3), (16, 16, 16)),
    ("strides", L.Conv2D(16, 3, strides=2), (16, 16, 16)),
    ("dilation", L.Conv2D(16, 3, dilation_rate=2), (16, 16, 16)),
    ("groups", L.Conv2D(16, 3, groups=2), (16, 16, 16)),
    ("small side", L.Conv2D(16, 3, padding="same"), (4, 16, 16)),
    ("Conv1D", L.Conv1D(16, 3), (16, 16)),
    ("Conv3D", L.Conv3D(16, 3), (9, 9, 9, 16)),
])
def test_the_route_is_not_taken_outside_the_measured_shapes(name, layer, input_shape):
    layer, x, g = _call(layer, input_shape)
    assert not grouped_filter.applies(layer, x, g), name


@needs_onednn
def test_the_route_is_not_taken_under_xla():
    layer, x, g = _call(L.Conv2D(16, 3, padding="same"), (16, 16, 16))
    seen = []

    @tf.function(jit_compile=True)
    def step(x, g):
        seen.append(grouped_filter.applies(layer, x, g))
        return x

    step(x, g)
    assert seen == [False] and grouped_filter.applies(layer, x, g)


@needs_onednn
def test_the_rule_measures_and_sums_the_tensor_the_route_returns():
    """The norms are the sums of squares of the route's own matrices (not of
    the einsum's), and the weighted sum adds them."""
    layer, x, g = _call(L.Conv2D(8, 3, padding="same", use_bias=False), (9, 9, 8))
    marked = grouped_filter.per_example_kernels(layer, x, g) * tf.constant([1.0, 2.0, 3.0])[:, None, None]
    part = LinearGrads(as_rows(extract_patches(x, (3, 3), (1, 1), (1, 1), "same")), as_rows(g),
                       layer.kernel, matrices=lambda: marked)
    squares = tf.reduce_sum(tf.square(tf.cast(marked, tf.float64)), [1, 2])
    np.testing.assert_allclose(part.sq_norms().numpy(), squares.numpy(), rtol=1e-6)
    weights = tf.constant([0.5, 0.0, 1.0])
    summed = part.weighted_sum(weights)[0]
    expected = tf.reshape(tf.tensordot(weights, marked, axes=1), layer.kernel.shape)
    np.testing.assert_allclose(summed.numpy(), expected.numpy(), rtol=1e-6)


@needs_onednn
def test_the_conv_rule_takes_the_route_where_it_applies(monkeypatch):
    calls = []
    original = grouped_filter.per_example_kernels

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(grouped_filter, "per_example_kernels", counted)
    from tfdp.per_example.recorder import Recorder

    layer, x, _ = _call(L.Conv2D(8, 3, padding="same"), (9, 9, 8))
    with tf.GradientTape() as tape:
        recorder = Recorder(tape)
        with recorder.hooked([(layer, ConvRule())]):
            total = tf.reduce_sum(tf.square(layer(x)))
    recorder.compute_gradients(total)
    part = ConvRule().parts(layer, recorder.records_of(layer))[0]
    part.sq_norms()
    assert calls == [1]


@needs_onednn
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 3e38])
def test_a_crafted_example_changes_no_other_examples_kernels(bad):
    """Folding the batch into channels keeps examples apart: an input of
    inf, NaN or 3e38 (whose products overflow) in one example leaves every
    other example's matrices as they were, bit for bit (else a record could
    void another's gradient, whose bound would drop it)."""
    layer, x, g = _call(L.Conv2D(16, 3, padding="same"), (12, 12, 16))
    clean = grouped_filter.per_example_kernels(layer, x, g).numpy()
    crafted = tf.tensor_scatter_nd_update(x, [[1, 5, 5, 3]], [bad])
    got = grouped_filter.per_example_kernels(layer, crafted, g).numpy()
    np.testing.assert_array_equal(got[[0, 2]], clean[[0, 2]])
    assert np.isfinite(got[[0, 2]]).all()
    assert not np.array_equal(got[1], clean[1], equal_nan=True)


@needs_onednn
@pytest.mark.parametrize("strides, dilation", [(2, 1), ((1, 2), 1), (1, 2)])
def test_the_route_follows_strides_and_dilation_where_asked(strides, dilation):
    """Outside `applies`'s shapes the route is not taken, but it still
    computes the layer's geometry (the benchmark times it there)."""
    layer, x, g = _call(L.Conv2D(8, 3, strides=strides, dilation_rate=dilation,
                                 padding="same"), (11, 10, 8))
    patches = as_rows(extract_patches(x, layer.kernel_size, layer.strides,
                                      layer.dilation_rate, "same"))
    expected = tf.einsum("bsk,bso->bko", patches, as_rows(g))
    got = grouped_filter.per_example_kernels(layer, x, g)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-4)


def test_the_route_is_not_taken_without_onednn(monkeypatch):
    """TensorFlow's own CPU kernel has no grouped kernel gradient (it read
    the filter as [kh, kw, B Cin, B Cout] and failed for every B > 1)."""
    layer, x, g = _call(L.Conv2D(16, 3, padding="same"), (16, 16, 16))
    assert grouped_filter.applies(layer, x, g) == onednn.onednn_enabled()
    monkeypatch.setattr(onednn, "onednn_enabled", lambda: False)
    assert not grouped_filter.applies(layer, x, g)
    with pytest.raises(ValueError, match="needs TensorFlow's oneDNN CPU kernels"):
        grouped_filter.per_example_kernels(layer, x, g)


def test_the_route_tests_pass_with_onednn_on():
    """Where oneDNN is off, the route's tests above and this module's
    docstring run in a process that turns it on."""
    if onednn.onednn_enabled():
        pytest.skip("oneDNN is on here: the route's tests ran in this process")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         __file__, os.path.join(tests, "..", "test_docstring_examples.py"),
         "-k", "(test_grouped_filter and not with_onednn_on) or grouped_filter]"],
        env=env, capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary, summary


_FIT_WITHOUT_ONEDNN = textwrap.dedent(
    """
    import keras, numpy as np, tfdp
    from tfdp.per_example import onednn

    assert not onednn.onednn_enabled()
    model = tfdp.DPSequential([keras.Input((16, 16, 16)), keras.layers.Conv2D(16, 3, padding="same"),
                               keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                  learning_rate=0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(16, 16, 16, 16)).astype("float32")
    model.fit(x, np.arange(16) % 2, batch_size=8, epochs=1, verbose=0)
    print("TRAINED", model.privacy.steps)
    """
)


def test_a_conv_model_trains_with_onednn_off():
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    result = subprocess.run([sys.executable, "-c", _FIT_WITHOUT_ONEDNN], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TRAINED 2" in result.stdout, result.stdout
