"""Step samplers drawn in the TensorFlow graph: (key, step) -> the step's rows.

A step sampler maps the run's secret key and a step number to that step's
draw with stateless TensorFlow ops only. So:

- no Python runs on tf.data's threads to draw a batch (a Python generator
  there can deadlock the iterator's teardown: the thread deleting the
  iterator waits for a pipeline thread that waits for Python);
- a draw is a pure function of (key, step): every worker draws the same
  global batch whatever each one prefetches, a seeded run is reproduced
  exactly, and a later step (a second `fit`, a resumed run) never replays an
  earlier draw;
- without the key the draws are unpredictable: the key is 128 bits of OS
  entropy unless a seed is given, and it is never saved.

Units with an identity of their own (people: `tfdp.data.users`) draw from
`unit_uniforms(key, codes)`: each unit's numbers are a function of the
step's key and of the unit's own code only, never of its position among the
others, so adding or removing one unit leaves every other unit's draws bit
for bit the same under the same key.

A sampler is any object with `draw(key, step)` returning a dict of tensors
with at least "indices" (int64 [L], the rows to read, real rows first) and
"mask" (float32 [L], 1 for a real row, 0 for padding); it may add entries the
train step reads (DPIS adds each row's bound and a uniform). `draws(sampler,
key, first_step)` turns it into a `tf.data.Dataset` of draws, one per step.

Example:

>>> key = sampling_key(seed=0)
>>> indices = poisson_indices(fold_key(key, 7), num_examples=10, sampling_probability=0.5)
>>> bool(tf.reduce_all(indices[1:] > indices[:-1]))   # sorted, distinct
True
"""

import math
import os

import numpy as np
import tensorflow as tf

__all__ = ["sampling_key", "fold_key", "uniform_float64", "philox4x32", "unit_uniforms",
           "poisson_indices", "padded_draw", "draws"]

# One algorithm everywhere: the same (key, step) gives the same draw on every
# device and worker ("auto_select" may differ between devices).
ALGORITHM = "philox"


def sampling_key(seed=None):
    """The secret key of a sampling stream: two int64 words.

    Args:
        seed: None (the default: 128 bits of OS entropy, so no two runs share
            a stream), an int >= 0, or a sequence of ints (reproducible).

    Returns:
        np.ndarray of int64, shape [2].

    Example:

    >>> bool(np.array_equal(sampling_key(3), sampling_key(3)))
    True
    >>> bool(np.array_equal(sampling_key(), sampling_key()))
    False
    """
    if seed is None:
        return np.frombuffer(os.urandom(16), dtype=np.int64).copy()
    entropy = seed if isinstance(seed, (int, np.integer)) else [int(word) for word in seed]
    words = np.random.SeedSequence(entropy).generate_state(2, np.uint64)
    return words.view(np.int64).copy()


def fold_key(key, *data):
    """`key` folded with each of `data` in turn (stateless, in the graph).

    Bit for bit `tf.random.experimental.stateless_fold_in(key, value,
    alg="philox")`, as one op each (tests/data/test_sampling_ops.py). That op
    has no XLA kernel for int64: fold keys in the input pipeline or eagerly.

    Args:
        key: int64 [2] key (array or tensor).
        *data: integer scalars (Python ints or tensors).

    Returns:
        int64 tensor [2], a key as independent of `key` as a fresh one.

    Example:

    >>> fold_key(sampling_key(0), 1, 2).shape
    TensorShape([2])
    """
    key = tf.cast(key, tf.int64)
    for value in data:
        # tf.random.experimental.stateless_fold_in(key, value, alg=ALGORITHM)
        # in one op: its Python wrapper scrambles the key in about 15 ops,
        # which cost 7 ms to instantiate in every fit's input pipeline.
        word = tf.raw_ops.StatelessRandomUniformFullInt(
            shape=tf.constant([], tf.int32), seed=key, dtype=tf.int64
        )
        key = tf.stack([word, tf.cast(value, tf.int64)])
    return key


def uniform_float64(shape, key):
    """`tf.random.stateless_uniform(shape, key, tf.float64, alg="philox")` in
    one op (see `fold_key`): float64 uniforms in [0, 1).

    Args:
        shape: int32 or int64 1-D shape (a list or a tensor).
        key: int64 [2] key.

    Returns:
        float64 tensor of `shape`.

    Example:

    >>> uniform_float64([3], sampling_key(0)).shape
    TensorShape([3])
    """
    return tf.raw_ops.StatelessRandomUniform(shape=shape, seed=tf.cast(key, tf.int64),
                                             dtype=tf.float64)


# Philox-4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as
# 1, 2, 3"): the multipliers and the Weyl key increments.
_PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_PHILOX_BUMPS = (0x9E3779B9, 0xBB67AE85)
_LOW32 = 0xFFFFFFFF


