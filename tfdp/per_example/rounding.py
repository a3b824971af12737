"""Rounding-error bounds that make every clipping norm an upper bound.

Clipping must hold for ANY record, in the arithmetic the step really runs. A
per-example norm computed in floating point can come out below the true norm
of what is summed: a factored ("ghost") norm sum_{s,t} (x_s . x_t)(g_s . g_t)
whose terms cancel is rounding noise (often negative, clamped to 0), so a
crafted record escapes clipping by orders of magnitude. Every norm tfdp clips
with is therefore an upper bound, built from the classical bound on a sum of
n terms computed in floating point in ANY order, with or without fused
multiply-adds (Higham, "Accuracy and Stability of Numerical Algorithms",
2nd ed., section 3.1):

    |fl(sum_i a_i) - sum_i a_i| <= gamma(n) * sum_i |a_i|,
    gamma(n) = n u / (1 - n u),

u the unit roundoff (2^-24 in float32, 2^-53 in float64), and for a dot
product |fl(a . b) - a . b| <= gamma(n) |a| . |b|, plus, in float32, one
smallest normal number per operation for results TensorFlow flushes to zero.
Sums of squares have no cancellation (their error is relative; they are
summed in float64, where squares of float32 values neither overflow nor
underflow); factored norms are computed from float32 Gram matrices (by
chunks of 256 columns added in float64; float64 Gram matrices where a
float32 one overflows or float32 matmuls may round to fewer bits:
`tfdp.per_example.gram_precision`), whose
bound leaves a slack of about 1e-5 relative on ordinary data; each bound is
added, so the result is >= the true value whatever the record.

Flush-to-zero. On the CPU (inside `tf.function`, under XLA) float32 results
below 2^-126 (`FLOAT32_TINY`) are flushed to zero, and subnormal inputs may
be read as zero by one operation (a cast to float64 under denormals-are-zero)
and as their value by another. Two consequences are bounded here, with the
operands as the sum uses them:

* a value flushed BEFORE it is multiplied by a large factor loses up to
  FLOAT32_TINY times that factor (the weighted sum's w * g_s is flushed and
  then multiplied by |x_s|, up to 3e38): this error does not shrink with the
  weight w, so it is an ABSOLUTE error of the example's contribution
  (`flushed_products`), which `PerExampleGradients.weighted_sum` takes from
  the weight it is given (a record it cannot absorb gets weight 0);
* an operand entry read as 0 in the norm but used in the sum (or the
  reverse) differs by less than FLOAT32_TINY: per unit weight, at most
  FLOAT32_TINY times the norm of what it multiplies (`subnormal_reading`).

Products of two float32 numbers computed in float64 never underflow (they
are multiples of 2^-298), so dot products taken in float64 lose nothing to
flushing; only the subnormal readings of their float32 operands remain.

Each bound below is stated for the exact real-arithmetic value of what the
per-example part represents (its float32 factors X_i, G_i, or a tensor it
materialized and sums as is). What the weighted sum adds when it computes an
example's contribution from factors (one matmul over the rows of every
example) is bounded separately by `summation_rounding`: the rounding of the
example's own rows. The rounding of adding different examples' clipped
contributions to each other (about B u of the sum, B the batch) is the float32
summation error every DP-SGD implementation has and is not covered here.

Example:

>>> import tensorflow as tf
>>> x = tf.constant([[[1.0, 0.0], [1.0, 0.0]]])      # two equal positions
>>> g = tf.constant([[[1e8, 0.0], [-1e8, 1.0]]])     # cancelling gradients
>>> sq, rows_x, rows_g = factored_norm_bounds(x, g)   # true squared norm: 1
>>> bool(sq.numpy()[0] >= 1.0), round(float(mass_of(rows_x, rows_g).numpy()[0]) / 1e8, 6)
(True, 2.0)
"""

import math

import tensorflow as tf

UNIT_ROUNDOFF = {tf.float32: 2.0**-24, tf.float64: 2.0**-53}

# float32's smallest normal number: TensorFlow flushes smaller results to
# zero, an absolute error of at most this much per operation.
FLOAT32_TINY = 2.0**-126

