"""Per-example gradients held in the cheapest exact form a layer allows.

DP needs each example's gradient norm and a reweighted sum over examples,
rarely the gradients themselves. Every layer rule returns "parts", each
covering some variables, with one interface (`Part`):

* `sq_norm_bounds()`: float64 [B], an upper bound of the squared L2 norm of
  each example's gradient on the part, in exact arithmetic on the float32
  tensors the part holds (`tfdp.per_example.rounding`);
* `summation_errors()`: float64 [B], a bound on the norm of the rounding that
  `weighted_sum` adds to one example's contribution, per unit weight, and
  of the difference between the operands the norm read and the ones the sum
  uses (subnormal entries read as 0 by one and as their value by the other);
* `absolute_errors()`: float64 [B], a bound on what `weighted_sum` adds to
  one example's contribution that does not shrink with its weight: results
  flushed to zero (below 2^-126) before a multiplication
  (`rounding.flushed_products`);
* `dots(vectors)`: float64 [B] inner product of each example's gradient
  with `vectors` (aligned with the part's variables), computed in float64
  (where nothing underflows), and `dot_errors(vectors)`, float64 [B], a
  bound on its rounding and on the subnormal readings of its operands;
* `weighted_sum(weights, accumulate=tf.float32)`: sum_i weights_i g_i per
  variable, accumulated in `accumulate` (rows with weight 0 are skipped, so a
  NaN row cannot poison the sum);
* `materialize()`: [B, *shape] per variable (memory: batch x parameters);
* `grouped(k)`: the same gradients with every k consecutive examples joined
  into one (their gradients summed): a user's gradient from its k records
  (user-level DP). A linear map's joined gradient keeps the factored form,
  its records' positions becoming the user's positions.

Clipping reads `PerExampleGradients.sq_norms()`, which joins these into an
upper bound of the squared norm of what the weighted sum adds for each
example per unit weight, whatever the record: a crafted record whose
factored norm cancels to rounding noise is clipped by its bound, not let
through. `PerExampleGradients.weighted_sum(weights)` keeps the promise
clipping relies on, example i adds at most |w_i| * norm_bounds()_i, by
taking each example's absolute error from its weight (`shrink_weights`).
The proof, operation by operation, is on the per-example mechanism page
(docs/mechanisms/per-example.md).

Under mixed precision (layers computing in bfloat16 or float16, weights in
float32) every part casts its inputs to float32 first (`as_float32`), so
norms and the clipped sum come from the same float32 values.

`LinearGrads` holds a linear map's gradient factored (X_i^T G_i),
`MaterializedGrads` holds gradients in full. `PerExampleGradients` joins the
parts of a whole model.

Example:

>>> import tensorflow as tf
>>> v = tf.Variable(tf.zeros([2, 1]))
>>> x = tf.constant([[[1.0, 0.0]], [[0.0, 2.0]]])   # [B=2, S=1, K=2]
>>> g = tf.constant([[[3.0]], [[1.0]]])             # [B=2, S=1, O=1]
>>> bounds = LinearGrads(x, g, v).sq_norms().numpy()   # 9 and 4, rounded up
>>> bounds.round(4), bool((bounds >= [9.0, 4.0]).all())
(array([9., 4.], dtype=float32), True)
"""

import contextlib
import contextvars

import tensorflow as tf

from tfdp.per_example import gram_precision, rounding


def as_float32(tensor):
    """`tensor` cast to float32 if it is a lower-precision float, else as is.

    Example:

    >>> as_float32(tf.constant([1.5], tf.bfloat16)).dtype
    tf.float32
    >>> as_float32(tf.constant([3])).dtype
    tf.int32
    """
    if not isinstance(tensor, (tf.Tensor, tf.Variable)) and not hasattr(tensor, "dtype"):
        tensor = tf.convert_to_tensor(tensor)
    dtype = tf.as_dtype(tensor.dtype)
    if dtype.is_floating and dtype.size < 4:
        return tf.cast(tensor, tf.float32)
    return tensor


# A per-example kernel gradient of this many entries (4 MB in float32) or
# more is not materialized when ghost norms hold less (`LinearGrads`).
LARGE_KERNEL = 1 << 20


def masked(tensor, keep):
    """`tensor` with the rows (axis 0) where `keep` is False set to zero."""
    keep = tf.reshape(keep, [-1] + [1] * (tensor.shape.rank - 1))
    return tf.where(keep, tensor, tf.zeros_like(tensor))