def philox4x32(key_words, counters):
    """The Philox-4x32-10 block of every counter, under one key, in the graph.

    The counter-based generator TensorFlow's "philox" streams use, applied
    to a tensor of counters at once: block i is a function of `key_words`
    and `counters[..., i, :]` alone (tests/data/test_sampler_coupling.py
    checks the published test vectors). Plain uint64 ops (each 32-bit word
    held in a uint64, products exact), so it runs wherever the input
    pipeline runs.

    Args:
        key_words: [2] unsigned 32-bit key words (any integer dtype, values
            < 2^32).
        counters: [..., 4] counter words (values < 2^32).

    Returns:
        uint64 tensor [..., 4], the block's four 32-bit words.

    Example:

    >>> block = philox4x32(tf.constant([0, 0], tf.uint64), tf.zeros([1, 4], tf.uint64))
    >>> [f"{int(word):08x}" for word in block[0]]
    ['6627e8d5', 'e169c58d', 'bc57ac4c', '9b00dbd8']
    """
    low = tf.constant(_LOW32, tf.uint64)
    shift = tf.constant(32, tf.uint64)
    key_words = tf.cast(key_words, tf.uint64)
    k0, k1 = key_words[0], key_words[1]
    counters = tf.cast(counters, tf.uint64)
    c0, c1, c2, c3 = (counters[..., i] for i in range(4))
    m0, m1 = (tf.constant(m, tf.uint64) for m in _PHILOX_MULTIPLIERS)
    w0, w1 = (tf.constant(w, tf.uint64) for w in _PHILOX_BUMPS)
    for _ in range(10):
        product0, product1 = m0 * c0, m1 * c2  # < 2^64: exact
        hi0, lo0 = tf.bitwise.right_shift(product0, shift), tf.bitwise.bitwise_and(product0, low)
        hi1, lo1 = tf.bitwise.right_shift(product1, shift), tf.bitwise.bitwise_and(product1, low)
        c0 = tf.bitwise.bitwise_xor(tf.bitwise.bitwise_xor(hi1, c1), k0)
        c1 = lo1
        c2 = tf.bitwise.bitwise_xor(tf.bitwise.bitwise_xor(hi0, c3), k1)
        c3 = lo0
        k0 = tf.bitwise.bitwise_and(k0 + w0, low)
        k1 = tf.bitwise.bitwise_and(k1 + w1, low)
    return tf.stack([c0, c1, c2, c3], axis=-1)


def unit_uniforms(key, codes):
    """Two float64 uniforms in [0, 1) per unit, from the unit's own code.

    Unit i's pair is the Philox block of counter `codes[i]` under the key
    (the first key word is Philox's key, the second is XORed into the
    counter, a bijection of counters): a function of (`key`, `codes[i]`)
    only. Distinct codes give independent pairs (as independent as
    Philox's blocks), and no unit's numbers depend on how many other units
    there are or where they sit.

    Args:
        key: int64 [2], e.g. `fold_key(run key, step, tag)`.
        codes: [..., 4] unsigned 32-bit words (uint32 or uint64), one
            distinct code per unit (`tfdp.data.users.UserRecords.codes`).

    Returns:
        float64 tensor [..., 2]: 53-bit uniforms (multiples of 2^-53).

    Example:

    >>> codes = tf.constant([[0, 0, 0, 1], [0, 0, 0, 2]], tf.uint32)
    >>> pairs = unit_uniforms(sampling_key(0), codes)
    >>> bool(np.array_equal(pairs[1], unit_uniforms(sampling_key(0), codes[1:])[0]))
    True
    """
    words = tf.bitcast(tf.cast(key, tf.int64), tf.uint64)
    low = tf.constant(_LOW32, tf.uint64)
    shift = tf.constant(32, tf.uint64)

    def split(word):
        return tf.bitwise.bitwise_and(word, low), tf.bitwise.right_shift(word, shift)

    key_words = tf.stack(split(words[0]))
    mask = tf.stack([*split(words[1]), tf.constant(0, tf.uint64), tf.constant(0, tf.uint64)])
    block = philox4x32(key_words, tf.bitwise.bitwise_xor(tf.cast(codes, tf.uint64), mask))
    top = tf.constant(21, tf.uint64)
    drop = tf.constant(11, tf.uint64)
    mantissas = tf.bitwise.left_shift(block[..., 0::2], top) + tf.bitwise.right_shift(
        block[..., 1::2], drop)  # 32 + 21 = 53 bits
    return tf.cast(mantissas, tf.float64) * 2.0**-53


def chunk_size(expected):
    """Gaps drawn at once for a draw of `expected` records: 6 standard
    deviations (and 16) above the mean, so the walk ends short of N about
    once in 10^9 draws (the rest is drawn then: the walk is never cut)."""
    return int(expected + 6.0 * math.sqrt(expected) + 16)


