"""Pretrained CNNs: a frozen BatchNormalization is a per-example affine map
(Keras runs it in inference mode whatever `training` says, and its
statistics never move), so DP training accepts it; so is a trainable one
called with training=False (its gamma and beta train, its statistics stay);
a trainable one in training mode normalizes over the batch and is refused
before any step, also after it was unfrozen by a callback;
`fix_batch_normalization` replaces trainable ones with GroupNormalization,
keeping the weights that carry over."""

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


def _cnn(frozen=True, training=None, method="auto", **norm_settings):
    inputs = keras.Input((8, 8, 3))
    hidden = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    norm = keras.layers.BatchNormalization(name="bn", **norm_settings)
    hidden = norm(hidden) if training is None else norm(hidden, training=training)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    outputs = keras.layers.Dense(3, name="head")(hidden)
    # Statistics that are not the identity, as a pretrained layer has.
    norm.moving_mean.assign(np.full(4, 0.5, "float32"))
    norm.moving_variance.assign(np.full(4, 2.0, "float32"))
    norm.trainable = not frozen
    return tfdp.DPModel(inputs, outputs, per_example_gradients=method), norm


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


REFUSED = "'bn'.*trainable and runs in training mode.*training=False.*fix_batch_normalization"


@pytest.mark.parametrize("training", [None, True])
@pytest.mark.parametrize("method", ["auto", "vectorized"])
def test_a_trainable_batch_normalization_in_training_mode_is_refused_before_a_step(
        training, method):
    """Left unspecified under fit (which means training=True) or called with
    training=True: refused by name, with the fixes, before any step, its
    statistics untouched."""
    model, norm = _cnn(frozen=False, training=training, method=method)
    _compile(model)
    statistics = [v.numpy().copy() for v in norm.weights]
    x, y = _data()
    with pytest.raises(ValueError, match=REFUSED + r".*Received: training=True"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 0 and int(model._dp_steps.numpy()) == 0
    assert all(np.array_equal(v.numpy(), s) for v, s in zip(norm.weights, statistics))


def test_a_batch_normalization_unfrozen_after_compile_is_refused_before_a_step():
    model, norm = _cnn(frozen=True)
    _compile(model)
    norm.trainable = True
    x, y = _data()
    with pytest.raises(ValueError, match=REFUSED):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 0


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("method", ["auto", "vectorized"])
def test_a_trainable_batch_normalization_called_in_inference_mode_trains_gamma_and_beta_only(
        jit_compile, method):
    model, norm = _cnn(frozen=False, training=False, method=method)
    _compile(model, jit_compile)
    gamma, beta = norm.gamma.numpy().copy(), norm.beta.numpy().copy()
    statistics = [norm.moving_mean.numpy().copy(), norm.moving_variance.numpy().copy()]
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    if method == "auto":
        assert "batched pass" in model.per_example_path
        assert "bn" not in model.per_example_path  # its own rule, not the fallback
    np.testing.assert_array_equal(norm.moving_mean.numpy(), statistics[0])
    np.testing.assert_array_equal(norm.moving_variance.numpy(), statistics[1])
    assert not np.array_equal(norm.gamma.numpy(), gamma)
    assert not np.array_equal(norm.beta.numpy(), beta)


def test_a_trainable_batch_normalization_in_inference_mode_keeps_a_crafted_records_effect_within_the_bound():
    """Huge, tiny and overflowing activations through gamma's per-example
    gradient sum(G * xhat): every record moves the step by at most C."""
    model, norm = _cnn(frozen=False, training=False)
    norm.moving_variance.assign(np.full(4, 1e-6, "float32"))  # xhat = 1e3 x: large
    _compile(model)
    x, y = _data(8)
    records = [(x[0] * 1e6, y[0]), (x[1] * 1e-30, y[1]), (np.full_like(x[0], 3e38), y[2]),
               (np.full_like(x[0], -1e20), y[0])]
    with NeighbourStep(model, (x, y), records=3, batch_size=4, physical_batch_size=None) as step:
        ratios = [step.ratio(record, relation) for record in records
                  for relation in ("add", "replace")]
    assert max(ratios) <= TOLERANCE, ratios


def test_a_batch_normalization_called_twice_once_in_training_mode_is_refused():
    """Every call is checked: one call with training=False does not admit
    another with training left unspecified."""
    inputs = keras.Input((8, 8, 3))
    norm = keras.layers.BatchNormalization(name="bn")
    hidden = keras.layers.Conv2D(3, 3, padding="same")(inputs)
    hidden = norm(norm(hidden, training=False))
    model = tfdp.DPModel(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(hidden)))
    _compile(model)
    x, y = _data()
    with pytest.raises(ValueError, match=REFUSED):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


