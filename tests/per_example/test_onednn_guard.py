"""A transformer on the whole-model vectorized path is refused, not crashed.

With oneDNN (TensorFlow's default CPU kernels) the vectorized path's
[B, 1, S, H] x [H, O] matmuls killed the process inside `fit`. The model runs
in a subprocess so that a crash fails the test instead of the test run.
"""

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import keras, numpy as np, tfdp

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 16))
    h = keras.layers.Lambda(lambda t: t * 2.0, name="opaque")(inputs)
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(h, h)
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
    model = tfdp.DPModel(inputs, outputs)
    model.compile(optimizer=tfdp.optimizers.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                  learning_rate=0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.normal(size=(32, 8, 16)).astype("float32")
    y = np.random.randint(0, 2, 32)
    try:
        for _ in range(3):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    except ValueError as error:
        print("REFUSED:", error)
    else:
        print("TRAINED")
    """
)


_CUSTOM_LAYER = textwrap.dedent(
    """
    @tfdp.per_example.declare_per_example
    class Projection(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], shape[-1]))

        def call(self, x):
            hidden = keras.ops.tanh(keras.ops.einsum("abc,cd->abd", x, self.w))
            return keras.ops.einsum("abc,cd->abd", hidden, self.w)
    """
)

# A declared custom layer with weights and no rule takes the per-layer
# vectorized vjp: the same [B, 1, S, H] x [H, O] matmul, the same crash.
_PER_LAYER_SCRIPT = _SCRIPT.replace(
    'h = keras.layers.Lambda(lambda t: t * 2.0, name="opaque")(inputs)',
    'h = Projection(name="projection")(inputs)',
).replace("keras.utils.set_random_seed(0)", "keras.utils.set_random_seed(0)\n" + _CUSTOM_LAYER)

_SEPARATOR = "=== the per-layer fallback ==="


def _run(onednn, script=_SCRIPT):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def with_onednn():
    """Both oneDNN models in one fresh interpreter (one TensorFlow import, not
    two): the whole-model vectorized one, then the per-layer fallback one.
    Each is refused before its first step, so neither can crash the other's
    run; a crash of either fails both tests."""
    result = _run("1", _SCRIPT + f"\nprint({_SEPARATOR!r})\n" + _PER_LAYER_SCRIPT)
    assert result.returncode == 0, result.stderr[-2000:]
    whole_model, _, per_layer = result.stdout.partition(_SEPARATOR)
    assert per_layer, result.stdout
    return whole_model, per_layer


def test_onednn_vectorized_transformer_is_refused_before_the_first_step(with_onednn):
    whole_model, _ = with_onednn
    assert "REFUSED:" in whole_model and "TF_ENABLE_ONEDNN_OPTS=0" in whole_model
    assert "(None, 1, 8, 16)" in whole_model and "model '" in whole_model


@pytest.mark.parametrize("onednn", ["0"])
def test_without_onednn_the_same_model_trains(onednn):
    result = _run(onednn)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TRAINED" in result.stdout


def test_onednn_per_layer_fallback_on_a_sequence_matmul_is_refused(with_onednn):
    _, per_layer = with_onednn
    assert "REFUSED:" in per_layer and "'projection'" in per_layer
