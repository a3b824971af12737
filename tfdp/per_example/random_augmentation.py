"""Keras's random image augmentation layers, keyed per example.

keras.io puts `RandomFlip`, `RandomRotation`, ... inside the model. Keras
draws their random transforms for a whole batch from one seed state, by
position in the batch: adding a record shifts every later record's draw, so
one record would change the others' augmentations. On the batched
per-example path each call of such a layer instead draws one key from the
layer's own seed generator (one a call, the same in every physical chunk:
`tfdp.per_example.step_keys`) and transforms example i alone with the seed
`(key_0 ^ h(x_i), key_1)`, `h` a hash of the example's own inputs to the
model (`tfdp.per_example.keyed_noise.input_keys`: a layer's input may
round differently by row, which a hash would turn into another transform).
For a given key each example's transform is a function of its own data
only, as for
`fit(augment=...)`. The layers mix nothing else: each transforms one image
with statistics of that image alone.

`KEYED_LAYERS` lists the supported classes; `MixUp` and `CutMix` mix
examples and are not in it, nor are the composite `RandAugment`, `AugMix`
and `RandomColorJitter` (their sublayers draw from their own generators).

Example:

>>> import keras, tensorflow as tf
>>> layer = keras.layers.RandomFlip(seed=0)
>>> images = tf.random.stateless_uniform([3, 4, 4, 1], seed=[1, 2])
>>> out = keyed_call(layer, layer.call, images, training=True)
>>> out.shape
TensorShape([3, 4, 4, 1])
"""

import inspect

import keras
import tensorflow as tf
from keras.src.random.seed_generator import SeedGenerator

_L = keras.layers
_NAMES = (
    "RandomFlip", "RandomRotation", "RandomZoom", "RandomTranslation", "RandomContrast",
    "RandomCrop", "RandomBrightness", "RandomColorDegeneration", "RandomElasticTransform",
    "RandomErasing", "RandomGaussianBlur", "RandomGrayscale", "RandomHue", "RandomInvert",
    "RandomPerspective", "RandomPosterization", "RandomSaturation", "RandomSharpness",
    "RandomShear",
)
KEYED_LAYERS = tuple(getattr(_L, name) for name in _NAMES if hasattr(_L, name))


def is_keyed_augmentation(layer):
    """True for a layer of `KEYED_LAYERS` (exactly that class: a subclass
    may draw or mix otherwise)."""
    return type(layer) in KEYED_LAYERS


class _SeedSequence(SeedGenerator):
    """A seed generator whose draws are `seed`, then `seed` folded with 1,
    2, ...: one example's successive draws, stateless. Keras's random ops
    accept it where they accept a `SeedGenerator`."""

    def __init__(self, seed):  # pylint: disable=super-init-not-called
        self._seed = seed
        self._count = 0

    def next(self, ordered=True):
        self._count += 1
        return self._seed + tf.constant([0, 1 << 20], tf.int64) * (self._count - 1)


def training_argument(layer, args, kwargs):
    """The `training` value a call of `layer.call` received (by keyword, as
    its first extra positional argument, or its default)."""
    parameters = inspect.signature(type(layer).call).parameters
    training = kwargs.get("training", args[0] if args else None)
    if training is None and "training" in parameters:
        default = parameters["training"].default
        training = None if default is inspect.Parameter.empty else default
    return training


def keyed_call(layer, call, data, *args, example_keys=None, **kwargs):
    """`layer`'s output on the batch `data`, each example transformed with a
    seed of its own (the module's docstring); `call` (the layer's own) when
    not training or `data` is not a batch of images. `example_keys`: int64
    [B], a hash of each example's inputs to the model (the batched pass's,
    `keyed_noise.input_keys`); None: a hash of `data` itself."""
    from tfdp.models.augmentation import example_hashes

    training = training_argument(layer, args, kwargs)
    if not training or isinstance(data, dict) or len(data.shape) != 4:
        return call(data, *args, **kwargs)
    key = tf.cast(layer._get_seed_generator(keras.backend.backend()).next(), tf.int64)
    hashes = example_hashes(data) if example_keys is None else example_keys
    seeds = tf.stack([tf.bitwise.bitwise_xor(key[0], hashes),
                      tf.broadcast_to(key[1], tf.shape(data)[:1])], axis=1)

    def one(example):
        image, seed = example
        batch = image[None]
        transformation = layer.get_random_transformation(
            batch, training=True, seed=_SeedSequence(seed))
        return layer.transform_images(batch, transformation, training=True)[0]

    signature = tf.TensorSpec(layer.compute_output_shape(data.shape)[1:], layer.compute_dtype)
    return tf.map_fn(one, (data, seeds), fn_output_signature=signature)


class KeyedAugmentation:
    """The batched pass's handler for a `KEYED_LAYERS` layer
    (`tfdp.per_example.recorder`): runs `keyed_call`; no weights, so no
    gradient parts."""

    def call(self, layer, recorder, call, *args, **kwargs):
        recorder.record(layer)
        return keyed_call(layer, call, *args, example_keys=recorder.example_keys, **kwargs)

    def parts(self, layer, records):
        return []


_MIXING = ("MixUp", "CutMix")
_REPLACEMENT = (
    "; move the augmentation out of the model into fit, which keys it per example: "
    "def augment(x, seed): return tf.image.stateless_random_flip_left_right(x, seed)  "
    "(one example, tf.image.stateless_random_* ops), then "
    "model.fit(x, y, augment=augment, augmentations=1)"
)
# Keras's own layers draw by batch position, so declaring them would be wrong.
_DECLARE = ("; or, only if {cls} transforms each example with draws that depend on neither "
            "the other examples nor their number, tfdp.per_example.declare_per_example({cls}) "
            "before building the model")


def augmentation_hint(layer):
    """The fix to append to the fallback reason of an image augmentation
    layer that is not keyed per example ("" for any other layer)."""
    from keras.src.layers.preprocessing.image_preprocessing.base_image_preprocessing_layer import (
        BaseImagePreprocessingLayer,
    )

    if not isinstance(layer, BaseImagePreprocessingLayer) or is_keyed_augmentation(layer):
        return ""
    name = type(layer).__name__
    if name in _MIXING:
        return (f"; {name} mixes examples, so no per-example path can train it privately: "
                "remove it, or augment each example alone with fit(augment=augment, "
                "augmentations=1)")
    if hasattr(_L, name) and getattr(_L, name) is type(layer):
        return _REPLACEMENT
    return _REPLACEMENT + _DECLARE.format(cls=name)
