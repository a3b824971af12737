"""Keras's dropout and noise layers, keyed per example.

Keras draws a Dropout mask (and GaussianNoise's, GaussianDropout's and
AlphaDropout's noise) for the whole batch from one seed, by position in the
batch: a record added before the others moves each of them one row down,
onto another row's mask, so one record would change every other example's
gradient (a review moved a neighbouring step 2.8 times its bound through a
Dropout(0.5), `NeighbourStep`'s "add, record first"). With the seed public
(`keras.utils.set_random_seed` in published code) those masks are known, and
the step's sensitivity is no longer C.

On the batched per-example path each call of such a layer in training mode
instead draws one key from the layer's own seed generator (one a call, the
same in every physical chunk: `tfdp.per_example.step_keys`) and gives
example i the noise of a
counter-based hash of (key, h(x_i), entry index), `h` a hash of the
example's own inputs to the model (`input_keys`), as
`tfdp.per_example.random_augmentation` does for image augmentation: for a
given key each example's noise is a function of its own data only. The
distributions are Keras's: a mask entry is kept with probability 1 - rate
(24-bit uniforms), the normals come from Box-Muller on two of them (tails
cut at 5.8 sigma). A `noise_shape` shares one draw along its unit axes
within an example; its batch entry is ignored (each example draws its own).

Example:

>>> import keras, tensorflow as tf
>>> layer = keras.layers.Dropout(0.5, seed=0)
>>> x = tf.ones([3, 1000])
>>> out = keyed_noise_call(layer, layer.call, None, x, training=True)
>>> sorted(set(out.numpy().ravel().tolist()))
[0.0, 2.0]
>>> same = keyed_noise_call(layer, layer.call, None, tf.ones([2, 1000]), training=True)
>>> bool(tf.reduce_all(same[0] == same[1]))   # equal inputs, equal masks
True
"""

import contextlib
import functools
import math

import keras
import numpy as np
import tensorflow as tf

from tfdp.per_example.random_augmentation import training_argument

_L = keras.layers
_DROPOUTS = (_L.Dropout, _L.SpatialDropout1D, _L.SpatialDropout2D, _L.SpatialDropout3D)
KEYED_NOISE_LAYERS = _DROPOUTS + (_L.GaussianNoise, _L.GaussianDropout, _L.AlphaDropout)