class _Block(keras.layers.Layer):
    """A custom layer (not declared per-example: the whole model takes the
    vectorized path) calling its BatchNormalization with `training` fixed."""

    def __init__(self, training, **kwargs):
        super().__init__(**kwargs)
        self.bn = keras.layers.BatchNormalization(name="bn")
        self.training_of_bn = training

    def call(self, x):
        if self.training_of_bn == "unspecified":  # the context's: True under fit
            return self.bn(x)
        return self.bn(x, training=self.training_of_bn)


@pytest.mark.parametrize("training", [False, None, "unspecified"])
def test_a_custom_layer_on_the_vectorized_path_is_checked_call_by_call(training):
    """training=None passed explicitly is Keras's inference mode; left out,
    the BatchNormalization takes fit's training=True and is refused."""
    inputs = keras.Input((8, 8, 3))
    block = _Block(training)
    hidden = block(keras.layers.Conv2D(4, 3)(inputs))
    model = tfdp.DPModel(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(hidden)))
    _compile(model)
    x, y = _data()
    mean = block.bn.moving_mean.numpy().copy()
    if training == "unspecified":
        with pytest.raises(ValueError, match=REFUSED):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    else:
        gamma = block.bn.gamma.numpy().copy()
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert "vectorized" in model.per_example_path
        assert not np.array_equal(block.bn.gamma.numpy(), gamma)
    np.testing.assert_array_equal(block.bn.moving_mean.numpy(), mean)


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


