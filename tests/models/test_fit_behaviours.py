"""DPModel.fit behaviours the rest of the suite does not reach.

class_weight acts before clipping, a NaN sample weight drops its row and is
counted, the default logging delta is min(1e-5, 1/N), XLA (jit_compile=True)
gives the eager step's numbers even for an oversized Poisson draw, and
`tfdp train --dataset fashion_mnist` runs on IDX files in a folder.
"""

import gzip
import json
import struct

import keras
import numpy as np
import pytest

import tfdp
from tfdp import cli, recipes
from tfdp.data import PoissonSampler
from tests.forced_draws import force_draws
from tests.noiseless import NoiselessDPSGD

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def linear_model(inputs=2, classes=2):
    return tfdp.DPSequential(
        [keras.Input((inputs,)), keras.layers.Dense(classes, use_bias=False, kernel_initializer="zeros")]
    )


def one_step(x, y, clip=1.0, jit_compile=False, **fit_kwargs):
    """Kernel after one noiseless full-batch step (lr 1), and the History."""
    model = linear_model(x.shape[1])
    model.compile(optimizer=NoiselessDPSGD(1.0, l2_norm_clip=clip, noise_multiplier=1.0), loss=LOSS,
                  jit_compile=jit_compile)
    history = model.fit(x, y, batch_size=len(x), epochs=1, steps_per_epoch=1, verbose=0, **fit_kwargs)
    return model.layers[-1].kernel.numpy(), history


# At the zero kernel the softmax is (1/2, 1/2): record x = e_i of class c has the
# gradient e_i (p - onehot(c)), of norm sqrt(1/2).
X = np.eye(2, dtype=np.float32)
Y = np.array([0, 1])
HALF = np.float32(np.sqrt(0.5))


def test_class_weight_scales_the_loss_before_clipping():
    """Class 0 weighted 1000: its gradient (norm 707) is clipped to C = 1, so it
    moves the kernel by C / b like any record, not by 1000 times its clipped term."""
    kernel, _ = one_step(X, Y, class_weight={0: 1000.0, 1: 1.0})
    # Record 0: 1000 * [-1/2, 1/2] clipped to norm 1; record 1: [1/2, -1/2] unclipped.
    expected = -np.array([[-HALF, HALF], [0.5, -0.5]], np.float32) / 2
    np.testing.assert_allclose(kernel, expected, rtol=1e-5)
    # Negative control: weighting after clipping would move row 0 by 1000 * 0.5 / 2.
    assert np.abs(kernel[0]).max() < 1.0


def test_a_nan_sample_weight_drops_its_row_and_is_counted():
    x = np.array([[1, 0], [0, 1], [1, 1]], np.float32)
    y = np.array([0, 1, 1])
    dropped, nan_history = one_step(x, y, sample_weight=np.array([1.0, np.nan, 1.0], np.float32))
    zeroed, zero_history = one_step(x, y, sample_weight=np.array([1.0, 0.0, 1.0], np.float32))
    assert np.all(np.isfinite(dropped))
    np.testing.assert_allclose(dropped, zeroed, rtol=1e-6)  # exactly the row's absence
    assert nan_history.history["nonfinite_examples"] == [1.0]
    # A zero weight is not a fault (and a zero count is not logged).
    assert "nonfinite_examples" not in zero_history.history
    assert np.isfinite(nan_history.history["loss"][0])
    # Negative control: the row does move the weights when its weight is 1.
    kept, _ = one_step(x, y, sample_weight=np.ones(3, np.float32))
    assert not np.allclose(kept, dropped)


@pytest.mark.parametrize("num_examples, delta", [(100_000, 1e-5), (250_000, 1 / 250_000)])
def test_default_logging_delta_is_the_smaller_of_1e_5_and_1_over_n(num_examples, delta):
    x = np.zeros((num_examples, 1), np.float32)
    model = linear_model(1)
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=0.6, seed=0),
                  loss=LOSS)
    history = model.fit(x, np.zeros(num_examples, np.int64), batch_size=2500, epochs=1,
                        steps_per_epoch=3, verbose=0)
    logged = history.history["epsilon"][0]
    assert logged == pytest.approx(model.privacy.epsilon(delta), rel=1e-12)
    if delta != 1e-5:  # the two deltas give distinguishable epsilons here
        assert logged > model.privacy.epsilon(1e-5) * 1.001


def test_jit_compile_gives_the_eager_step_even_for_an_oversized_poisson_draw(monkeypatch):
    """The second draw holds more records than the padded batch: the XLA step
    recompiles for the larger shape and still equals the eager step."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = rng.integers(0, 2, 64)
    draws = [np.arange(0, 64, 4), np.arange(64)]

    force_draws(monkeypatch, draws)

    def run(jit_compile):
        model = linear_model(4)
        model.compile(optimizer=NoiselessDPSGD(0.5, l2_norm_clip=0.5, noise_multiplier=1.0), loss=LOSS,
                      jit_compile=jit_compile)
        assert model.jit_compile is jit_compile
        history = model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)
        assert model.privacy.steps == 2
        return model.layers[-1].kernel.numpy(), history.history["loss"][0]

    padded = PoissonSampler(64, 16).padded_size
    assert len(draws[1]) > padded  # oversized
    eager, eager_loss = run(False)
    xla, xla_loss = run(True)
    assert np.abs(eager).max() > 0
    np.testing.assert_allclose(xla, eager, rtol=1e-4, atol=1e-6)
    assert xla_loss == pytest.approx(eager_loss, rel=1e-4)


def _idx(array):
    array = np.asarray(array, np.uint8)
    return struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def test_tfdp_train_fashion_mnist_on_idx_files_in_a_folder(tmp_path, capsys):
    """The Fashion-MNIST recipe (SGD momentum 0.9) end to end on 64 tiny records."""
    rng = np.random.default_rng(0)
    for name, array in {"train-images-idx3-ubyte": rng.integers(0, 256, (64, 28, 28)),
                        "train-labels-idx1-ubyte": rng.integers(0, 10, 64),
                        "t10k-images-idx3-ubyte": rng.integers(0, 256, (16, 28, 28)),
                        "t10k-labels-idx1-ubyte": rng.integers(0, 10, 16)}.items():
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress(_idx(array)))
    path = tmp_path / "fashion.keras"
    code = cli.main(["train", "--dataset", "fashion_mnist", "--data-dir", str(tmp_path), "--epochs", "1",
                     "--batch-size", "16", "--epsilon", "3", "--seed", "0", "--verbose", "0",
                     "--output", str(path)])
    assert code in (0, None)
    result = json.loads(capsys.readouterr().out)
    recipe = recipes.DEFAULTS["fashion_mnist"]
    assert result["dataset"] == "fashion_mnist" and result["steps"] == 4
    assert result["momentum"] == recipe["momentum"] == 0.9
    assert 0.0 <= result["test_accuracy"] <= 1.0 and 0 < result["epsilon"] <= 3.0
    inner = keras.models.load_model(path).optimizer.inner_optimizer
    assert inner.momentum == pytest.approx(0.9)
    assert inner.nesterov == recipe.get("nesterov", False)