# SELU's constants, as Keras's AlphaDropout uses them.
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def is_keyed_noise(layer):
    """True for a layer of `KEYED_NOISE_LAYERS` (exactly that class: a
    subclass may draw otherwise)."""
    return type(layer) in KEYED_NOISE_LAYERS


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer: every input bit moves every output bit."""
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, np.uint32(16))) * np.uint32(0x85EBCA6B)
    h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, np.uint32(13))) * np.uint32(0xC2B2AE35)
    return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, np.uint32(16)))


def input_keys(x):
    """int64 [B]: a hash of each example's model inputs (`x`, a nest of
    dense tensors; strings hashed first), or None when a leaf is not a
    dense tensor. Each dropout keys its examples by these: they are the
    records' own values, where a layer's input may round differently by
    row (a matmul blocks rows by their position), and a hash of it would
    turn that rounding into another mask. The hash is linear in the
    entries (each times a fixed pseudo-random factor, the factors a prefix
    of one stream), so zero padding after an example's entries leaves it
    as it was, whatever length the batch is padded to.

    Example:

    >>> keys = input_keys(tf.constant([[1, 2, 0], [1, 2, 0], [2, 1, 0]]))
    >>> bool(keys[0] == keys[1]), bool(keys[0] == keys[2])
    (True, False)
    >>> bool(input_keys(tf.constant([[1, 2]]))[0] == keys[0])   # padding moves nothing
    True
    """
    leaves = tf.nest.flatten(x)
    if not leaves or not all(isinstance(leaf, tf.Tensor) for leaf in leaves):
        return None
    total = None
    for index, leaf in enumerate(leaves):
        if leaf.dtype == tf.string:
            leaf = tf.strings.to_hash_bucket_fast(leaf, 2 ** 62)
        elif leaf.dtype.is_floating:
            leaf = tf.bitcast(leaf, {2: tf.int16, 4: tf.int32, 8: tf.int64}[leaf.dtype.size])
        words = tf.reshape(tf.cast(leaf, tf.int64), [tf.shape(leaf)[0], -1])
        factors = tf.random.stateless_uniform(
            tf.shape(words)[1:], seed=tf.constant([index, 0x6B657965], tf.int64),
            minval=None, maxval=None, dtype=tf.int64)
        leaf_hash = tf.reduce_sum(words * factors[None, :], axis=1)
        total = leaf_hash if total is None else total * 1000003 + leaf_hash
    return total


def _row_seeds(layer, x, example_keys):
    """Two uint32 words per row of `x`, [rows] each: the call's key from
    the layer's seed generator, mixed with its example's key. With R = k B
    rows for B keys (TimeDistributed's [B T, ...]), row r is example r // k's,
    entry r % k of it. Rows that are not a multiple of the examples, or
    of a fixed number where the batch's differs (a [1, T, D] table of
    positions), are not examples': keyed by the call's key and their index
    alone, as Keras draws them. A tensor that is not the batch but has its
    length (or a multiple) inside a declared layer is read as the batch:
    the declaration covers it (`declare_per_example`)."""
    key = tf.cast(layer.seed_generator.next(), tf.int64)
    if example_keys is None:
        example_keys = input_keys(x)
    rows, count = tf.shape(x)[0], tf.shape(example_keys)[0]
    aligned = tf.logical_and(rows >= count, tf.equal(rows % count, 0))
    fixed, batch = x.shape[0], example_keys.shape[0]
    if fixed is not None and (batch is None or fixed < batch or fixed % batch):
        # A fixed length where the batch's is another, or not fixed: not a
        # batch (a chunk of one row would otherwise match a [1, T, D] table).
        aligned = tf.constant(False)
    per_example = tf.where(aligned, rows // count, rows)
    row = tf.range(rows)
    keys = tf.where(aligned, tf.gather(example_keys, tf.minimum(row // per_example, count - 1)),
                    tf.zeros([rows], tf.int64))
    words = tf.bitcast(tf.bitwise.bitwise_xor(keys, key[0]), tf.uint32)  # [rows, 2]
    key_words = tf.bitcast(key[1], tf.uint32)
    entry = tf.cast(row % per_example, tf.uint32) * np.uint32(0x9E3779B9)
    return (_fmix32(tf.bitwise.bitwise_xor(words[:, 0], key_words[0])),
            _fmix32(tf.bitwise.bitwise_xor(tf.bitwise.bitwise_xor(words[:, 1], key_words[1]),
                                           entry)))


def _uniforms(seeds, shape, stream=0):
    """float32 uniforms in [0, 1), 24 bits, of `shape` ([B, ...], a list of
    ints or scalar tensors): example b's from its two seed words alone and
    the entries' indices (`stream` picks another set of draws)."""
    example = shape[1:]
    count = tf.reduce_prod(tf.stack([tf.cast(d, tf.int32) for d in example])) if example else 1
    index = tf.cast(tf.reshape(tf.range(count) * 2 + stream, example), tf.uint32)[None]
    low, high = (tf.reshape(s, [-1] + [1] * len(example)) for s in seeds)
    h = _fmix32(low + index * np.uint32(0x9E3779B9))
    h = _fmix32(tf.bitwise.bitwise_xor(h, high))
    return tf.cast(tf.bitwise.right_shift(h, np.uint32(8)), tf.float32) * (2.0 ** -24)


def _normals(seeds, shape):
    """Standard normals of `shape`, by Box-Muller on two streams of uniforms."""
    radius = tf.sqrt(-2.0 * tf.math.log(1.0 - _uniforms(seeds, shape, 0)))  # 1 - u in (0, 1]
    return radius * tf.cos(2.0 * math.pi * _uniforms(seeds, shape, 1))


def _noise_shape(layer, x):
    """The shape of one draw for the batch ([B, ...]): Keras's noise shape
    with its unit axes kept and every other axis the input's."""
    dims = [x.shape[i] if x.shape[i] is not None else tf.shape(x)[i] for i in range(x.shape.rank)]
    if isinstance(layer, (_L.SpatialDropout1D, _L.SpatialDropout2D, _L.SpatialDropout3D)):
        noise = list(layer._get_noise_shape(x))
    else:
        noise = list(getattr(layer, "noise_shape", None) or [None] * len(dims))
    return [dims[0]] + [dims[i] if noise[i] is None else noise[i] for i in range(1, len(dims))]


