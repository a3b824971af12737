"""Gaussian noise with its whole tail, by a vectorised Box-Muller transform.

Every Gaussian draw that protects privacy in tfdp comes from this module:
each training step's noise (`dpsgd.gaussian_noise_like`: DP-SGD, SA-DPSGD,
DPIS, AdaDP's per-coordinate noise, each replica's share under
tf.distribute) through `normals`, and the host-side releases (DPIS's N~ and
K~, private normalization's statistics) through `numpy_normal`.

Box-Muller: an angle theta uniform in [0, 2 pi) and E ~ Exp(1) give two
independent N(0, 1) draws sqrt(2E) cos(theta) and sqrt(2E) sin(theta). Each
pair takes two 32-bit random words w0, w1 (stateless Philox, as many random
bits as two float32 uniforms): theta = 2 pi (w1 + 1/2) / 2^32, the middle
of w1's cell, and E = -ln V for V = (w0 + J) 2^-32 uniform on [0, 1), J the
part of V finer than a word. For w0 >= 1 the draw takes E = 32 ln 2 - ln w0,
the top of E's cell (a rounding of E by at most 1 / w0, as any float draw
rounds).

No atom anywhere, at 0 included: E is computed in float64, where w0 is
exact, so E >= -ln(1 - 2^-32) > 2^-32 and the radius is never 0 (a float32
V = w0 2^-32 would round each w0 >= 2^32 - 128 to 1.0: radius 0, both
draws exactly 0.0, probability 2^-25 a pair). The angle is never 0, and a
float angle is never a nonzero multiple of pi / 2, so no draw is exactly
0.0 (float32 and bfloat16 included: the smallest |draw| is about 1e-14 at
stddev 1). Near 0 the radius keeps the law P(R <= r) = 1 - exp(-r^2 / 2)
at every word (E has the resolution of its own cell, 2^-32 near 0).

The tail is never cut. A float uniform cuts it: 1 - U >= 2^-23 for a float32
uniform caps the radius at sqrt(46 ln 2) = 5.65 (TensorFlow's own normal
clamps at 5.68, a float64 uniform at 8.5, NumPy's ziggurat at 13.7). A cut
moves the mass the Gaussian puts beyond it, and that costs delta: up to
exp(T q (d/2) e^(-R^2/2) / (1 - q)) - 1 plus a smaller edge term, for T steps
at sampling rate q on d coordinates cut at radius R (derivation: the
mechanisms page of the documentation). At R = 5.65 that was 0.06 for the
Fashion-MNIST tanh CNN (26,010 parameters, 40 epochs) and 4.3e-3 for the
digits MLP (2,410 parameters, 30 epochs), against their delta 1e-5. Here,
w0 = 0 (probability 2^-32) is the event V < 2^-32, and given it 2^32 V is
again uniform on [0, 1), so E = 32 ln 2 + a fresh Exp(1) draw (the
exponential law is memoryless). Those draws take fresh words, as many rounds
as needed (`tf.while_loop`): every radius has the Gaussian's probability at
every depth, and the tail adds nothing to delta. The check costs one
reduction a call; the rounds run on a call with probability (number of
pairs) * 2^-32 (3e-4 for 2.56M draws).

Two paths draw the same values, bit for bit: this module's TensorFlow graph
(the reference, `_Draw`) and a compiled TensorFlow op that does the whole
transform in one vectorized pass (`tfdp.mechanisms.native_noise`: built on
first use with the system C++ compiler, checked against the graph when it
loads; the graph runs where it cannot, and `TFDP_NOISE_KERNEL=graph` forces
it). `add_normals` adds the noise to a tensor in the same pass.

Cost of the graph: two random words a pair, as before with two float32 uniforms, and
one check and one `tf.cond` a call; small tensors share one draw (fewer ops
a call). On the 2-core AVX-512 Xeon, best of three sessions, within 5% of the
float32-uniform version on the MLP, text_pooling and tanh CNN shapes
(`benchmarks/noise_generation.py` times both). The float64 logarithm of the
radius (issue 43) costs about 12-15% more process CPU time on the MLP and
text_pooling draws than the float32 one it replaced, and about 1% under XLA.

Example:

>>> import tensorflow as tf
>>> z = standard_normal([3, 2], tf.constant([1, 2], tf.int64))
>>> z.shape, z.dtype
(TensorShape([3, 2]), tf.float32)
"""

import math

import numpy as np
import tensorflow as tf

from tfdp.mechanisms import native_noise

_WORD = 2.0**-32  # a word's cell: V = w0 2^-32 is the bottom of V's cell
_LN_CELLS = 32.0 * math.log(2.0)  # -ln 2^-32: E = -ln(w0 2^-32) = _LN_CELLS - ln w0
_ANGLE_PER_WORD = 2.0 * math.pi * _WORD