def poisson_indices(key, num_examples, sampling_probability):
    """One Poisson draw: each of N records independently with probability q.

    The draw walks the records with i.i.d. Geometric(q) gaps between
    successive included records (the same distribution as N independent
    Bernoulli(q) coins, at O(q N) instead of O(N) work). A gap is
    floor(log(1 - u) / log(1 - q)) + 1 for a float64 uniform u, so its
    distribution is exact up to float64 rounding (each probability within
    about 2^-52). The gaps are drawn in one chunk sized to cover N with
    overwhelming probability; if the walk still ends short of N, every record
    after its last one joins independently with probability q (a float64
    uniform below q, from the next key): by the gaps' memorylessness the
    same distribution, so the draw is never cut.

    Args:
        key: int64 [2], the step's key (`fold_key(run key, step)`).
        num_examples: int N >= 1 (a Python int: it sizes the chunks).
        sampling_probability: float q in (0, 1].

    Returns:
        int64 tensor [count]: the sorted indices of the included records.

    Example:

    >>> poisson_indices(sampling_key(0), 5, 1.0).numpy()
    array([0, 1, 2, 3, 4])
    """
    n, q = int(num_examples), float(sampling_probability)
    if q >= 1.0:
        return tf.range(n, dtype=tf.int64)
    uniform = uniform_float64([chunk_size(q * n)], fold_key(key, 0))
    gaps = tf.floor(tf.math.log1p(-uniform) / math.log1p(-q)) + 1.0
    # A gap past N ends the walk: cap it so the int64 sum cannot overflow.
    walked = tf.cumsum(tf.cast(tf.minimum(gaps, float(n + 1)), tf.int64)) - 1
    last = walked[-1]
    # Rarely the walk ends short of N: then each record after its last joins
    # independently (a tail of max(0, N - 1 - last) uniforms, empty when the
    # walk passed N). No control flow: with a cond here instead, the draw took
    # 0.063 s to instantiate at a fit's first step, 0.049 s without.
    tail = uniform_float64(tf.reshape(tf.maximum(n - 1 - last, 0), [1]), fold_key(key, 1))
    rest = last + 1 + tf.where(tail < q)[:, 0]
    return tf.concat([tf.boolean_mask(walked, walked < n), rest], axis=0)


def padded_draw(indices, length):
    """`indices` padded to `length` rows with index 0, and their mask.

    Args:
        indices: int64 [count], real rows (count <= length).
        length: int32 or int64 scalar, the padded length.

    Returns:
        dict with "indices" (int64 [length]) and "mask" (float32 [length],
        1 on the first `count` rows).

    Example:

    >>> draw = padded_draw(tf.constant([4, 2], tf.int64), 4)
    >>> draw["indices"].numpy(), draw["mask"].numpy()
    (array([4, 2, 0, 0]), array([1., 1., 0., 0.], dtype=float32))
    """
    count = tf.shape(indices, out_type=tf.int64)[0]
    length = tf.cast(length, tf.int64)
    return {
        "indices": tf.pad(tf.cast(indices, tf.int64), [[0, length - count]]),
        "mask": tf.cast(tf.range(length) < count, tf.float32),
    }


def draws(sampler, key, first_step=0, steps=None):
    """A `tf.data.Dataset` of the sampler's draws, one per step.

    Steps run from `first_step`: `steps` of them, or endlessly when `steps`
    is None (`fit` passes Keras `steps_per_epoch` and keeps one iterator for
    the whole run, so no iterator is torn down at an epoch end). Step t's
    draw in the n-th iteration over the dataset is
    `sampler.draw(fold_key(key, s, n), t)`, s a number derived from `key`:
    every iteration draws fresh batches, and the n-th iteration is the same
    on every worker and in every rerun of a seeded run, whatever ran before
    in the process. (The dataset counts its iterations in a variable, when
    an iteration draws its first step.)

    Args:
        sampler: an object with `draw(key, step)` (see the module doc).
        key: int64 [2], the run's secret key (`sampling_key`).
        first_step: int >= 0, the first step's number.
        steps: None (endless) or an int >= 1.

    Returns:
        A `tf.data.Dataset` of the sampler's draw dicts.

    Example:

    >>> class Single:
    ...     def draw(self, key, step):
    ...         return padded_draw(tf.reshape(step, [1]), 2)
    >>> [d["indices"].numpy().tolist() for d in draws(Single(), sampling_key(0), 5, steps=2)]
    [[5, 0], [6, 0]]
    """
    key = np.asarray(key, np.int64)
    nonce_seed = int(np.random.SeedSequence(key.view(np.uint64).tolist()).generate_state(1)[0])
    first_step = int(first_step)
    if steps is None:
        # Endless in practice; unlike Dataset.counter (a scan), no function
        # to trace and instantiate.
        numbers = tf.data.Dataset.range(first_step, np.iinfo(np.int64).max)
    else:
        numbers = tf.data.Dataset.range(first_step, first_step + int(steps))
    # The iteration's number, counted when its first step is drawn (the map
    # runs in order). Dataset.random(rerandomize_each_iteration=True), used
    # before, gave Keras epochs the same numbers again after an earlier fit
    # in the same process (two epochs trained on the same batches).
    iterations = tf.Variable(tf.constant(0, tf.int64), trainable=False)

    stream = fold_key(key, nonce_seed)  # folded once, eagerly, not in every trace

    @tf.autograph.experimental.do_not_convert
    def draw(step):  # plain ops, no control flow: cheap to trace and instantiate
        iteration = iterations.assign_add(tf.cast(tf.equal(step, first_step), tf.int64))
        return sampler.draw(fold_key(stream, iteration), step)

    return numbers.map(draw)