def finite_or_masked(tensor, bounds, keep, min_entries=rounding.ROW_SQUARES_MIN_ENTRIES):
    """Float32 `tensor` [B, ...] as is where every norm bound in `bounds`
    (an example's squared norm [B], or its rows' norms [B, S]) is finite,
    which says every entry is finite (w = 0 then adds nothing, in float32 or
    cast to float64); otherwise, and always where a setting lets a matmul
    read float32 narrower (3e38 could become inf), `masked` (w = 0 times an
    inf entry would add a NaN). Spares a pass over a large tensor in the
    usual case. A tensor of fewer than `min_entries` entries an example is
    masked (a pass cheaper than the branch), and so is one that is not
    float32 (a rule's own float64 tensor: a finite entry above 3.4e38 is
    inf once the sum casts it to float32).

    Example:

    >>> keep, ones = tf.constant([False]), tf.ones([1, 1024])
    >>> float(tf.reduce_sum(finite_or_masked(ones, tf.constant([1024.0], tf.float64), keep)))
    1024.0
    >>> float(tf.reduce_sum(finite_or_masked(ones, tf.constant([float("inf")], tf.float64),
    ...                                      keep)))
    0.0
    """
    entries = rounding.entries_per_example(tensor)
    if (tensor.dtype != tf.float32 or not isinstance(entries, int) or entries < min_entries
            or gram_precision.reduced_precision_settings()):
        return masked(tensor, keep)
    return tf.cond(tf.reduce_all(tf.math.is_finite(bounds)), lambda: tensor,
                   lambda: masked(tensor, keep))


def norm_of(vectors):
    """float64 L2 norm of a list of tensors taken together (a Python-side
    direction shared by every example, e.g. weight-decay offsets)."""
    return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(v, tf.float64))) for v in vectors]))