# Feature columns cast to float64 at a time by `factored_norm_bounds`: a
# language model's [B, S, vocabulary] output gradient is never copied whole.
GRAM_CHUNK = 4096


def gamma(n, dtype=tf.float32):
    """gamma(n) = n u / (1 - n u) for `dtype`'s unit roundoff u.

    `n` is a Python number (the result is a Python float) or, for lengths
    known only at run time, a tensor (the result is a float64 tensor, inf
    where n u >= 1/2: a bound that loose clips the example to nothing).

    Example:

    >>> gamma(1) == 2.0**-24 / (1 - 2.0**-24)
    True
    """
    unit = UNIT_ROUNDOFF[tf.as_dtype(dtype)]
    if isinstance(n, (int, float)):
        if n * unit >= 0.5:
            raise ValueError(
                f"A rounding bound over {n} terms in {tf.as_dtype(dtype).name} is too "
                f"loose to be useful. Received: n={n}"
            )
        return n * unit / (1.0 - n * unit)
    product = tf.cast(n, tf.float64) * unit
    return tf.where(product < 0.5, product / (1.0 - product), float("inf"))


def reduce_per_example(tensor):
    """Sum of each example's entries [B], one axis at a time (last first),
    so that a rounding bound counts the axes' lengths added, not their
    product (see `terms_per_example`)."""
    for axis in reversed(range(1, tensor.shape.rank)):
        tensor = tf.reduce_sum(tensor, axis)
    return tensor


def terms_per_example(tensor):
    """The n of the rounding bound of `reduce_per_example(tensor)`: the sum
    of the non-batch axes' lengths plus one (each reduction is within
    gamma(length), and their errors add). A Python int, or an int tensor when
    a length is known only at run time."""
    static = [n for n in tensor.shape[1:] if n is not None]
    dynamic = [tf.shape(tensor)[axis] for axis, n in enumerate(tensor.shape) if axis and n is None]
    return sum(static) + 1 + (tf.add_n(dynamic) if dynamic else 0)


def entries_per_example(tensor):
    """How many entries each example has in `tensor` [B, ...]: a Python int,
    or an int tensor when a length is known only at run time (each may be
    subnormal, or flushed in w * g: `subnormal_reading`, `flushed_products`).

    Example:

    >>> entries_per_example(tf.zeros([2, 3, 4]))
    12
    """
    inner = tf.TensorShape(tensor.shape[1:])  # a NumPy array's shape too
    if inner.is_fully_defined():
        return inner.num_elements()
    return tf.reduce_prod(tf.shape(tensor)[1:])


def sum_of_squares(tensor):
    """Upper bound, float64 [B], of each example's sum of squared entries.

    The squares are taken in float64: the square of a float32 value neither
    overflows nor underflows there (TensorFlow flushes float32 results below
    1.2e-38 to zero, which would make a float32 sum of tiny squares come out
    below the truth), and the sum's rounding is within gamma(n) in float64.

    Args:
        tensor: [B, ...] float tensor (float32 or narrower).

    Example:

    >>> float(sum_of_squares(tf.constant([[3.0, 4.0]]))[0])
    25.00000000000001
    """
    sums = reduce_per_example(tf.square(tf.cast(tensor, tf.float64)))
    return sums * (1.0 + gamma(terms_per_example(tensor) + 1, tf.float64))


def dot_rounding(terms, *norms):
    """Bound, float64 [B], on the rounding of a dot product of `terms` terms
    computed in FLOAT64 from float32 operands whose absolute values have
    norms `norms` (each a [B] tensor or a Python float; their product bounds
    sum |a_i b_i|). Nothing underflows in float64 (see the module
    docstring); subnormal readings of the operands are the caller's
    (`subnormal_reading`).

    Example:

    >>> float(dot_rounding(2, tf.constant([1.0], tf.float64), 1.0)[0]) > 0
    True
    """
    bound = tf.cast(gamma(terms + 2, tf.float64), tf.float64)
    for norm in norms:
        bound = bound * tf.cast(norm, tf.float64)
    return bound


