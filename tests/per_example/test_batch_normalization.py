"""Pretrained CNNs: a frozen BatchNormalization is a per-example affine map
(Keras runs it in inference mode whatever `training` says, and its
statistics never move), so DP training accepts it; a trainable one
normalizes over the batch and is refused, at compile and at a fit after it
was unfrozen; `fix_batch_normalization` replaces trainable ones with
GroupNormalization, keeping the weights that carry over."""

import keras
import numpy as np
import pytest

import tfdp
from tfdp.auditing.neighbour_step import NeighbourStep
from tfdp.per_example import fix_batch_normalization

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
TOLERANCE = 1.0 + 1e-5


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8, 8, 3)).astype("float32"), rng.integers(0, 3, n)


def _cnn(frozen=True, **norm_settings):
    inputs = keras.Input((8, 8, 3))
    hidden = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    norm = keras.layers.BatchNormalization(name="bn", **norm_settings)
    hidden = norm(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    outputs = keras.layers.Dense(3, name="head")(hidden)
    # Statistics that are not the identity, as a pretrained layer has.
    norm.moving_mean.assign(np.full(4, 0.5, "float32"))
    norm.moving_variance.assign(np.full(4, 2.0, "float32"))
    norm.trainable = not frozen
    return tfdp.DPModel(inputs, outputs), norm


def _compile(model, jit_compile=False):
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=LOSS, jit_compile=jit_compile)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_frozen_batch_normalization_trains_on_the_batched_path_and_its_statistics_stay(
        jit_compile):
    model, norm = _cnn(frozen=True)
    _compile(model, jit_compile)
    before = [v.numpy().copy() for v in norm.weights]
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert "batched pass" in model.per_example_path
    assert all(np.array_equal(v.numpy(), b) for v, b in zip(norm.weights, before))
    assert not np.array_equal(model.get_layer("conv").kernel.numpy(), 0.0)


def test_a_frozen_batch_normalization_keeps_a_crafted_records_effect_within_the_bound():
    model, _ = _cnn(frozen=True)
    _compile(model)
    x, y = _data(8)
    records = [(x[0] * 1e6, y[0]), (x[1] * 1e-30, y[1]), (np.full_like(x[0], 3e38), y[2])]
    with NeighbourStep(model, (x, y), records=3, batch_size=4, physical_batch_size=None) as step:
        ratios = [step.ratio(record, relation) for record in records
                  for relation in ("add", "replace")]
    assert max(ratios) <= TOLERANCE, ratios


def test_a_trainable_batch_normalization_is_refused_with_the_fixes():
    model, _ = _cnn(frozen=False)
    with pytest.raises(ValueError, match="'bn'.*trainable.*Freeze it.*fix_batch_normalization"):
        _compile(model)


def test_a_batch_normalization_unfrozen_after_compile_is_refused_before_a_step():
    model, norm = _cnn(frozen=True)
    _compile(model)
    norm.trainable = True
    x, y = _data()
    with pytest.raises(ValueError, match="'bn'.*trainable"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 0


@pytest.mark.parametrize("hook", ["on_train_begin", "on_train_batch_begin"])
def test_a_batch_normalization_unfrozen_by_a_callback_before_the_trace_is_refused(hook):
    """A callback runs after fit's own check and before Keras traces the
    step: the step's trace checks again (found by review; the moving mean
    held the batch's features before)."""
    model, norm = _cnn(frozen=True, center=False, scale=False)
    _compile(model)

    class Unfreeze(keras.callbacks.Callback):
        pass

    setattr(Unfreeze, hook, lambda self, *args, **kwargs: setattr(norm, "trainable", True))
    statistics = norm.moving_mean.numpy().copy()
    x, y = _data()
    with pytest.raises(ValueError, match="'bn'.*trainable"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Unfreeze()])
    np.testing.assert_array_equal(norm.moving_mean.numpy(), statistics)
    assert int(model._dp_steps.numpy()) == 0


def test_the_fixer_replaces_trainable_batch_normalization_keeping_weights():
    model, norm = _cnn(frozen=False)
    norm.gamma.assign(np.arange(1, 5, dtype="float32"))
    fixed, changes = fix_batch_normalization(model, groups=2)
    assert changes == ["'bn': BatchNormalization -> GroupNormalization(groups=2, axis=-1)"]
    assert isinstance(fixed, tfdp.DPModel)
    replaced = fixed.get_layer("bn")
    assert isinstance(replaced, keras.layers.GroupNormalization)
    np.testing.assert_array_equal(replaced.gamma.numpy(), [1, 2, 3, 4])
    for name in ("conv", "head"):
        for a, b in zip(model.get_layer(name).weights, fixed.get_layer(name).weights):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    _compile(fixed)
    x, y = _data()
    fixed.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert "batched pass" in fixed.per_example_path


def test_the_fixer_keeps_frozen_layers_and_refuses_subclassed_models():
    model, _ = _cnn(frozen=True)
    fixed, changes = fix_batch_normalization(model)
    assert changes == [] and isinstance(fixed.get_layer("bn"), keras.layers.BatchNormalization)
    assert not fixed.get_layer("bn").trainable

    class Sub(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ValueError, match="subclassed"):
        fix_batch_normalization(Sub())


def test_a_keras_applications_base_frozen_then_top_blocks_unfrozen_with_bn_frozen():
    """keras.io's transfer-learning recipe, offline (random weights): a
    frozen MobileNetV2 base under a new head, then its last block unfrozen
    with its BatchNormalization layers kept frozen."""
    base = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None,
                                          include_top=False)
    base.trainable = False
    inputs = keras.Input((32, 32, 3))
    hidden = keras.layers.GlobalAveragePooling2D()(base(inputs, training=False))
    model = tfdp.DPModel(inputs, keras.layers.Dense(3)(hidden))
    _compile(model)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 32, 32, 3)).astype("float32"), rng.integers(0, 3, 16)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    base.trainable = True
    for layer in base.layers[:-10]:
        layer.trainable = False
    for layer in base.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False
    _compile(model)
    statistics = [v.numpy().copy() for v in base.non_trainable_weights]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert "batched pass" in model.per_example_path
    assert all(np.array_equal(v.numpy(), s) for v, s in zip(base.non_trainable_weights, statistics))
