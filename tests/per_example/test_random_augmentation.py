"""Keras's random augmentation layers train on the batched path, each
example's transform keyed by its own content (tfdp.per_example.random_augmentation)."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.per_example import compute_per_example_gradients
from tfdp.per_example.random_augmentation import keyed_call

L = keras.layers
IMAGES = tf.constant(np.random.default_rng(0).random((5, 12, 12, 3)).astype("float32"))
LAYERS = {
    "flip": lambda: L.RandomFlip(seed=3),
    "rotation": lambda: L.RandomRotation(0.2, seed=3),
    "zoom": lambda: L.RandomZoom(0.3, seed=3),
    "translation": lambda: L.RandomTranslation(0.2, 0.2, seed=3),
    "contrast": lambda: L.RandomContrast(0.5, seed=3),
    "crop": lambda: L.RandomCrop(8, 8, seed=3),
    "brightness": lambda: L.RandomBrightness(0.3, value_range=(0, 1), seed=3),
}


def _twice(layer, call, first, second):
    """`call` on two batches from the same seed state."""
    generator = layer._get_seed_generator("tensorflow")
    state = generator.state.numpy()
    a = call(tf.gather(IMAGES, first))
    generator.state.assign(state)
    return a, call(tf.gather(IMAGES, second))


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_an_examples_transform_does_not_depend_on_the_others(name):
    layer = LAYERS[name]()
    layer.build(IMAGES.shape)
    a, b = _twice(layer, lambda t: keyed_call(layer, layer.call, t, training=True), [0, 1, 2], [3, 0])
    np.testing.assert_array_equal(a[0], b[1])  # example 0 alone decides its transform


def test_negative_control_keras_draws_by_batch_position():
    layer = LAYERS["rotation"]()
    layer.build(IMAGES.shape)
    a, b = _twice(layer, lambda t: layer(t, training=True), [0, 1, 2], [3, 0])
    assert not np.allclose(a[0], b[1])


def test_the_examples_of_a_batch_get_different_transforms():
    layer = L.RandomFlip("horizontal", seed=0)
    same = tf.repeat(IMAGES[:1], 1, axis=0)
    batch = tf.concat([IMAGES] * 8, axis=0) + tf.range(40, dtype=tf.float32)[:, None, None, None]
    out = keyed_call(layer, layer.call, batch, training=True)
    flipped = [not np.allclose(o, b) for o, b in zip(out.numpy(), batch.numpy())]
    assert 0 < sum(flipped) < 40 and same.shape[0] == 1


def test_not_training_is_the_identity():
    layer = L.RandomRotation(0.3, seed=1)
    np.testing.assert_array_equal(keyed_call(layer, layer.call, IMAGES, training=False), IMAGES)


def _model():
    inputs = keras.Input((12, 12, 3))
    augment = keras.Sequential([L.RandomFlip("horizontal", seed=1, name="flip"),
                               L.RandomRotation(0.1, seed=2, name="rotate")])
    h = L.Conv2D(4, 3, activation="relu")(augment(inputs))
    return tfdp.DPModel(inputs, L.Dense(2)(L.GlobalAveragePooling2D()(h)))


def test_keras_io_augmentation_takes_the_batched_path_and_trains_without_warning(caplog):
    model = _model()
    assert model.per_example_path == (
        "per-example gradients: batched pass with per-layer rules; random augmentation "
        "keyed per example: rotate, flip")
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(1).random((32, 12, 12, 3)).astype("float32")
    with caplog.at_level(logging.WARNING, logger="tfdp"):
        model.fit(x, np.arange(32) % 2, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0)
    assert model.privacy.steps == 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_records_gradient_does_not_depend_on_the_other_records():
    model = _model()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    generators = [layer._get_seed_generator("tensorflow") for layer in model._flatten_layers()
                  if isinstance(layer, (L.RandomFlip, L.RandomRotation))]
    states = [g.state.numpy() for g in generators]

    def norm_of_record_0(order):
        for generator, state in zip(generators, states):
            generator.state.assign(state)
        x = tf.gather(IMAGES, order)
        grads, _, _ = compute_per_example_gradients(
            model, x, tf.zeros([len(order)], tf.int64), tf.ones([len(order)]), loss, method="batched")
        return grads.sq_norms().numpy()[order.index(0)]

    assert norm_of_record_0([0, 1, 2]) == norm_of_record_0([4, 3, 0])


def test_a_record_drawn_first_moves_no_other_records_transform_across_chunks():
    """In physical chunks each chunk drew its own key: a record drawn
    before the others moved one of them to the next chunk, onto another
    key (`tfdp.per_example.step_keys`); the compiled step, noise 0."""
    from tfdp.auditing.neighbour_step import NeighbourStep

    model = _model()
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=0.01, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(2).random((3, 12, 12, 3)).astype("float32")
    with NeighbourStep(model, (x, np.array([0, 1, 0])), records=3, batch_size=4,
                       physical_batch_size=2) as step:
        ratios = [step.ratio((np.full((12, 12, 3), value, np.float32), 1), relation)
                  for value in (0.5, 50.0) for relation in ("add", "add, record first")]
    assert max(ratios) <= 1.0 + 1e-5, ratios


@pytest.mark.parametrize("layer, words", [
    (L.RandAugment(), ["augment=augment, augmentations=1", "stateless_random"]),
    (L.MixUp(), ["mixes examples", "fit(augment=augment, augmentations=1)"]),
])
def test_an_augmentation_layer_that_is_not_keyed_names_the_replacement(layer, words):
    inputs = keras.Input((12, 12, 3))
    model = tfdp.DPModel(inputs, L.Dense(2)(L.GlobalAveragePooling2D()(layer(inputs))))
    path = model.per_example_path
    assert "vectorized_map" in path and all(word in path for word in words), path
    assert "declare_per_example" not in path  # Keras's own layers draw by batch position


def test_a_custom_augmentation_subclass_may_be_declared():
    class MyFlip(L.RandomFlip):
        pass

    inputs = keras.Input((12, 12, 3))
    model = tfdp.DPModel(inputs, L.Dense(2)(L.GlobalAveragePooling2D()(MyFlip()(inputs))))
    assert "tfdp.per_example.declare_per_example(MyFlip)" in model.per_example_path
    assert "augment=augment, augmentations=1" in model.per_example_path