def summation_rounding(positions, mass):
    """Bound, float64 [B], on the rounding a float32 matmul over an example's
    `positions` rows adds to its contribution sum_s x_s (w g_s)^T per unit
    weight w: gamma(positions + 2) * sum_s |x_s| |g_s| (`mass`), the +2 for
    the product w g and the sum's last addition. Flushed results are
    `flushed_products`' (absolute, not per unit weight)."""
    return gamma(positions + 2) * tf.cast(mass, tf.float64)


def subnormal_reading(width, magnitude):
    """Bound, float64, on how far a product of an operand of `width` float32
    entries and a factor of norm `magnitude` moves when the operand's
    subnormal entries (each below FLOAT32_TINY) are read as 0 by one
    operation and as their value by another: FLOAT32_TINY * sqrt(width) *
    magnitude.

    Example:

    >>> subnormal_reading(4, 1.0) == 2.0 * FLOAT32_TINY
    True
    """
    return FLOAT32_TINY * _sqrt(width) * magnitude


def flushed_products(width, magnitude, entries, positions):
    """ABSOLUTE bound, float64, on what flushing adds to one example's
    contribution sum_s x_s (w g_s)^T when w g is formed first: each entry of
    w g_s below FLOAT32_TINY may be flushed (an error below FLOAT32_TINY
    whatever w), then multiplied by |x_s| (`magnitude` bounds
    sum_s |x_s|, `width` is g's width); and each of the `entries` entries
    of the result loses at most FLOAT32_TINY per product and per partial
    sum over the example's `positions` rows.

    Example:

    >>> round(float(flushed_products(1, 3e38, 1, 1)), 2)    # 3e38 * 2^-126
    3.53
    """
    return FLOAT32_TINY * (_sqrt(width) * magnitude + 2.0 * positions * _sqrt(entries))


def _sqrt(count):
    """sqrt of a Python number or an int tensor (float64)."""
    if isinstance(count, (int, float)):
        return math.sqrt(count)
    return tf.sqrt(tf.cast(count, tf.float64))


def _row_squares64(rows):
    """[B, S] float64 squared norms of float32 rows [B, S, C], by column
    chunks of `GRAM_CHUNK`."""
    total = None
    for start in range(0, rows.shape[-1], GRAM_CHUNK):
        chunk = tf.cast(rows[..., start:start + GRAM_CHUNK], tf.float64)
        part = tf.reduce_sum(tf.square(chunk), -1)
        total = part if total is None else total + part
    return total


def row_norm_bounds(squares, width):
    """[B, S] float64 upper bounds of the true norms of float32 rows of
    `width` entries from their float64 sums of squares `squares` [B, S]:
    rounding (relative) and subnormal entries read as 0 by the cast
    (FLOAT32_TINY each) included.

    Example:

    >>> float(row_norm_bounds(tf.constant([[25.0]], tf.float64), 2)[0, 0])
    5.0...
    """
    return tf.sqrt(squares) * (1.0 + gamma(width + 2, tf.float64)) + FLOAT32_TINY * math.sqrt(width)


# Rows of at most this many entries are measured from float32 squares
# (`row_bounds`): their float32 bound, gamma(width) relative, stays below
# 2.5e-4; wider rows (a vocabulary's output gradient) from float64 squares.
FLOAT32_SQUARES_WIDTH = 4096

# A float32 sum of squares below this may have lost all its squares to
# flushing (entries below 2^-63): that row then takes float64 squares, which
# measure a zero row as 0 (float32's absolute term, about sqrt(2 K 2^-126),
# would multiply the other factor's norm in a rank-one bound |x| |g|).
FLOAT32_SQUARES_FLOOR = 2.0**-60