def joined_rows(tensor, k):
    """[B, S, C] rows as [B / k, k S, C]: k consecutive examples' positions
    joined (a static k S when S is static)."""
    shape = tf.shape(tensor)
    dims = [tensor.shape[i] if tensor.shape[i] is not None else shape[i]
            for i in range(1, tensor.shape.rank)]
    joined = tf.reshape(tensor, tf.stack([shape[0] // k, k * dims[0]] + dims[1:]))
    static = [None if tensor.shape[0] is None else tensor.shape[0] // k,
              None if tensor.shape[1] is None else k * tensor.shape[1]]
    return tf.ensure_shape(joined, static + tensor.shape[2:].as_list())


# An example's absolute error up to this fraction of |w| times its norm bound
# is absorbed by a margin of the same size in `norm_bounds` (the weight is
# used as given: ordinary data); a larger one is taken from the weight.
ABSORBED = 2.0**-40

# With weight-decay offsets o, an example's weight also keeps its separate
# pieces w |g| and w |o| within OFFSET_SPREAD * C: its gradient may cancel the
# decay only to 1 / OFFSET_SPREAD of their sizes before that, not further.
# A batch whose gradients all cancel the decay (g = -o) had weights near
# C / (6 u |o|), and the float32 rounding of the two sums across examples
# moved the update 8x to 32x the bound.
OFFSET_SPREAD = 8.0

# float32's relative rounding is 2^-24: a reduced weight shrunk by this much
# more stays below its float64 value after the cast.
_CAST_MARGIN = 1.0 - 2.0**-20


def shrink_weights(weights, norms, absolute):
    """Weights w' with |w'_i| norms_i + absolute_i <= |w_i| norms_i (1 + ABSORBED).

    Example i's contribution to a weighted sum is at most
    |w'_i| norms_i + absolute_i, `norms` bounding its gradient per unit weight
    and `absolute` what the sum adds whatever the weight (flushed results).
    Where absolute_i <= ABSORBED |w_i| norms_i the weight is kept (the margin
    in `PerExampleGradients.norm_bounds` covers it); otherwise it is reduced
    to sign(w_i) (|w_i| - absolute_i / norms_i), or 0 when that is not
    positive (the example then adds nothing). A weight that is not finite,
    or whose bounds are not, becomes 0.

    Args:
        weights: float32 [B].
        norms: float64 [B] per-unit-weight bounds (`_core_norm_bounds`).
        absolute: float64 [B] absolute errors.

    Example:

    >>> w = tf.constant([0.5, 0.5, 0.5])
    >>> norms = tf.constant([2.0, 2.0, 2.0], tf.float64)
    >>> shrink_weights(w, norms, tf.constant([1e-30, 0.5, 2.0], tf.float64)).numpy().round(6)
    array([0.5 , 0.25, 0.  ], dtype=float32)
    """
    magnitude = tf.abs(tf.cast(weights, tf.float64))
    absorbed = absolute <= ABSORBED * magnitude * norms
    reduced = (magnitude - absolute / norms) * _CAST_MARGIN
    usable = tf.math.is_finite(reduced) & (reduced > 0.0)
    reduced = tf.where(usable, reduced, tf.zeros_like(reduced))
    reduced = tf.cast(reduced, weights.dtype) * tf.sign(weights)
    return tf.where(absorbed & tf.math.is_finite(weights), weights, reduced)


class Part:
    """Base of per-example gradient parts (see the module docstring).

    Subclasses give `variables`, `sq_norm_bounds`, `dots`, `weighted_sum`,
    `materialize` and `grouped`; the defaults below suit a part that sums
    exactly the tensors it measured.
    """

    def summation_errors(self):
        """Bound on the rounding `weighted_sum` adds per example per unit
        weight, and on subnormal readings (float64 [B])."""
        return tf.zeros_like(self.sq_norm_bounds())

    def absolute_errors(self):
        """Bound on what `weighted_sum` adds per example whatever its weight:
        flushed results (float64 [B])."""
        return tf.zeros_like(self.sq_norm_bounds())

    def sq_norms(self):
        """float32 [B] upper bound of the squared norm of what `weighted_sum`
        adds for each example per unit weight (this part alone)."""
        bound = tf.sqrt(self.sq_norm_bounds()) + self.summation_errors()
        return rounding.round_up_to_float32(tf.square(bound))


class LinearGrads(Part):
    """Per-example gradients of a map Z = X M (+ b) applied at S positions.

    Example i's matrix gradient is X_i^T G_i summed over positions (sequence
    steps, conv output pixels whose input patches form X, time steps of a
    recurrence); its bias gradient is the sum of G_i over positions.

    Norms come from float32 Gram matrices with their rounding bound added
    (`rounding.factored_norm_bounds`) where the factored form is kept, or
    from the materialized per-example matrices (which are then what the
    weighted sum adds).

    Args:
        x: float tensor [B, S, K], the inputs at each position.
        g: float tensor [B, S, O], gradients of the loss at the outputs.
        kernel: the variable holding M (K * O elements).
        bias: the bias variable ([O] elements), or None.
        kernel_perm: optional permutation. When given, M is the kernel
            transposed by `kernel_perm` and then reshaped to [K, O] (an
            EinsumDense kernel whose contracted axes are not all first).
        matrices: optional callable returning the [B, K, O] per-example
            matrices X_i^T G_i by another route than the einsum of `x` and
            `g` (`tfdp.per_example.grouped_filter`), called where they are
            materialized: the norms then measure the tensor it returns,
            which the weighted sum adds.
    """

    def __init__(self, x, g, kernel, bias=None, kernel_perm=None, matrices=None):
        self.g = as_float32(g)
        self.x = as_float32(x)
        if not self.x.dtype.is_floating:  # a lookup's int64 one-hot: Dense multiplies it cast
            self.x = tf.cast(self.x, self.g.dtype)
        self.variables = [kernel] + ([bias] if bias is not None else [])
        self._kernel_shape = kernel.shape
        self._perm = kernel_perm
        self._matrices = matrices
        positions = x.shape[1]
        fan_in, fan_out = x.shape[2], g.shape[2]
        # Gram-matrix ("ghost") norms cost S^2 (K + O) per example against
        # S K O for materialised per-example kernels: pick the cheaper. Ghost
        # norms also hold 2 S^2 floats per example against K O: where the
        # kernel is large (a language model's vocabulary projection, 50257 x
        # 128 for GPT-2) and the grams are smaller, they win on memory at
        # about equal cost.
        self._ghost = positions is not None and (
            positions * (fan_in + fan_out) < fan_in * fan_out
            or (fan_in * fan_out >= LARGE_KERNEL and 2 * positions**2 < fan_in * fan_out)
        )
        # One position has no cross terms: its factored norm |x|^2 |g|^2 is
        # exact up to a relative rounding, so it is never materialized.
        self._factored = positions == 1 or self._ghost
        self._materialized = None
        self._factored_bounds = None
        self._row_bounds = None
        self._mass = None
        self._bias_rows = None
        self._matrix_bounds = None

    def _to_kernel(self, matrix, batch_dims):
        """[*batch, K, O] matrix gradients in the kernel's layout."""
        if self._perm is None:
            return tf.reshape(matrix, tf.concat([batch_dims, self._kernel_shape], 0))
        permuted = [self._kernel_shape[p] for p in self._perm]
        inverse = sorted(range(len(self._perm)), key=lambda i: self._perm[i])
        offset = len(matrix.shape) - 2
        matrix = tf.reshape(matrix, tf.concat([batch_dims, permuted], 0))
        return tf.transpose(
            matrix, list(range(offset)) + [offset + i for i in inverse]
        )

    def _from_kernel(self, vector):
        if self._perm is not None:
            vector = tf.transpose(vector, self._perm)
        return tf.reshape(vector, [self.x.shape[2], self.g.shape[2]])

    def _per_example_matrix(self):
        """[B, K, O] per-example matrix gradients, computed once per step."""
        if self._materialized is None and self._matrices is not None:
            self._materialized = as_float32(self._matrices())
        elif self._materialized is None:
            self._materialized = tf.einsum("bsk,bso->bko", self.x, self.g)
        return self._materialized

    def _bounds(self):
        """(squared-norm bound, row bounds of x, row bounds of g) of the
        factored kernel gradients."""
        if self._factored_bounds is None:
            self._factored_bounds = rounding.factored_norm_bounds(self.x, self.g)
        return self._factored_bounds

    def _rows(self):
        """[B, S] float64 upper bounds of the row norms |x_s| and |g_s|."""
        if self._factored:
            return self._bounds()[1:]
        if self._row_bounds is None:
            self._row_bounds = rounding.position_rows(self.x, self.g)
        return self._row_bounds

    def mass(self):
        """float64 [B] upper bound of sum_s |x_s| |g_s|, which bounds every
        rounding that depends on the sizes of the positions' terms."""
        if self._mass is None:  # several bounds read it: one computation
            self._mass = rounding.mass_of(*self._rows())
        return self._mass

    def _row_sums(self):
        """float64 [B] upper bounds of sum_s |x_s| and sum_s |g_s|."""
        rows_x, rows_g = self._rows()
        return tf.reduce_sum(rows_x, 1), tf.reduce_sum(rows_g, 1)

    def _entries(self):
        return self.x.shape[2] * self.g.shape[2]

    def _bias_sums(self):
        """[B, O] bias gradients (G summed over positions), computed once, so
        that the norm and the weighted sum read the same values (at one
        position the norm reads g's row bound and the sum w g instead)."""
        if self._bias_rows is None:
            self._bias_rows = tf.reduce_sum(self.g, 1)
        return self._bias_rows

    def sq_norm_bounds(self):
        if self._factored:
            kernel = self._bounds()[0]
        else:
            kernel = self._matrix_sq_bounds()
        if len(self.variables) == 1:
            return kernel
        return kernel + self._bias_sq_bounds()

    def _matrix_sq_bounds(self):
        """float64 [B] bounds of the per-example matrices' squared norms
        (`rounding.sum_of_squares_by_rows`), computed once: the weighted sum
        reads whether they are finite."""
        if self._matrix_bounds is None:
            self._matrix_bounds = rounding.sum_of_squares_by_rows(self._per_example_matrix())
        return self._matrix_bounds

    def _bias_sq_bounds(self):
        """float64 [B] upper bounds of the bias gradients' squared norms. With
        one position the bias gradient is g's row, whose bound the kernel's
        rank-one bound already holds (squared, and raised by gamma64(2) for
        that square's rounding); otherwise its float64 sum of squares."""
        if self.x.shape[1] == 1:
            rows_g = self._rows()[1][:, 0]
            return tf.square(rows_g) * (1.0 + rounding.gamma(2, tf.float64))
        return rounding.sum_of_squares(self._bias_sums())

    def summation_errors(self):
        fan_in, fan_out = self.x.shape[2], self.g.shape[2]
        if self._factored:
            # Rounding of the example's rows in the matmul, and x or g
            # entries the Gram matrices read as 0 but the sum as subnormal.
            sum_x, sum_g = self._row_sums()
            error = (rounding.summation_rounding(self.x.shape[1], self.mass())
                     + rounding.subnormal_reading(fan_in, sum_g)
                     + rounding.subnormal_reading(fan_out, sum_x))
        else:
            # The sum adds the matrix it measured, entries read alike but
            # for subnormal ones (below 2^-126 each).
            error = rounding.subnormal_reading(self._entries(), 1.0) + tf.zeros_like(
                self.sq_norm_bounds())
        if len(self.variables) == 2:
            error += rounding.subnormal_reading(fan_out, 1.0)
        return error

    def absolute_errors(self):
        fan_out = self.g.shape[2]
        if self._factored:
            # w * g_s is formed first: a flushed entry then meets |x_s|.
            error = rounding.flushed_products(fan_out, self._row_sums()[0], self._entries(),
                                              self.x.shape[1])
        else:
            error = rounding.flushed_products(self._entries(), 1.0, 0, 0) + tf.zeros_like(
                self.sq_norm_bounds())
        if len(self.variables) == 2:
            error += rounding.flushed_products(fan_out, 1.0, 0, 0)
        return error

    def dots(self, vectors):
        matrix = tf.cast(self._from_kernel(vectors[0]), tf.float64)
        if self._factored:
            # Two-operand contractions: a three-operand tf.einsum can be far slower.
            products = tf.einsum("bsk,ko->bso", tf.cast(self.x, tf.float64), matrix) * tf.cast(
                self.g, tf.float64)
        else:
            products = tf.cast(self._per_example_matrix(), tf.float64) * matrix
        result = rounding.reduce_per_example(products)
        if len(self.variables) == 2:
            result += tf.linalg.matvec(tf.cast(self._bias_sums(), tf.float64),
                                       tf.cast(tf.reshape(vectors[1], [-1]), tf.float64))
        return result

    def dot_errors(self, vectors):
        fan_in, fan_out = self.x.shape[2], self.g.shape[2]
        size = norm_of(vectors[:1])
        if self._factored:
            # sum_{s,k,o} |x_sk| |M_ko| |g_so| <= |M|_F sum_s |x_s| |g_s|;
            # subnormal readings of x, g (times |M| and the other's rows) and
            # of M (times the mass).
            sum_x, sum_g = self._row_sums()
            terms = fan_in + fan_out + self.x.shape[1]
            error = (rounding.dot_rounding(terms, size, self.mass())
                     + rounding.subnormal_reading(fan_in, size * sum_g)
                     + rounding.subnormal_reading(fan_out, size * sum_x)
                     + rounding.subnormal_reading(self._entries(), self.mass()))
        else:
            magnitude = tf.sqrt(rounding.sum_of_squares(self._per_example_matrix()))
            error = (rounding.dot_rounding(fan_in + fan_out, size, magnitude)
                     + rounding.subnormal_reading(self._entries(), size + magnitude))
        if len(self.variables) == 2:
            magnitude = tf.sqrt(rounding.sum_of_squares(self._bias_sums()))
            bias_size = norm_of(vectors[1:])
            error += (rounding.dot_rounding(fan_out, bias_size, magnitude)
                      + rounding.subnormal_reading(fan_out, bias_size + magnitude))
        return error

    def weighted_sum(self, weights, accumulate=tf.float32):
        keep = tf.not_equal(weights, 0.0)
        g = None  # w g, where the factored sum forms it
        if self._materialized is not None:
            matrix = tf.tensordot(tf.cast(weights, accumulate), tf.cast(
                finite_or_masked(self._materialized, self._matrix_sq_bounds(), keep),
                accumulate), axes=1)
        else:
            # w g in float32, as bounded; 0 where w is 0 even for a row that is not finite.
            g = tf.math.multiply_no_nan(self.g, weights[:, None, None])
            # A zero row of w g meets its x row in the matmul: 0 x adds
            # nothing where x is finite, which finite row bounds say of every
            # row; x is masked where a bound is not, under the settings that
            # narrow matmuls and where x is not float32 (`finite_or_masked`,
            # at any size, as x was before the materialized parts used it).
            x = finite_or_masked(self.x, self._rows()[0], keep, min_entries=0)
            # Weight G, then one matmul over (example, position) rows: measured
            # 60x faster than tf.einsum("b,bsk,bso->ko") for a 784x256 Dense
            # layer at batch 2048 on 2 CPU cores.
            matrix = tf.matmul(
                tf.cast(tf.reshape(x, [-1, self.x.shape[2]]), accumulate),
                tf.cast(tf.reshape(g, [-1, self.g.shape[2]]), accumulate),
                transpose_a=True,
            )
        sums = [self._to_kernel(matrix, tf.constant([], tf.int32))]
        if len(self.variables) == 2:
            if g is not None and self.x.shape[1] == 1 and g.dtype == accumulate:
                # One position: the bias gradients are g's rows, and w g is
                # formed (0 where w is 0): summed over examples, no mask.
                bias = tf.reduce_sum(g[:, 0], 0)
            else:
                bias = tf.linalg.matvec(tf.cast(masked(self._bias_sums(), keep), accumulate),
                                        tf.cast(weights, accumulate), transpose_a=True)
            sums.append(tf.reshape(bias, self.variables[1].shape))
        return sums

    def grouped(self, k):
        return LinearGrads(joined_rows(self.x, k), joined_rows(self.g, k), self.variables[0],
                           self.variables[1] if len(self.variables) == 2 else None, self._perm)

    def materialize(self):
        batch = tf.shape(self.x)[0:1]
        grads = [self._to_kernel(self._per_example_matrix(), batch)]
        if len(self.variables) == 2:
            grads.append(tf.reshape(self._bias_sums(), tf.concat([batch, self.variables[1].shape], 0)))
        return grads


class SummedAsMeasured(Part):
    """Base of parts whose weighted sum adds w times exactly the float32
    entries their norm measured (`_entries()` of them per example): only a
    subnormal entry read as 0 by the float64 norm and not by w * g (per unit
    weight), and w * g flushed to zero (absolute), below 2^-126 each."""

    def summation_errors(self):
        return rounding.subnormal_reading(self._entries(), 1.0) + tf.zeros_like(
            self.sq_norm_bounds())

    def absolute_errors(self):
        return rounding.flushed_products(self._entries(), 1.0, 0, 0) + tf.zeros_like(
            self.sq_norm_bounds())


class MaterializedGrads(SummedAsMeasured):
    """Per-example gradients held in full, one [B, *shape] tensor a variable.

    The weighted sum adds exactly these tensors, so their sums of squares
    (rounded up) bound what it adds.

    Args:
        variables: list of variables.
        grads: list of tensors [B, *variable.shape], aligned with variables.
    """

    def __init__(self, variables, grads):
        self.variables = list(variables)
        self.grads = [as_float32(g) for g in grads]
        self._sq_bounds = None

    def _grad_sq_bounds(self):
        """float64 [B] squared-norm bounds of each tensor
        (`rounding.sum_of_squares_by_rows`), computed once: the weighted
        sum reads whether they are finite."""
        if self._sq_bounds is None:
            self._sq_bounds = [rounding.sum_of_squares_by_rows(g) for g in self.grads]
        return self._sq_bounds

    def sq_norm_bounds(self):
        return tf.add_n(self._grad_sq_bounds())

    def _entries(self):
        return sum(rounding.entries_per_example(g) for g in self.grads)

    def dots(self, vectors):
        return tf.add_n([
            rounding.reduce_per_example(tf.cast(g, tf.float64) * tf.cast(v, tf.float64))
            for g, v in zip(self.grads, vectors)
        ])

    def dot_errors(self, vectors):
        errors = []
        for g, v in zip(self.grads, vectors):
            magnitude, size = tf.sqrt(rounding.sum_of_squares(g)), norm_of([v])
            entries = rounding.terms_per_example(g)
            errors.append(rounding.dot_rounding(entries, magnitude, size)
                          + rounding.subnormal_reading(entries, magnitude + size))
        return tf.add_n(errors)

    def weighted_sum(self, weights, accumulate=tf.float32):
        keep = tf.not_equal(weights, 0.0)
        return [tf.tensordot(tf.cast(weights, accumulate),
                             tf.cast(finite_or_masked(g, sq, keep), accumulate), axes=1)
                for g, sq in zip(self.grads, self._grad_sq_bounds())]

    def materialize(self):
        return list(self.grads)

    def grouped(self, k):
        def joined(g):
            shape = tf.concat([[-1, k], tf.shape(g)[1:]], 0)
            return tf.reduce_sum(tf.reshape(g, shape), 1)

        return MaterializedGrads(self.variables, [joined(g) for g in self.grads])


# A callable returning the context the parts' methods run in after their
# pass (None: as they are): `tfdp.models.state_writes.checked_per_example_pass`
# sets a scan, under the pass's rules, for the gradients made inside it.
PART_CALLS = contextvars.ContextVar("tfdp_part_calls", default=None)


class PerExampleGradients:
    """Per-example gradients of a model's trainable variables.

    Each example's gradient is the concatenation over `parts` plus an optional
    constant `offsets` shared by every example (weight decay inside the
    per-example loss adds lambda * theta to every example's gradient).

    Args:
        variables: the model's trainable variables, in the order results use.
        parts: objects covering every variable exactly once (see the module
            docstring for their interface).
        offsets: optional list aligned with `variables`, added to every
            example's gradient.
        path: which per-example path produced them ("batched" or
            "vectorized"), for users and logs.
        part_calls: a callable returning the context every later call into
            the parts runs in (None: `PART_CALLS`'s value now, the scan
            `tfdp.models.state_writes.checked_per_example_pass` sets for
            the gradients made inside it; `grouped` and `with_offsets` pass
            theirs on).

    Example:

    >>> v = tf.Variable([0.0, 0.0])
    >>> g = PerExampleGradients([v], [MaterializedGrads([v], [tf.eye(2)])])
    >>> g.weighted_sum(tf.constant([1.0, 2.0]))[0].numpy()
    array([1., 2.], dtype=float32)
    """

    def __init__(self, variables, parts, offsets=None, path=None, part_calls=None):
        self.variables = list(variables)
        self.parts = list(parts)
        self.offsets = offsets
        self.path = path
        # How the parts' methods run after the pass that made them: in the
        # scan `tfdp.models.state_writes.checked_per_example_pass` sets.
        self._part_calls = part_calls if part_calls is not None else PART_CALLS.get()
        self._running = False
        position = {id(v): i for i, v in enumerate(self.variables)}
        covered = [position.get(id(v)) for part in self.parts for v in part.variables]
        if sorted(c for c in covered if c is not None) != list(range(len(self.variables))) or (
            None in covered
        ):
            raise ValueError(
                "Per-example gradient parts must cover every trainable variable "
                "exactly once."
            )
        self._order = covered
        self._core = None

    def grouped(self, k):
        """The gradients of every k consecutive examples summed into one: a
        user's gradient from its k records (rows u k .. u k + k - 1).
        Offsets (weight decay in the loss) stay one per joined example.

        Example:

        >>> v = tf.Variable([0.0, 0.0])
        >>> g = PerExampleGradients([v], [MaterializedGrads([v], [tf.eye(2)])])
        >>> g.grouped(2).materialize()[0].numpy()
        array([[1., 1.]], dtype=float32)
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"Expected `k` to be an int >= 1. Received: k={k!r}")
        with self._running_parts():  # the new parts' `variables` are read in it too
            return PerExampleGradients(self.variables, [part.grouped(k) for part in self.parts],
                                       self.offsets, self.path, self._part_calls)

    def with_offsets(self, offsets):
        """Returns the same gradients with `offsets` added to every example's."""
        if self.offsets is not None:
            offsets = [a + b for a, b in zip(self.offsets, offsets)]
        with self._running_parts():  # the parts' `variables` are read again
            return PerExampleGradients(self.variables, self.parts, offsets, self.path,
                                       self._part_calls)

    @contextlib.contextmanager
    def _running_parts(self):
        """Runs the parts' methods in `_part_calls`' scan (one scan at a
        time: a method calling another runs in the first one's)."""
        if self._part_calls is None or self._running:
            yield
            return
        self._running = True
        try:
            with self._part_calls():
                yield
        finally:
            self._running = False

    def _arrange(self, per_part):
        # Tensors now, inside the parts' scan: a value a part hands back
        # could run its own code when it is converted later.
        flat = [tf.convert_to_tensor(t) for part_values in per_part for t in part_values]
        ordered = [None] * len(self.variables)
        for index, value in zip(self._order, flat):
            ordered[index] = value
        return ordered

    def _split(self, vectors):
        lookup = {id(v): t for v, t in zip(self.variables, vectors)}
        return [[lookup[id(v)] for v in part.variables] for part in self.parts]

    def norm_bounds(self):
        """float64 [B]: an upper bound of the L2 norm of what `weighted_sum`
        adds for each example per unit weight, whatever the example.

        Each part bounds its squared norm and the rounding of its sum; with
        offsets o, ||g + o||^2 = sum over parts of |g_p|^2 + 2 <g_p, o_p> +
        |o_p|^2 is bounded term by term (the dot products with their
        rounding), and the sum adds the rounding of assembling g and o
        separately (a few units of roundoff of |g| + |o|): a record whose
        gradient cancels the offsets is clipped by this bound, not by the
        rounding noise of the expansion. With offsets the bound is at least
        (|g| + |o|) / OFFSET_SPREAD, so that the sums of w g and of w o,
        added apart across examples, stay of the clipped contributions'
        size (see `OFFSET_SPREAD`).
        """
        return self._core_norm_bounds() * (1.0 + ABSORBED)

    def _core_norm_bounds(self):
        """`norm_bounds` without the margin that absorbs absolute errors
        (computed once: clipping and `weighted_sum` read the same values)."""
        if self._core is None:
            with self._running_parts():
                self._core = self._expanded_norm_bounds()
        return self._core

    def _expanded_norm_bounds(self):
        squares = [part.sq_norm_bounds() for part in self.parts]
        errors = [part.summation_errors() for part in self.parts]
        if self.offsets is None:
            return tf.sqrt(tf.add_n([tf.square(tf.sqrt(s) + e) for s, e in zip(squares, errors)]))
        expansion = []
        for part, square, offsets in zip(self.parts, squares, self._split(self.offsets)):
            dots = part.dots(offsets)
            expansion.append(square + 2.0 * (dots + part.dot_errors(offsets))
                             + tf.square(norm_of(offsets)))
        gradient = tf.sqrt(tf.add_n(squares))
        assembly = 3.0 * rounding.gamma(1) * (gradient + norm_of(self.offsets))
        summed = tf.sqrt(tf.add_n([tf.square(e) for e in errors]))
        combined = tf.sqrt(tf.maximum(tf.add_n(expansion), 0.0)) + summed + assembly
        # The weighted sum adds sum_i w_i g_i and (sum_i w_i) o apart: their
        # float32 rounding across examples grows with the separate sizes.
        separate = (gradient + summed + norm_of(self.offsets)) / OFFSET_SPREAD
        return tf.maximum(combined, separate)

    def absolute_errors(self):
        """float64 [B]: a bound on what `weighted_sum` adds for each example
        that does not shrink with its weight (flushed results), the parts'
        added; with offsets, the flushes of (sum of weights) * o too."""
        with self._running_parts():
            errors = tf.add_n([part.absolute_errors() for part in self.parts])
        if self.offsets is not None:
            entries = sum(int(o.shape.num_elements()) for o in self.offsets)
            errors += rounding.flushed_products(entries, 1.0, 0, 0)
        return errors

    def sq_norms(self):
        """float32 [B]: the squared `norm_bounds`, rounded up; clipping reads it."""
        return rounding.round_up_to_float32(tf.square(self.norm_bounds()))

    def dots(self, vectors):
        """Inner product of each example's gradient with `vectors`, [B]."""
        with self._running_parts():
            result = tf.add_n([part.dots(v) for part, v in zip(self.parts, self._split(vectors))])
        if self.offsets is not None:
            result += tf.add_n(
                [tf.reduce_sum(o * v) for o, v in zip(self.offsets, vectors)]
            )
        return result

    def weighted_sum(self, weights):
        """sum_i weights_i * g_i per variable; rows with weight 0 are skipped.

        Example i adds at most |weights_i| * norm_bounds()_i, whatever it
        holds: the weights are first reduced by the examples' absolute errors
        (`shrink_weights`), which changes none on ordinary data. Skipped rows
        are masked with `tf.where`, so a NaN gradient with weight 0 cannot
        poison the sum.
        """
        with self._running_parts():  # one scan for the bounds, the errors and the sums
            weights = shrink_weights(weights, self._core_norm_bounds(), self.absolute_errors())
            if self.offsets is None:
                return self._arrange([part.weighted_sum(weights) for part in self.parts])
            # sum_i w_i g_i and (sum_i w_i) o are added apart, and each can be far
            # larger than their sum: accumulated in float64, their rounding across
            # examples stays far below the clipped contributions whatever the batch.
            sums = self._arrange([part.weighted_sum(weights, tf.float64) for part in self.parts])
        total = tf.reduce_sum(tf.cast(weights, tf.float64))
        return [tf.cast(s + total * tf.cast(o, tf.float64), o.dtype)
                for s, o in zip(sums, self.offsets)]

    def materialize(self):
        """Per-example gradients [B, *shape], one tensor a variable."""
        with self._running_parts():
            grads = self._arrange([part.materialize() for part in self.parts])
        if self.offsets is not None:
            grads = [g + o[None] for g, o in zip(grads, self.offsets)]
        return grads