def fold_seed(seed, data):
    """`seed` folded with `data`: a new int64 seed [2] whose first word is a
    64-bit Philox draw keyed by `seed`, and whose second is `data`.

    `tf.random.experimental.stateless_fold_in(seed, data)` draws its first
    word in `data`'s dtype: a Python int makes it int32, a seed with only 32
    secret bits (2^32 candidates can be searched). Every fold of a secret
    seed in tfdp goes through here, in int64.

    Args:
        seed: integer tensor [2] (cast to int64).
        data: integer scalar (a Python int or a tensor), usually public: a
            stream's index, a step count, a domain constant.

    Returns:
        int64 tensor [2].

    Example:

    >>> s = fold_seed(tf.constant([1, 2], tf.int64), 3)
    >>> s.dtype, int(s[1])
    (tf.int64, 3)
    """
    return tf.random.experimental.stateless_fold_in(
        tf.cast(seed, tf.int64), tf.cast(data, tf.int64))


def _words(shape, seed):
    """Uniform 32-bit random words of `shape` (stateless Philox)."""
    return tf.random.stateless_uniform(shape, seed=seed, minval=None, maxval=None, dtype=tf.uint32)


def _work_dtype(dtype):
    """The precision a draw is computed in: float64 for float64, else float32."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


class _Draw:
    """One tensor's pairs of words, before the radius is finished.

    The radius is built in float64 whatever the dtype: w0 is exact there, so
    for w0 >= 1, E = 32 ln 2 - ln w0 >= -ln(1 - 2^-32) > 2^-32 and no radius
    is 0 (a float32 V = w0 2^-32 rounds every w0 >= 2^32 - 128 to 1.0, an
    atom at 0 of 2^-25 a pair). The angle takes its cell's midpoint
    2 pi (w1 + 1/2) 2^-32, never 0, and a float angle is never a nonzero
    multiple of pi / 2: no draw is exactly 0.
    """

    def __init__(self, shape, seed, dtype):
        self.dtype = tf.as_dtype(dtype)
        self.work = _work_dtype(self.dtype)
        self.shape = tf.convert_to_tensor(shape, tf.int32)
        self.count = tf.reduce_prod(self.shape)
        self.seed = seed
        first, second = tf.unstack(_words(tf.stack([2, (self.count + 1) // 2]), seed))
        self.word = tf.cast(first, tf.float64)  # w0, exact; 0 only in the deepest cell
        self.angle = (tf.cast(second, self.work) + 0.5) * tf.constant(_ANGLE_PER_WORD, self.work)

    def smallest_word(self):
        return tf.reduce_min(self.word)

    def exponential(self):
        """E = 32 ln 2 - ln w0 (float64): valid when no word is 0."""
        return _LN_CELLS - tf.math.log(self.word)

    def exponential_with_deep_tail(self):
        """E with every w0 = 0 replaced by 32 ln 2 + a fresh Exp(1) draw."""

        def part(word):  # 32 ln 2 - ln w, and 32 ln 2 for the deepest cell
            return _LN_CELLS - tf.math.log(tf.maximum(word, 1.0))

        def more(level, e, pending):
            del level, e
            return tf.reduce_any(pending)

        def deeper(level, e, pending):
            seed = fold_seed(self.seed, level)
            word = tf.cast(_words(tf.shape(self.word), seed), tf.float64)
            e = tf.where(pending, e + part(word), e)
            return level + 1, e, pending & (word == 0.0)

        start = (tf.constant(1, tf.int64), part(self.word), self.word == 0.0)
        _, e, _ = tf.while_loop(more, deeper, start)
        return e

    def finish(self, e, stddev):
        # E > 2^-32 is a normal float32: the cast rounds it, never to 0.
        radius = tf.sqrt(tf.cast(e, self.work)) * _radius_factor(stddev, self.work)
        pairs = tf.concat([radius * tf.cos(self.angle), radius * tf.sin(self.angle)], 0)
        return tf.cast(tf.reshape(pairs[: self.count], self.shape), self.dtype)


# Tensors of at most this many entries share one draw (one random-bit call,
# one check), split afterwards: a small tensor costs its ops' overhead more
# than its entries.
_SMALL = 2**16


def _static_size(shape):
    """The number of entries of a shape known before running, else None."""
    if isinstance(shape, tf.Tensor):
        return None
    return tf.TensorShape(shape).num_elements()


def _plan(shapes, dtypes):
    """The draws of one call: [(shape of the draw, index of its seed, dtype,
    indices of the tensors it is for)]. Tensors of at most 65,536 entries
    (static shapes) and one dtype share one draw, keyed by the first one's
    seed."""
    groups = {}  # (dtype) -> indices of the small tensors
    for index, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        size = _static_size(shape)
        if size is not None and size <= _SMALL:
            groups.setdefault(tf.as_dtype(dtype), []).append(index)
    shared = [members for members in groups.values() if len(members) > 1]
    grouped = {index for members in shared for index in members}
    plan = []
    for members in shared:
        total = sum(_static_size(shapes[i]) for i in members)
        plan.append(([total], members[0], tf.as_dtype(dtypes[members[0]]), members))
    for index, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        if index not in grouped:
            plan.append((shape, index, tf.as_dtype(dtype), [index]))
    return plan


def _radius_factor(stddev, work):
    """sqrt(2) stddev in the draw's working precision (radius = sqrt(E) * this).

    One MulNoNan op, the plain product here (its second operand, sqrt(2), is
    never 0): Grappler reassociates chains of Mul ops, never a MulNoNan. A
    Mul would join the caller's product: adaptive clipping's stddev
    sigma * C_t became sqrt(2) * (sigma * C_t), which Grappler's constant
    push-down rewrote to C_t * (sqrt(2) * sigma) on the graph generator's
    path only (there sigma * C_t has one consumer; the kernel's path also
    hands it to the deep-tail fallback), an ulp apart for some C_t.
    """
    return tf.math.multiply_no_nan(tf.cast(stddev, work), tf.constant(math.sqrt(2.0), work))


def _graph_draws(plan, seeds, stddev):
    """Each planned draw's noise by the graph generator (the reference)."""
    draws = [_Draw(shape, seeds[seed_index], dtype) for shape, seed_index, dtype, _ in plan]
    deep = tf.reduce_min(tf.stack([draw.smallest_word() for draw in draws])) == 0.0
    exponentials = tf.cond(
        deep,
        lambda: [draw.exponential_with_deep_tail() for draw in draws],
        lambda: [draw.exponential() for draw in draws],
    )
    return [draw.finish(e, stddev) for draw, e in zip(draws, exponentials)]