def row_bounds(rows, floor=None):
    """[B, S] float64 upper bounds of the true norms of float32 rows [B, S, C],
    without Gram matrices.

    The squares and their sum over a row are float32 (half the memory
    traffic of float64 squares; no cast): the sum of squares is the dot of
    the row with itself, within gamma(C) |x|^2 + 2 C tau (1 + gamma(C)) of
    the exact one in any order, flushed or not, without overflow
    (`float32_dot_error` with one chunk), so |x|^2 <= (A^ + ea) / (1 - ga)
    (`float32_row_bounds`). An overflow leaves an inf (or a NaN) in its
    row: a row whose float32 sum is not finite, or below
    `FLOAT32_SQUARES_FLOOR` (a zero row, or one whose squares flushed), is
    measured from float64 squares instead (exact products, no overflow, a
    zero row measured 0), each row by its own values alone; so are all rows
    wider than `FLOAT32_SQUARES_WIDTH` and all rows where a setting lets
    float32 arithmetic round to fewer bits
    (`gram_precision.reduced_precision_settings`).
    A finite bound also says that every entry of its row is finite.

    `floor` replaces `FLOAT32_SQUARES_FLOOR` (None: keep it). A floor of 0
    keeps float32's bound for zero and flushed rows too, its absolute term
    (about 1.7e-18 for 128 entries): negligible where the bounds are squared
    and summed (an embedding's merged rows, `sum_of_squared_bounds`), not in
    a rank-one product |x| |g|.

    Example:

    >>> float(row_bounds(tf.ones([1, 1, 4]))[0, 0])
    2.0...
    >>> rows = tf.constant([[[3.0, 4.0]]]) * 2.0**100   # squares overflow float32
    >>> float(row_bounds(rows)[0, 0]) / 2.0**100        # float64 squares instead
    5.0...
    """
    from tfdp.per_example import gram_precision  # it probes float32_gram (circular)

    width = rows.shape[-1]

    def from_float64():
        return row_norm_bounds(_row_squares64(rows), width)

    if not 0 < width <= FLOAT32_SQUARES_WIDTH or gram_precision.reduced_precision_settings():
        return from_float64()
    squares = tf.cast(tf.reduce_sum(tf.square(rows), -1), tf.float64)
    floor = FLOAT32_SQUARES_FLOOR if floor is None else floor
    usable = tf.math.is_finite(squares) & (squares >= floor)
    bounds = float32_row_bounds(squares, width, chunk=width)
    # Each row's route from that row alone: the two routes bound a row
    # differently, so a batch-wide choice would let one record move the
    # bounds (and clipped sums) of the others. The batch's cond only skips
    # float64 squares where no row needs them.
    return tf.cond(tf.reduce_all(usable), lambda: bounds,
                   lambda: tf.where(usable, bounds, from_float64()))


def position_rows(x, g):
    """([B, S], [B, S]) float64 upper bounds of the row norms |x_s|, |g_s|
    of x [B, S, K] and g [B, S, O] (`row_bounds`), without Gram matrices.

    Example:

    >>> rows_x, rows_g = position_rows(tf.ones([1, 2, 4]), tf.ones([1, 2, 1]))
    >>> float(rows_x[0, 0]), float(rows_g[0, 1])
    (2.0..., 1.0...)
    """
    return row_bounds(x), row_bounds(g)


def sum_of_squared_bounds(bounds):
    """float64 [B] upper bound of sum_s b_s^2 from row-norm bounds [B, S]
    (`row_bounds`): the float64 squares and their sum rounded up, so the
    result bounds each example's sum of squared entries over its rows.

    Example:

    >>> float(sum_of_squared_bounds(tf.constant([[3.0, 4.0]], tf.float64))[0])
    25.00000000000001
    """
    return mass_of(bounds, bounds)


# Per-example tensors of fewer entries keep float64 squares
# (`sum_of_squares_by_rows`).
ROW_SQUARES_MIN_ENTRIES = 1024