@pytest.mark.parametrize("sequential", [keras.Sequential, tfdp.DPSequential])
def test_the_fixer_works_on_sequential_models(sequential):
    """Issue 55, item 7: Keras refused the clone's call_function on every
    Sequential model, DPSequential included."""
    model = sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, name="conv"),
                        keras.layers.BatchNormalization(name="bn"),
                        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3, name="head")])
    model.get_layer("bn").gamma.assign(np.arange(1, 5, dtype="float32"))
    fixed, changes = fix_batch_normalization(model, groups=2)
    assert type(fixed) is sequential
    assert changes == ["'bn': BatchNormalization -> GroupNormalization(groups=2, axis=-1)"]
    np.testing.assert_array_equal(fixed.get_layer("bn").gamma.numpy(), [1, 2, 3, 4])
    for a, b in zip(model.get_layer("conv").weights, fixed.get_layer("conv").weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    if sequential is tfdp.DPSequential:
        _compile(fixed)
        fixed.fit(*_data(), batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
        assert fixed.privacy.steps == 1


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


class _CustomNorm(keras.layers.BatchNormalization):
    """A BatchNormalization subclass (a custom "FrozenBN" class): not the
    exact class, so the model takes the vectorized path."""


class _Unfreeze(keras.callbacks.Callback):
    """Unfreezes a layer after fit's own checks, before the first step."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def on_train_begin(self, logs=None):
        self.layer.trainable = True


def _small(norm, training=None):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(4, name="dense")(inputs)
    hidden = norm(hidden) if training is None else norm(hidden, training=training)
    model = tfdp.DPModel(inputs, keras.layers.Dense(3, name="head")(hidden))
    _compile(model)
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(16, 6)).astype("float32") * 5 + 3, rng.integers(0, 3, 16)


@pytest.mark.parametrize("training", [None, False])
def test_a_batch_normalization_subclass_unfrozen_at_train_begin_is_checked_call_by_call(training):
    """No weights of its own (center=False, scale=False), frozen at fit's
    checks, unfrozen by a callback: in training mode it wrote its moving
    mean from the records on the vectorized path (a record of 1e30 moved it
    by 1e28; trained on cfab9b6); refused by name now. Called with
    training=False it trains and its statistics stay (negative control)."""
    norm = _CustomNorm(name="bn", center=False, scale=False)
    model, x, y = _small(norm, training)
    norm.trainable = False
    mean = norm.moving_mean.numpy().copy()
    if training is None:
        with pytest.raises(ValueError, match=r"'bn' \(_CustomNorm\) is trainable and runs in "
                                             r"training mode.*Received: training=True"):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[_Unfreeze(norm)])
        assert model.privacy.steps == 0
    else:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[_Unfreeze(norm)])
        assert "vectorized" in model.per_example_path and model.privacy.steps == 2
    np.testing.assert_array_equal(norm.moving_mean.numpy(), mean)


class _CallsCall(keras.layers.Layer):
    """Calls its BatchNormalization's `call` with `training` positional."""

    def __init__(self, training, **kwargs):
        super().__init__(**kwargs)
        self.bn = keras.layers.BatchNormalization(name="bn", center=False, scale=False)
        self.training_of_bn = training

    def build(self, shape):
        self.bn.build(shape)

    def call(self, x):
        return self.bn.call(x, self.training_of_bn)


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _DeclaredCallsCall(_CallsCall):
    """The same, declared to run its sublayers on the batch (batched path)."""


@pytest.mark.parametrize("layer_class", [_CallsCall, _DeclaredCallsCall])
@pytest.mark.parametrize("training", [True, False])
def test_a_positional_training_argument_is_seen(layer_class, training):
    """`bn.call(x, True)`: the check read only a keyword `training`; with the
    layer unfrozen at train begin it normalized over the batch and wrote its
    statistics (trained on cfab9b6). training=False positional trains."""
    block = layer_class(training, name="block")
    model, x, y = _small(block)
    block.bn.trainable = False
    mean = block.bn.moving_mean.numpy().copy()
    if training:
        with pytest.raises(ValueError, match=REFUSED + r".*Received: training=True"):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[_Unfreeze(block.bn)])
        assert model.privacy.steps == 0
    else:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[_Unfreeze(block.bn)])
        assert model.privacy.steps == 2
    np.testing.assert_array_equal(block.bn.moving_mean.numpy(), mean)


@pytest.mark.parametrize("axis", [0, -2])
def test_a_batch_normalization_over_the_batch_axis_is_refused_by_name(axis):
    """axis 0 (with a static batch size) is the batch axis: its gamma and
    statistics are per position in the batch. It failed with Keras's
    input-shape error from the DP step's batch of one."""
    inputs = keras.Input((6,), batch_size=4)
    hidden = keras.layers.BatchNormalization(axis=axis, name="bn")(
        keras.layers.Dense(5)(inputs), training=False)
    model = tfdp.DPModel(inputs, keras.layers.Dense(3)(hidden))
    with pytest.raises(ValueError, match=r"'bn' \(BatchNormalization\).*axis 0.*batch axis"
                                         rf".*Received: axis={axis}"):
        _compile(model)


class _TrainingByDefault(keras.layers.BatchNormalization):
    """A subclass whose `training` defaults to True."""

    def call(self, inputs, training=True, mask=None):
        return super().call(inputs, training=training, mask=mask)


class _CallsCallWithoutTraining(keras.layers.Layer):
    """Calls such a subclass's `call` without `training`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bn = _TrainingByDefault(name="bn", center=False, scale=False)

    def build(self, shape):
        self.bn.build(shape)

    def call(self, x, training=None):
        return self.bn.call(x)


def test_a_subclass_defaulting_to_training_is_refused_by_name_when_its_call_omits_it():
    """`bn.call(x)` on a subclass with `training=True` by default: the hook
    read the omitted argument as None (inference) and let it through."""
    from tfdp.per_example.inference_mode import inference_mode_calls

    model = keras.Sequential([keras.Input((3,)), _CallsCallWithoutTraining(name="block")])
    with inference_mode_calls(model):
        with pytest.raises(ValueError, match=REFUSED + r".*Received: training=True"):
            model(np.ones((2, 3), "float32"), training=True)
