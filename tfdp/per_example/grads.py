"""Per-example gradients held in the cheapest exact form a layer allows.

DP needs each example's gradient norm and a reweighted sum over examples,
rarely the gradients themselves. Every layer rule returns "parts", each
covering some variables, with one interface:

* `sq_norms()`: [B] squared L2 norm of each example's gradient on the part;
* `dots(vectors)`: [B] inner product of each example's gradient with
  `vectors` (aligned with the part's variables);
* `weighted_sum(weights)`: sum_i weights_i g_i per variable (rows with weight 0
  are skipped, so a NaN row cannot poison the sum);
* `materialize()`: [B, *shape] per variable (memory: batch x parameters).

Under mixed precision (layers computing in bfloat16 or float16, weights in
float32) every part casts its inputs to float32 first (`as_float32`), so
norms and the clipped sum come from the same float32 values: the clipping
bound holds to float32 tolerance whatever the layers computed in.

`LinearGrads` holds a linear map's gradient factored (X_i^T G_i),
`MaterializedGrads` holds gradients in full. `PerExampleGradients` joins the
parts of a whole model.

Example:

>>> import tensorflow as tf
>>> v = tf.Variable(tf.zeros([2, 1]))
>>> x = tf.constant([[[1.0, 0.0]], [[0.0, 2.0]]])   # [B=2, S=1, K=2]
>>> g = tf.constant([[[3.0]], [[1.0]]])             # [B=2, S=1, O=1]
>>> LinearGrads(x, g, v).sq_norms().numpy()
array([9., 4.], dtype=float32)
"""

import tensorflow as tf


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


def scaled_to_unit_max(tensor):
    """(tensor / s, s), s [B] the largest |entry| of each example (an
    all-zero example is divided by 1 and keeps s = 0).

    Factored norms multiply a term in |x|^2 by one in |g|^2: scaling each
    example to max 1 first keeps a huge input on a saturated unit (zero output
    gradient) finite instead of inf * 0.
    """
    axes = list(range(1, tensor.shape.rank))
    scale = tf.reduce_max(tf.abs(tensor), axis=axes)
    safe = tf.where(scale > 0, scale, tf.ones_like(scale))
    return tensor / tf.reshape(safe, [-1] + [1] * len(axes)), scale


class LinearGrads:
    """Per-example gradients of a map Z = X M (+ b) applied at S positions.

    Example i's matrix gradient is X_i^T G_i summed over positions (sequence
    steps, conv output pixels whose input patches form X, time steps of a
    recurrence); its bias gradient is the sum of G_i over positions.

    Args:
        x: float tensor [B, S, K], the inputs at each position.
        g: float tensor [B, S, O], gradients of the loss at the outputs.
        kernel: the variable holding M (K * O elements).
        bias: the bias variable ([O] elements), or None.
        kernel_perm: optional permutation. When given, M is the kernel
            transposed by `kernel_perm` and then reshaped to [K, O] (an
            EinsumDense kernel whose contracted axes are not all first).
    """

    def __init__(self, x, g, kernel, bias=None, kernel_perm=None):
        self.x = as_float32(x)
        self.g = as_float32(g)
        self.variables = [kernel] + ([bias] if bias is not None else [])
        self._kernel_shape = kernel.shape
        self._perm = kernel_perm
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
        self._materialized = None

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
        if self._materialized is None:
            self._materialized = tf.einsum("bsk,bso->bko", self.x, self.g)
        return self._materialized

    def sq_norms(self):
        if self.x.shape[1] == 1 or self._ghost:
            x, x_scale = scaled_to_unit_max(self.x)
            g, g_scale = scaled_to_unit_max(self.g)
            if self.x.shape[1] == 1:
                kernel = tf.reduce_sum(tf.square(x), [1, 2]) * tf.reduce_sum(tf.square(g), [1, 2])
            else:
                x_gram = tf.matmul(x, x, transpose_b=True)
                g_gram = tf.matmul(g, g, transpose_b=True)
                kernel = tf.reduce_sum(x_gram * g_gram, [1, 2])
            kernel *= tf.square(x_scale * g_scale)
        else:
            kernel = tf.reduce_sum(tf.square(self._per_example_matrix()), [1, 2])
        if len(self.variables) == 1:
            return kernel
        return kernel + tf.reduce_sum(tf.square(tf.reduce_sum(self.g, 1)), 1)

    def dots(self, vectors):
        matrix = self._from_kernel(vectors[0])
        # Two-operand contractions: a three-operand tf.einsum can be far slower.
        result = tf.reduce_sum(tf.einsum("bsk,ko->bso", self.x, matrix) * self.g, [1, 2])
        if len(self.variables) == 2:
            result += tf.linalg.matvec(tf.reduce_sum(self.g, 1), tf.reshape(vectors[1], [-1]))
        return result

    def weighted_sum(self, weights):
        keep = tf.not_equal(weights, 0.0)
        g = masked(self.g, keep)
        if self._materialized is not None:
            matrix = tf.tensordot(weights, masked(self._materialized, keep), axes=1)
        else:
            x = masked(self.x, keep)
            # Weight G, then one matmul over (example, position) rows: measured
            # 60x faster than tf.einsum("b,bsk,bso->ko") for a 784x256 Dense
            # layer at batch 2048 on 2 CPU cores.
            matrix = tf.matmul(
                tf.reshape(x, [-1, self.x.shape[2]]),
                tf.reshape(g * weights[:, None, None], [-1, self.g.shape[2]]),
                transpose_a=True,
            )
        sums = [self._to_kernel(matrix, tf.constant([], tf.int32))]
        if len(self.variables) == 2:
            bias = tf.linalg.matvec(tf.reduce_sum(g, 1), weights, transpose_a=True)
            sums.append(tf.reshape(bias, self.variables[1].shape))
        return sums

    def materialize(self):
        batch = tf.shape(self.x)[0:1]
        grads = [self._to_kernel(self._per_example_matrix(), batch)]
        if len(self.variables) == 2:
            bias = tf.reduce_sum(self.g, 1)
            grads.append(tf.reshape(bias, tf.concat([batch, self.variables[1].shape], 0)))
        return grads