def _split(plan, shapes, noises):
    """The tensors of `shapes` cut from the planned draws' noise."""
    out = [None] * len(shapes)
    for (_, _, _, members), noise in zip(plan, noises):
        if len(members) == 1:
            out[members[0]] = noise
            continue
        parts = tf.split(noise, [_static_size(shapes[i]) for i in members])
        for index, part in zip(members, parts):
            out[index] = tf.reshape(part, shapes[index])
    return out


def normals(shapes, seeds, dtypes, stddev=1.0):
    """Independent N(0, stddev^2) tensors, one per shape, stateless.

    One check for the whole list decides whether any draw reaches the deep
    tail (then every draw's radius takes its refinement rounds). Tensors of
    at most 65,536 entries (static shapes) and one dtype share one draw,
    keyed by the first one's seed and split: independent all the same.
    The compiled kernel draws the same values where it runs (`noise_path`).

    Args:
        shapes: list of shapes (lists, TensorShapes or 1-D int tensors).
        seeds: list of int64 tensors [2], one per shape (distinct streams).
        dtypes: list of float dtypes; the draw is in float32 (float64 for
            float64) and cast.
        stddev: scalar standard deviation (a float or a scalar tensor).

    Returns:
        List of tensors of `shapes` and `dtypes`, a pure function of the
        seeds and shapes.

    Example:

    >>> a, b = normals([[2], [3]], [tf.constant([0, 1], tf.int64),
    ...                 tf.constant([0, 2], tf.int64)], [tf.float32] * 2, stddev=2.0)
    >>> a.shape, b.shape
    (TensorShape([2]), TensorShape([3]))
    """
    plan = _plan(shapes, dtypes)
    if not plan:
        return []
    library = native_noise.library_here([dtype for _, _, dtype, _ in plan])
    if library is None:
        return _split(plan, shapes, _graph_draws(plan, seeds, stddev))
    drawn = [native_noise.draw(library, shape, seeds[seed_index], dtype,
                               _radius_factor(stddev, _work_dtype(dtype)))
             for shape, seed_index, dtype, _ in plan]
    noises = native_noise.unless_deep([value for value, _ in drawn], [deep for _, deep in drawn],
                                      lambda: _graph_draws(plan, seeds, stddev))
    return _split(plan, shapes, noises)