def sum_of_squares_by_rows(tensor):
    """Upper bound, float64 [B], of each example's sum of squared entries,
    measured as rows: each example's entries, in their order, cut into rows
    of the widest trailing block of axes that holds at most
    `FLOAT32_SQUARES_WIDTH` entries, each row's norm bounded by `row_bounds`
    with no floor (float32 squares and sum with their proved bound; float64
    squares for a row whose float32 sum is not finite, and for every row
    where a setting lets float32 arithmetic narrow), and those bounds
    squared and summed, rounded up (`sum_of_squared_bounds`).

    The bound `sum_of_squares` gives, within gamma(width) relative (plus
    float32's absolute term, about 1.7e-18 a row of 128 entries), with no
    float64 copy of the tensor: for the large per-example tensors of
    materialized parts. Tensors other than float32, with a non-batch length
    known only at run time, with fewer than `ROW_SQUARES_MIN_ENTRIES`
    entries an example (the float64 copy is small there, and exact for tiny
    values) or whose last axis alone is wider than a row take
    `sum_of_squares`. A finite result says that every entry is finite.

    Example:

    >>> float(sum_of_squares_by_rows(tf.ones([1, 32, 32]) * 0.5)[0])
    256.0...
    """
    inner = tf.TensorShape(tensor.shape[1:])  # a NumPy array's shape too
    if (tf.as_dtype(tensor.dtype) != tf.float32 or inner.rank == 0
            or not inner.is_fully_defined()
            or inner.num_elements() < ROW_SQUARES_MIN_ENTRIES):
        return sum_of_squares(tensor)
    width = 1
    for length in reversed(inner.as_list()):
        if width * length > FLOAT32_SQUARES_WIDTH:
            break
        width *= length
    if width == 1:
        return sum_of_squares(tensor)
    rows = tf.reshape(tensor, [tf.shape(tensor)[0], inner.num_elements() // width, width])
    return sum_of_squared_bounds(row_bounds(rows, floor=0.0))


def mass_of(rows_x, rows_g):
    """float64 [B] upper bound of sum_s |x_s| |g_s| from row-norm bounds
    [B, S] (the float64 products and sum rounded up)."""
    positions = rows_x.shape[1] if rows_x.shape[1] is not None else tf.shape(rows_x)[1]
    return tf.reduce_sum(rows_x * rows_g, 1) * (1.0 + gamma(positions + 2, tf.float64))


def _gram64(rows):
    """[B, S, S] float64 Gram matrices of float32 rows [B, S, C], summed over
    column chunks of `GRAM_CHUNK` (the products of float32 values are exact
    in float64; only the sums round). The fallback of `factored_norm_bounds`
    where float32 Gram matrices could overflow or may not round as float32."""
    columns = rows.shape[-1]
    gram = None
    for start in range(0, columns, GRAM_CHUNK):
        chunk = tf.cast(rows[..., start:start + GRAM_CHUNK], tf.float64)
        part = tf.matmul(chunk, chunk, transpose_b=True)
        gram = part if gram is None else gram + part
    return gram


# Columns per float32 dot in `float32_gram`: each dot's rounding bound grows
# with its length (gamma(256) = 1.5e-5), and chunks are added in float64.
FLOAT32_GRAM_CHUNK = 256

def float32_dot_error(width, chunk=FLOAT32_GRAM_CHUNK):
    """(relative, absolute) Python floats for the dots `float32_gram`
    computes: each entry is within relative * |a| |b| + absolute of the
    exact dot of its two rows of `width` entries as read (float32 dots of
    `chunk` columns at most, added in float64; `row_bounds` takes one chunk
    of the whole width).

    A float32 dot of c entries computed in ANY order, with or without fused
    multiply-adds, with results below 2^-126 flushed to zero or not, and
    without overflow, is within gamma(c) |a| . |b| + 2 c FLOAT32_TINY
    (1 + gamma(c)) of the exact one (Higham's gamma(c) for the roundings;
    at most 2 c - 1 products and additions whose result may be flushed, an
    absolute error below FLOAT32_TINY each, carried through at most c - 1
    later roundings). The rows are cut into n chunks of c <=
    `FLOAT32_GRAM_CHUNK` columns whose float32 dots are added in float64
    (exact casts, within gamma64(n) of their absolute sum), and
    sum_chunks |a_c| . |b_c| <= |a| |b| (Cauchy-Schwarz), so: relative =
    gamma(c) + gamma64(n) (1 + gamma(c)), absolute = 2 width FLOAT32_TINY
    (1 + gamma(c)) (1 + gamma64(n)).

    Example:

    >>> relative, absolute = float32_dot_error(4)
    >>> relative > gamma(4), absolute > 8 * FLOAT32_TINY * (1 + gamma(4))
    (True, True)
    """
    chunk = min(width, chunk)
    chunks = -(-width // chunk)
    relative = gamma(chunk) + gamma(chunks, tf.float64) * (1.0 + gamma(chunk))
    absolute = 2.0 * width * FLOAT32_TINY * (1.0 + gamma(chunk)) * (1.0 + gamma(chunks, tf.float64))
    return relative, absolute


def float32_products(block):
    """The batched float32 matmul block block^T [..., S, S] of `float32_gram`,
    whose rounding `tfdp.per_example.gram_precision` checks."""
    return tf.matmul(block, block, transpose_b=True)


def float32_gram(rows):
    """[B, S, S] float64 Gram matrices of float32 rows [B, S, C]: float32
    products over chunks of `FLOAT32_GRAM_CHUNK` columns (one batched matmul
    per `GRAM_CHUNK` columns; the last chunk padded with zeros, which add
    nothing), each cast to float64 and added there (`float32_dot_error`
    bounds what this rounds and flushes).

    Example:

    >>> float(float32_gram(tf.ones([1, 2, 300]))[0, 0, 1])
    300.0
    """
    positions, columns = rows.shape[1], rows.shape[-1]
    chunk = min(columns, FLOAT32_GRAM_CHUNK)
    gram = None
    for start in range(0, columns, GRAM_CHUNK):
        block = rows[..., start:start + GRAM_CHUNK]
        width = block.shape[-1]
        pieces = -(-width // chunk)
        if pieces == 1:  # no unit axis after the batch (see tfdp.per_example.onednn)
            part = tf.cast(float32_products(block), tf.float64)
        else:
            if pieces * chunk != width:
                block = tf.pad(block, [[0, 0], [0, 0], [0, pieces * chunk - width]])
            block = tf.transpose(tf.reshape(block, [-1, positions, pieces, chunk]), [0, 2, 1, 3])
            part = tf.reduce_sum(tf.cast(float32_products(block), tf.float64), 1)
        gram = part if gram is None else gram + part
    return gram


def float32_gram_error(x_gram, g_gram, rows_x, rows_g, fan_in, fan_out):
    """float64 [B] bound on |sum_{s,t} A^_st B^_st - sum_{s,t} A_st B_st|
    where A^ = `x_gram`, B^ = `g_gram` [B, S, S] are an example's Gram
    matrices from `float32_gram` (rows of widths `fan_in`, `fan_out`), A
    and B the exact Gram matrices of the rows as read, and the double sum of
    the products A^_st B^_st is taken in float64 (A^, B^ are sums of float32
    values there; the products are not exact, so they count in the sum's
    rounding below).
    `rows_x`, `rows_g` [B, S] are upper bounds of the row norms r_s = |x_s|
    and q_s = |g_s|. With |A^_st - A_st| <= a_st = ga r_s r_t + ea and
    |B^_st - B_st| <= b_st = gb q_s q_t + eb (`float32_dot_error`) and
    |A_st| <= |A^_st| + a_st, |B_st| <= |B^_st| + b_st:

        sum |A^ B^ - A B| <= sum |A| b + a |B| + a b
            <= sum |A^| b + a |B^| + 3 a b
             = gb q'|A^|q + eb sum|A^| + ga r'|B^|r + ea sum|B^|
               + 3 (ga gb m^2 + ga eb X^2 + ea gb G^2 + S^2 ea eb),

    m = sum_s r_s q_s, X = sum_s r_s, G = sum_s q_s (sum_{s,t} r_s r_t q_s
    q_t = m^2). The float64 products and their float64 sum over t then s
    add at most gamma64(2 S + 4) sum |A^ B^|. Every quantity here is a float64 sum of at
    most 2 S + 8 rounded positive terms, so the result is raised by
    (1 + gamma64(2 S + 16)).

    Example:

    >>> gram = tf.ones([1, 1, 1])
    >>> rows = tf.ones([1, 1], tf.float64)
    >>> bound = float(float32_gram_error(gram, gram, rows, rows, 8, 8)[0])
    >>> 2 * gamma(8) < bound < 2 * gamma(9)
    True
    """
    positions = rows_x.shape[1]
    relative_x, absolute_x = float32_dot_error(fan_in)
    relative_g, absolute_g = float32_dot_error(fan_out)
    a_abs = tf.abs(tf.cast(x_gram, tf.float64))
    b_abs = tf.abs(tf.cast(g_gram, tf.float64))

    def quadratic(matrix, rows):
        return tf.reduce_sum(tf.linalg.matvec(matrix, rows) * rows, 1)

    def total(matrix):
        return tf.reduce_sum(tf.reduce_sum(matrix, 2), 1)

    sum_x, sum_g = tf.reduce_sum(rows_x, 1), tf.reduce_sum(rows_g, 1)
    mass = tf.reduce_sum(rows_x * rows_g, 1)
    entries = (relative_g * quadratic(a_abs, rows_g) + absolute_g * total(a_abs)
               + relative_x * quadratic(b_abs, rows_x) + absolute_x * total(b_abs)
               + 3.0 * (relative_x * relative_g * tf.square(mass)
                        + relative_x * absolute_g * tf.square(sum_x)
                        + absolute_x * relative_g * tf.square(sum_g)
                        + float(positions) ** 2 * absolute_x * absolute_g))
    summation = gamma(2 * positions + 4, tf.float64) * total(a_abs * b_abs)
    return (entries + summation) * (1.0 + gamma(2 * positions + 16, tf.float64))


def float32_row_bounds(squares, width, chunk=FLOAT32_GRAM_CHUNK):
    """[B, S] float64 upper bounds of the true norms of rows of `width`
    entries from their squared norms `squares` [B, S] as float32 dots of
    `chunk` columns computed them (the diagonal of their `float32_gram`, or
    `row_bounds`' one-chunk sums; no overflow): the computed A^_ss is at
    least A_ss (1 - relative) - absolute (`float32_dot_error`), so
    A_ss <= (A^_ss + absolute) / (1 - relative); then `row_norm_bounds` (the
    float64 square root's rounding, and entries the matmul read as 0 under
    denormals-are-zero).

    Example:

    >>> float(float32_row_bounds(tf.constant([[25.0]], tf.float64), 2)[0, 0])
    5.0...
    """
    relative, absolute = float32_dot_error(width, chunk)
    return row_norm_bounds((squares + absolute) / (1.0 - relative), width)


def _float32_factored(x, g, x_gram, g_gram):
    """(sq, rows_x, rows_g) from finite `float32_gram` matrices: the float64
    double sum of their products plus `float32_gram_error`."""
    fan_in, fan_out = x.shape[2], g.shape[2]
    rows_x = float32_row_bounds(tf.linalg.diag_part(x_gram), fan_in)
    rows_g = float32_row_bounds(tf.linalg.diag_part(g_gram), fan_out)
    estimate = tf.reduce_sum(tf.reduce_sum(x_gram * g_gram, 2), 1)
    sq = estimate + float32_gram_error(x_gram, g_gram, rows_x, rows_g, fan_in, fan_out)
    return sq, rows_x, rows_g


def _float64_factored(x, g):
    """(sq, rows_x, rows_g) from float64 Gram matrices: sum_{s,t}
    (x_s.x_t)(g_s.g_t) plus gamma64(K + O + 2S + 4) mass^2 (each Gram entry
    within gamma64(K) |x_s||x_t| or gamma64(O) |g_s||g_t|, one rounding per
    product, S^2 products summed over t then s)."""
    positions, fan_in, fan_out = x.shape[1], x.shape[2], g.shape[2]
    x_gram, g_gram = _gram64(x), _gram64(g)
    estimate = tf.reduce_sum(tf.reduce_sum(x_gram * g_gram, 2), 1)
    rows_x = row_norm_bounds(tf.linalg.diag_part(x_gram), fan_in)
    rows_g = row_norm_bounds(tf.linalg.diag_part(g_gram), fan_out)
    terms = fan_in + fan_out + 2 * positions + 4
    sq = estimate + gamma(terms, tf.float64) * tf.square(mass_of(rows_x, rows_g))
    return sq, rows_x, rows_g


def _rank_one(x, g):
    """(sq, rows_x, rows_g) for one position: ||x g^T||^2 = |x|^2 |g|^2
    exactly, so the row bounds' product (rounded up) bounds it."""
    rows_x, rows_g = position_rows(x, g)
    sq = tf.square(rows_x[:, 0] * rows_g[:, 0]) * (1.0 + gamma(4, tf.float64))
    return sq, rows_x, rows_g


def factored_norm_bounds(x, g):
    """Upper bounds for the factored per-example gradients sum_s x_s g_s^T.

    Args:
        x: float32 [B, S, K] inputs at S positions (static S, K).
        g: float32 [B, S, O] output gradients at the same positions.

    Returns:
        (sq, rows_x, rows_g), float64: `sq` [B] >= ||sum_s x_s g_s^T||_F^2
        (exact arithmetic on x and g as the Gram matrices read them), and
        [B, S] upper bounds of the true row norms |x_s| and |g_s|, which
        bound every rounding that depends on the positions' sizes
        (`mass_of`, `summation_rounding`, `dot_rounding`).

    The squared norm is sum_{s,t} (x_s . x_t)(g_s . g_t) (|x||g| for one
    position, `_rank_one`). Its Gram matrices are float32 products
    (`float32_gram`; `float32_gram_error` bounds what they round and flush)
    where float32 matmuls round as float32 (no setting allows less and the
    precision probe passed: `gram_precision.gram_rounds_as_float32`), the
    canaries computed by the same matmuls came out exact
    (`gram_precision.checked_gram`) and every entry of the example's own
    Gram matrices is finite (an overflow in any product or partial sum
    leaves an inf or a NaN in its entry; each example's route is decided by
    its own entries); otherwise float64 products (exact) with
    gamma64(K + O + 2S + 4) mass^2 added. Either bound is added, so `sq`
    holds for any record, a cancelling one included.
    """
    from tfdp.per_example import gram_precision  # it probes float32_gram (circular)

    if x.shape[1] == 1:
        sq, rows_x, rows_g = _rank_one(x, g)
    elif gram_precision.gram_rounds_as_float32(x.shape, g.shape):
        x_gram, x_exact = gram_precision.checked_gram(x)
        g_gram, g_exact = gram_precision.checked_gram(g)
        # Each example's route from its own Gram entries (a batch-wide one
        # would let one record's overflow move the others' bounds); the
        # canaries, which no record moves, decide for the whole batch.
        finite = (tf.reduce_all(tf.math.is_finite(x_gram), [1, 2])
                  & tf.reduce_all(tf.math.is_finite(g_gram), [1, 2]))
        single = _float32_factored(x, g, x_gram, g_gram)

        def per_example():
            double = _float64_factored(x, g)
            return tuple(tf.where(tf.reshape(finite, [-1] + [1] * (a.shape.rank - 1)), a, b)
                         for a, b in zip(single, double))

        sq, rows_x, rows_g = tf.cond(
            x_exact & g_exact,
            lambda: tf.cond(tf.reduce_all(finite), lambda: single, per_example),
            lambda: _float64_factored(x, g))
    else:
        sq, rows_x, rows_g = _float64_factored(x, g)
    return tf.maximum(sq, 0.0), rows_x, rows_g


def round_up_to_float32(value):
    """`value` (float64) as float32, rounded up: the relative margin 2^-20
    covers the float64 -> float32 rounding (2^-24) and the float32 sqrt and
    division that clipping applies next (a few units of 2^-24). Only in
    float32's normal range: a result below 2^-126 is a subnormal rounded with
    a large relative error, or 0 where flushed, which
    `tfdp.mechanisms.dpsgd.clip_factors` reads as 2^-126."""
    return tf.cast(value * (1.0 + math.ldexp(1.0, -20)), tf.float32)