def keyed_noise_call(layer, call, example_keys, x, *args, **kwargs):
    """`layer`'s output on the batch `x`, each example's noise keyed by its
    `example_keys` (`input_keys` of the model's inputs; None: a hash of `x`
    itself), see the module; `call` (the layer's own) when not training or
    when the layer draws nothing."""
    training = training_argument(layer, args, kwargs)
    rate = getattr(layer, "rate", getattr(layer, "stddev", 0.0))
    if not training or not rate > 0 or isinstance(x, (dict, list, tuple)):
        return call(x, *args, **kwargs)
    x = tf.convert_to_tensor(x)
    seeds = _row_seeds(layer, x, example_keys)
    if isinstance(layer, _L.GaussianNoise):
        noise = _normals(seeds, _noise_shape(layer, x)) * layer.stddev
        return x + tf.cast(noise, x.dtype)
    if isinstance(layer, _L.GaussianDropout):
        noise = 1.0 + _normals(seeds, _noise_shape(layer, x)) * math.sqrt(rate / (1.0 - rate))
        return x * tf.cast(noise, x.dtype)
    kept = tf.cast(_uniforms(seeds, _noise_shape(layer, x)) >= rate, x.dtype)
    if isinstance(layer, _L.AlphaDropout):
        alpha_p = -_SELU_ALPHA * _SELU_SCALE
        a = ((1 - rate) * (1 + rate * alpha_p ** 2)) ** -0.5
        b = -a * alpha_p * rate
        return a * (x * kept + alpha_p * (1 - kept)) + b
    return x * tf.cast(1.0 / (1.0 - rate), x.dtype) * kept


def _keyed_cell_mask(cell, example_keys, step_input, rate):
    """A recurrent cell's dropout mask (ones, kept with probability 1 -
    rate, scaled by 1 / (1 - rate), as Keras's), keyed per example; a list
    of `dropout_mask_count` of them where the cell asks for one a gate."""
    def one():
        seeds = _row_seeds(cell, step_input, example_keys)
        shape = [step_input.shape[i] if step_input.shape[i] is not None
                 else tf.shape(step_input)[i] for i in range(step_input.shape.rank)]
        kept = tf.cast(_uniforms(seeds, shape) >= rate, step_input.dtype)
        return kept * tf.cast(1.0 / (1.0 - rate), step_input.dtype)

    count = getattr(cell, "dropout_mask_count", None)
    return one() if count is None else [one() for _ in range(count)]


def _dropout_cells(model):
    from keras.src.layers.rnn.dropout_rnn_cell import DropoutRNNCell

    return [layer for layer in model._flatten_layers() if isinstance(layer, DropoutRNNCell)]


def has_cell_dropout(model):
    """True if a recurrent cell of `model` draws dropout masks."""
    return any(getattr(cell, "dropout", 0) > 0 or getattr(cell, "recurrent_dropout", 0) > 0
               for cell in _dropout_cells(model))


@contextlib.contextmanager
def keyed_cell_masks(model, example_keys):
    """Within the block, every recurrent cell of `model` (LSTM's, GRU's,
    SimpleRNN's `dropout` and `recurrent_dropout`) draws its masks keyed per
    example, as the layers above: Keras draws them by batch position too."""
    cells = _dropout_cells(model)
    for cell in cells:
        object.__setattr__(cell, "_create_dropout_mask",
                           functools.partial(_keyed_cell_mask, cell, example_keys))
    try:
        yield
    finally:
        for cell in cells:
            cell.__dict__.pop("_create_dropout_mask", None)


class KeyedNoise:
    """The batched pass's handler for a `KEYED_NOISE_LAYERS` layer
    (`tfdp.per_example.recorder`): runs `keyed_noise_call`; no weights, so
    no gradient parts."""

    def call(self, layer, recorder, call, *args, **kwargs):
        recorder.record(layer)
        return keyed_noise_call(layer, call, recorder.example_keys, *args, **kwargs)

    def parts(self, layer, records):
        return []