class MaterializedGrads:
    """Per-example gradients held in full, one [B, *shape] tensor a variable.

    Args:
        variables: list of variables.
        grads: list of tensors [B, *variable.shape], aligned with variables.
    """

    def __init__(self, variables, grads):
        self.variables = list(variables)
        self.grads = [as_float32(g) for g in grads]

    @staticmethod
    def _flat(tensor):
        return tf.reshape(tensor, [tf.shape(tensor)[0], -1])

    def sq_norms(self):
        return tf.add_n([tf.reduce_sum(tf.square(self._flat(g)), 1) for g in self.grads])

    def dots(self, vectors):
        return tf.add_n(
            [
                tf.linalg.matvec(self._flat(g), tf.reshape(v, [-1]))
                for g, v in zip(self.grads, vectors)
            ]
        )

    def weighted_sum(self, weights):
        keep = tf.not_equal(weights, 0.0)
        return [tf.tensordot(weights, masked(g, keep), axes=1) for g in self.grads]

    def materialize(self):
        return list(self.grads)


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

    Example:

    >>> v = tf.Variable([0.0, 0.0])
    >>> g = PerExampleGradients([v], [MaterializedGrads([v], [tf.eye(2)])])
    >>> g.weighted_sum(tf.constant([1.0, 2.0]))[0].numpy()
    array([1., 2.], dtype=float32)
    """

    def __init__(self, variables, parts, offsets=None, path=None):
        self.variables = list(variables)
        self.parts = list(parts)
        self.offsets = offsets
        self.path = path
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

    def with_offsets(self, offsets):
        """Returns the same gradients with `offsets` added to every example's."""
        if self.offsets is not None:
            offsets = [a + b for a, b in zip(self.offsets, offsets)]
        return PerExampleGradients(self.variables, self.parts, offsets, self.path)

    def _arrange(self, per_part):
        flat = [t for part_values in per_part for t in part_values]
        ordered = [None] * len(self.variables)
        for index, value in zip(self._order, flat):
            ordered[index] = value
        return ordered

    def _split(self, vectors):
        lookup = {id(v): t for v, t in zip(self.variables, vectors)}
        return [[lookup[id(v)] for v in part.variables] for part in self.parts]

    def sq_norms(self):
        """Squared L2 norm of each example's whole gradient, shape [B]."""
        norms = tf.add_n([part.sq_norms() for part in self.parts])
        if self.offsets is None:
            return norms
        offset_sq = tf.add_n([tf.reduce_sum(tf.square(o)) for o in self.offsets])
        return norms + 2.0 * self._raw_dots(self.offsets) + offset_sq

    def _raw_dots(self, vectors):
        return tf.add_n(
            [part.dots(v) for part, v in zip(self.parts, self._split(vectors))]
        )

    def dots(self, vectors):
        """Inner product of each example's gradient with `vectors`, [B]."""
        result = self._raw_dots(vectors)
        if self.offsets is not None:
            result += tf.add_n(
                [tf.reduce_sum(o * v) for o, v in zip(self.offsets, vectors)]
            )
        return result

    def weighted_sum(self, weights):
        """sum_i weights_i * g_i per variable; rows with weight 0 are skipped.

        Skipped rows are masked with `tf.where`, so a NaN gradient with weight
        0 cannot poison the sum.
        """
        sums = self._arrange([part.weighted_sum(weights) for part in self.parts])
        if self.offsets is not None:
            total = tf.reduce_sum(weights)
            sums = [s + total * o for s, o in zip(sums, self.offsets)]
        return sums

    def materialize(self):
        """Per-example gradients [B, *shape], one tensor a variable."""
        grads = self._arrange([part.materialize() for part in self.parts])
        if self.offsets is not None:
            grads = [g + o[None] for g, o in zip(grads, self.offsets)]
        return grads
