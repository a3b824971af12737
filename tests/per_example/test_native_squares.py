"""The compiled row squares give their TensorFlow reference's values bit
for bit, the reference runs, named, wherever the compiled op cannot, and the
DP step measures its rows with whichever runs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.mechanisms.native import build
from tfdp.per_example import grads, native_squares, rounding
from tests.per_example.compiled_ops import required_library

WIDTHS = [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 33, 100, 127, 128, 129, 511, 512, 784, 1000,
          4095, 4096]


@pytest.fixture(scope="module")
def library():
    """The compiled op (built on first use); CI must have it."""
    return required_library(native_squares._load(), "row squares")


def bits(tensor):
    return tensor.numpy().view(np.uint32)


def run(function, compiled):
    return tf.function(function)() if compiled else function()


@pytest.mark.parametrize("compiled", [True, False], ids=["tf.function", "eager"])
@pytest.mark.parametrize("width", WIDTHS)
def test_the_squares_are_the_halving_sum_bit_for_bit(library, compiled, width):
    rows = tf.constant(native_squares.check_rows(np.random.default_rng(width), [37, 3, width]))
    want = run(lambda: native_squares.halving_sum_of_squares(rows), compiled)
    got = run(lambda: library.tfdp_row_squares(rows), compiled)
    assert got.shape == want.shape == [37, 3]
    np.testing.assert_array_equal(bits(want), bits(got))


def test_the_crafted_rows_flush_overflow_and_round_by_order(library):
    """The control of the test above: its rows' sums overflow, flush to
    zero in a step's thread and carry NaN; and the order matters: on plain
    normal rows TensorFlow's own reduction of the same squares differs in
    some bits, which the bit-equality would have seen."""
    rows = native_squares.check_rows(np.random.default_rng(784), [2000, 784])
    rows[0] = np.finfo(np.float32).tiny / 4  # every square flushes
    summed = tf.function(lambda: library.tfdp_row_squares(tf.constant(rows)))().numpy()
    assert np.isinf(summed).sum() > 50 and np.isnan(summed).sum() > 50 and summed[0] == 0.0
    assert np.isfinite(summed).sum() > 500  # rows whose sums round, with subnormal entries
    assert np.sum(np.isfinite(summed) & (np.abs(rows) < 2e-38).any(1)) > 500
    plain = tf.constant(np.random.default_rng(0).normal(size=(2000, 784)).astype(np.float32))
    ours = tf.function(lambda: library.tfdp_row_squares(plain))().numpy()
    other_order = tf.function(lambda: tf.reduce_sum(tf.square(plain), -1))().numpy()
    assert np.sum(ours != other_order) > 100


def test_the_rank_and_width_are_checked(library):
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="rows"):
        library.tfdp_row_squares(tf.constant(3.0))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="width 0"):
        library.tfdp_row_squares(tf.zeros([2, 0]))
    assert float(library.tfdp_row_squares(tf.constant([2.0, 3.0]))) == 13.0


class _OtherOrder:
    """A planted library that sums the squares in TensorFlow's reduction
    order: its self-check must fail."""

    def tfdp_row_squares(self, rows):
        return tf.reduce_sum(tf.square(rows), -1)


def test_the_self_check_refuses_another_order(library):
    assert "differ" in native_squares._self_check(_OtherOrder(), seed=0)
    assert native_squares._self_check(library, seed=0) is None  # negative control


def test_a_failed_self_check_runs_the_reference_and_says_why(monkeypatch):
    monkeypatch.setattr(native_squares, "_loaded", (None, "the check failed"))
    assert native_squares.library_here() is None
    assert native_squares.squares_path() == "TensorFlow's ops (the check failed)"
    rows = tf.constant([[1.0, 2.0, 2.0]])
    assert float(native_squares.row_squares(rows)[0]) == 9.0
    monkeypatch.setenv(build.ENV_SWITCH, "graph")
    assert native_squares.squares_path() == f"TensorFlow's ops ({build.ENV_SWITCH}=graph)"


def test_the_gradient_is_the_references(library):
    rows = tf.constant(native_squares.check_rows(np.random.default_rng(1), [5, 33])
                       .clip(-10, 10))
    rows = tf.where(tf.math.is_finite(rows), rows, 1.5)
    weights = tf.range(5, dtype=tf.float32) - 2.0

    def gradient(squares):
        with tf.GradientTape() as tape:
            tape.watch(rows)
            total = tf.reduce_sum(squares(rows) * weights)
        return tape.gradient(total, rows)

    np.testing.assert_array_equal(bits(gradient(library.tfdp_row_squares)),
                                  bits(gradient(native_squares.halving_sum_of_squares)))


def _op_types(function):
    return {op.type for op in tf.function(function).get_concrete_function().graph.get_operations()}


def test_a_dense_layers_norms_sum_squares_with_the_compiled_op(library, monkeypatch):
    x, g = tf.ones([4, 1, 6]), tf.ones([4, 1, 3])
    kernel, bias = tf.Variable(tf.zeros([6, 3])), tf.Variable(tf.zeros([3]))

    def norms():
        return grads.LinearGrads(x, g, kernel, bias).sq_norm_bounds()

    assert "TfdpRowSquares" in _op_types(norms)
    monkeypatch.setattr(native_squares, "library_here", lambda: None)
    reference = _op_types(norms)  # the control: TensorFlow's ops where there is no library
    assert "TfdpRowSquares" not in reference and "Square" in reference


def _trained_weights(monkeypatch, compiled):
    """(the weights after a seeded DP fit of a small Dense model, the
    libraries its trace was given), with the compiled row squares or the
    reference (the same noise kernel either way)."""
    given = []
    original = native_squares.library_here

    def recorded():
        given.append(original() if compiled else None)
        return given[-1]

    monkeypatch.setattr(native_squares, "library_here", recorded)
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 20)).astype(np.float32)
    x[:4] *= 1e3  # records clipped hard
    y = rng.normal(size=(64, 2)).astype(np.float32)
    model = tfdp.DPSequential([keras.Input((20,)), keras.layers.Dense(33, activation="tanh"),
                               keras.layers.Dense(2)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=0.1, noise_multiplier=1.0,
                                                  seed=3), loss="mse")
    before = [w.copy() for w in model.get_weights()]
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    trained = model.get_weights()
    assert not np.array_equal(trained[0], before[0])  # the control: the fit moved the weights
    return trained, given


def test_a_dp_fit_trains_the_same_weights_with_the_compiled_squares(library, monkeypatch):
    with monkeypatch.context() as patched:
        compiled, given = _trained_weights(patched, compiled=True)
    assert given and all(g is library for g in given)
    with monkeypatch.context() as patched:
        reference, given = _trained_weights(patched, compiled=False)
    assert given and not any(given)
    assert [w.shape for w in compiled] == [w.shape for w in reference]
    for a, b in zip(compiled, reference):
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8),
                                      np.atleast_1d(b).view(np.uint8))


def test_row_bounds_bound_the_rows_from_row_squares(monkeypatch):
    """`rounding.row_bounds` takes its float32 sums from `row_squares` (a
    row of 3, 4: 25 before its margins)."""
    calls = []
    original = native_squares.row_squares
    monkeypatch.setattr(native_squares, "row_squares",
                        lambda rows: calls.append(rows.shape) or original(rows))
    bounds = rounding.row_bounds(tf.constant([[[3.0, 4.0]]])).numpy()
    assert calls == [tf.TensorShape([1, 1, 2])]
    assert 5.0 <= bounds[0, 0] < 5.0 * (1 + 1e-6)


def test_float64_rows_take_the_reference_in_float64(library, monkeypatch):
    """A float64 input's rows (`as_float32` leaves float64 alone) are summed
    by the reference in float64, never cast to the float32 op."""
    rows = tf.constant(np.random.default_rng(2).normal(size=(6, 129)))
    got = native_squares.row_squares(rows)
    assert got.dtype == tf.float64
    np.testing.assert_array_equal(got.numpy(), native_squares.halving_sum_of_squares(rows).numpy())
    assert "TfdpRowSquares" not in _op_types(lambda: native_squares.row_squares(rows))
    assert "TfdpRowSquares" in _op_types(  # the control: float32 rows take the op
        lambda: native_squares.row_squares(tf.cast(rows, tf.float32)))