def add_normals(tensors, seeds, stddev, divisor=None):
    """Each tensor plus N(0, stddev^2) noise, divided by `divisor` if given:
    `(t + normals(...)) / divisor` bit for bit.

    The compiled kernel adds a tensor's own draw in the same pass (one read
    and one write of the tensor); small tensors sharing a draw take their
    pieces in one op. The division is a TensorFlow op on both paths.

    Args:
        tensors: list of float tensors (e.g. the clipped sums of a step).
        seeds: list of int64 tensors [2], one per tensor.
        stddev: scalar standard deviation (a float or a scalar tensor).
        divisor: None, or a scalar (cast to each tensor's dtype) dividing
            each noisy tensor.

    Returns:
        List of tensors like `tensors`.

    Example:

    >>> t = add_normals([tf.ones([3])], [tf.constant([0, 1], tf.int64)], 0.0, divisor=4.0)
    >>> t[0].numpy()
    array([0.25, 0.25, 0.25], dtype=float32)
    """
    shapes = [t.shape if t.shape.is_fully_defined() else tf.shape(t) for t in tensors]
    dtypes = [t.dtype for t in tensors]
    noised = _add_normals(tensors, shapes, dtypes, seeds, stddev)
    if divisor is None:
        return noised
    # The same TensorFlow op on both paths, so Grappler rewrites both alike
    # (a constant divisor becomes a multiply by its reciprocal in tf.function).
    return [total / tf.cast(divisor, total.dtype) for total in noised]


def _add_normals(tensors, shapes, dtypes, seeds, stddev):
    """Each tensor plus its noise, by the fused op where it runs."""

    def graph():
        return [t + n for t, n in zip(tensors, normals(shapes, seeds, dtypes, stddev))]

    plan = _plan(shapes, dtypes)
    library = native_noise.library_here([dtype for _, _, dtype, _ in plan]) if plan else None
    if library is None:
        return graph()
    out, deeps = [None] * len(tensors), []
    for _, seed_index, dtype, members in plan:
        factor = _radius_factor(stddev, _work_dtype(dtype))
        if len(members) == 1:
            value, deep = native_noise.add(library, tensors[members[0]], seeds[seed_index], factor)
            out[members[0]] = value
        else:  # small tensors sharing one draw, cut in order
            values, deep = native_noise.add_group(library, [tensors[i] for i in members],
                                                  seeds[seed_index], factor)
            for index, value in zip(members, values):
                out[index] = value
        deeps.append(deep)
    return native_noise.unless_deep(out, deeps, graph)


def standard_normal(shape, seed, dtype=tf.float32):
    """N(0, 1) draws of `shape`, a pure function of `seed` (stateless).

    Args:
        shape: the output shape (a list or a 1-D int tensor).
        seed: int64 tensor [2].
        dtype: float dtype of the result; the draw is in float32 (or
            float64 for float64) and cast.

    Returns:
        A tensor of `shape` and `dtype`.

    Example:

    >>> a = standard_normal([4], tf.constant([0, 1], tf.int64))
    >>> b = standard_normal([4], tf.constant([0, 1], tf.int64))
    >>> bool(tf.reduce_all(a == b))
    True
    """
    return normals([shape], [seed], [dtype])[0]


def numpy_normal(rng, stddev=1.0, size=None):
    """N(0, stddev^2) draws from a NumPy Generator, by the same transform.

    NumPy's own normal (a ziggurat) caps |z| at 13.7 (its tail uses a 53-bit
    uniform), which costs delta at small noise multipliers; this one has the
    whole tail, as `normals`.

    Args:
        rng: a `numpy.random.Generator`.
        stddev: the standard deviation, a number >= 0.
        size: None for one float, or an int or shape for an array.

    Returns:
        A float (size None) or a float64 array of `size`.

    Example:

    >>> z = numpy_normal(np.random.default_rng(0), 2.0, size=3)
    >>> z.shape, z.dtype
    ((3,), dtype('float64'))
    """
    shape = () if size is None else tuple(np.atleast_1d(size))
    count = int(np.prod(shape, dtype=np.int64))
    half = (count + 1) // 2
    words = rng.integers(0, 2**32, size=(2, half), dtype=np.uint64).astype(np.float64)
    uniform, angle = words[0] * _WORD, (words[1] + 0.5) * _ANGLE_PER_WORD
    e = -np.log(np.maximum(uniform, _WORD))
    pending = uniform == 0.0
    while pending.any():  # w0 = 0: 32 ln 2 + a fresh Exp(1), as in `normals`
        deeper = rng.integers(0, 2**32, size=int(pending.sum()), dtype=np.uint64) * _WORD
        e[pending] += -np.log(np.maximum(deeper, _WORD))
        pending[pending] = deeper == 0.0
    radius = np.sqrt(2.0 * e) * float(stddev)
    z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]
    return float(z[0]) if size is None else z.reshape(shape)
