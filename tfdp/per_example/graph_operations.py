"""Which weightless Keras operations in a Functional graph keep examples
independent.

A Functional graph holds Keras operations as nodes besides its layers
(`x + y`, `keras.ops.softmax(x)`, `x[:, 0]`). Every tensor of a graph the
batched pass runs has the batch on axis 0 (its inputs have, and each node
allowed here keeps it there), so a node keeps examples independent when it
computes entry by entry, or works along axes other than 0 and keeps axis 0
where it was:

- dtype conversions (ConvertToTensor without a `sparse` or `ragged`
  request: densifying a ragged tensor pads every row to the batch's
  longest);
- elementwise operations (`ELEMENTWISE`) whose tensors all have one rank
  (constants may have fewer axes): numpy broadcasting lines axes up from
  the right, so a tensor of lower rank would put its batch axis against
  another axis of the others ([B, T, D] + [B, 1] adds example t's value
  to every example's position t when B == T);
- operations along named axes (a softmax, a concatenation, a reduction, a
  sort) whose every axis is another than 0 at the input's rank; an axis of
  None (all axes, or a flattened tensor) is refused;
- operations that insert an axis (expand_dims, stack, one_hot) at another
  position than 0 of their output;
- squeeze of named axes other than 0; transposes that leave axis 0 first;
  swapaxes and moveaxis away from axis 0;
- matmul of two tensors of the same rank, 3 or more (a batch of matrix
  products: a rank-2 operand's rows would be the batch, contracted over),
  or of a tensor by a constant matrix;
- reshape to (-1, ...) where the other sizes hold exactly one example's
  entries; pad with nothing added on axis 0; tile with axis 0 repeated once;
- `x[:, ...]` and `x[..., i]` with integers and slices that leave axis 0
  alone.

No constant argument or attribute may line up with the batch axis of the
operation's inputs or outputs (a constant of their rank whose first axis
is longer than 1 gives each example a value by its position in the batch,
which an added record shifts); a layer may be called with no constant
whose first axis is longer than 1 (`layer_constants_position_free`). Only
Keras's
own operation classes are read by name. Anything else (einsum, tensordot,
take with a tensor of indices, a user's operation, an unknown one) sends
the model to the vectorized path, named.

Example:

>>> import keras
>>> x = keras.Input((4, 3))
>>> model = keras.Model(x, keras.ops.softmax(x, axis=-1))
>>> operation_keeps_examples(model._operations[-1], [x])
True
>>> model = keras.Model(x, keras.ops.softmax(x, axis=0))
>>> operation_keeps_examples(model._operations[-1], [x])
False
"""

import math

import keras
import numpy as np

# Entry by entry: each output entry reads the entries at its own position.
ELEMENTWISE = frozenset({
    "Add", "Subtract", "Multiply", "Divide", "TrueDivide", "FloorDivide", "Mod", "Negative",
    "Absolute", "Sign", "Square", "Sqrt", "Rsqrt", "Reciprocal", "Exp", "Expm1", "Log",
    "Log1p", "Sin", "Cos", "Tan", "Arctan", "Sinh", "Tanh", "Erf", "Floor", "Ceil", "Round",
    "Clip", "NanToNum", "Sigmoid", "HardSigmoid", "LogSigmoid", "Softsign", "Relu", "Relu6",
    "LeakyRelu", "Gelu", "Silu", "HardSilu", "Elu", "Selu", "Softplus", "Maximum", "Minimum",
    "Power", "Cast", "Isnan", "Isfinite",
    "Equal", "NotEqual", "Greater", "GreaterEqual", "Less", "LessEqual",
    "LogicalAnd", "LogicalOr", "LogicalNot", "LogicalXor", "Where",
})

# Along the axes in their `axis` attribute; each output position reads one
# line (or block) of the input along those axes.
ALONG_AXES = frozenset({
    "Mean", "Sum", "Max", "Min", "Any", "All", "Prod", "Std", "Var", "Norm", "Logsumexp",
    "Softmax", "LogSoftmax", "Argmax", "Argmin", "Sort", "Argsort", "Cumsum", "Cumprod",
    "Flip", "Repeat", "Concatenate",
})

# Insert one axis at `axis` of the output.
INSERT_AXIS = frozenset({"ExpandDims", "Stack", "OneHot"})


def _rank(tensor):
    shape = getattr(tensor, "shape", None)
    return None if shape is None else len(shape)


def _axes(axis):
    """`axis` as a tuple of Python ints, or None (None, or not ints)."""
    if axis is None:
        return None
    axes = tuple(axis) if isinstance(axis, (list, tuple)) else (axis,)
    if not axes or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
        return None
    return axes


def _off_batch(axes, rank):
    """True if every axis of `axes` is a valid axis other than 0 at `rank`."""
    return (axes is not None and rank is not None and rank > 0
            and all(-rank <= a < rank and a % rank != 0 for a in axes))


def _first_rank(arguments):
    """The rank of the first tensor argument (the first of a list)."""
    first = arguments[0] if arguments else None
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    return _rank(first)


def _leaves_batch_alone(key, rank):
    """`x[key]` keeps axis 0 as is: `x[:, ...]`, or `x[..., k1, ..., kn]`
    with integers, slices and new axes (None) on trailing axes only (fewer
    integers and slices than `rank`)."""
    key = key if isinstance(key, tuple) else (key,)
    if not key:
        return False
    if isinstance(key[0], slice) and key[0] == slice(None):
        return True
    rest = key[1:]
    axes = [k for k in rest if k is not None]
    return (key[0] is Ellipsis and rank is not None and len(axes) < rank
            and all(isinstance(k, slice) and all(b is None or isinstance(b, int)
                                                 for b in (k.start, k.stop, k.step))
                    or isinstance(k, int) and not isinstance(k, bool) for k in axes))


def _reshape_keeps_batch(newshape, rank_shape):
    """(-1, d1, ..., dn) where d1 ... dn hold exactly one example's entries."""
    if not isinstance(newshape, (list, tuple)) or not newshape or newshape[0] != -1:
        return False
    rest = newshape[1:]
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0
               for d in rest):
        return False
    example = rank_shape[1:] if rank_shape is not None else None
    if example is None or any(d is None for d in example):
        return False
    return math.prod(rest) == math.prod(example)


def _array_like(value):
    """True for a non-empty nest of lists and tuples whose leaves are all
    numbers or arrays (NumPy's, tensors, variables), no graph tensor among
    them: TensorFlow stacks it into one array, so it is one constant."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_array_like(item) for item in value)
    if isinstance(value, keras.KerasTensor):
        return False
    return (isinstance(value, (int, float, bool, np.number, np.bool_)) or hasattr(value, "shape")
            or hasattr(value, "__array__"))


def _constant_leaves(value):
    """Graph tensors and constants in `value`. A nest of numbers and arrays
    is read as one constant (the array TensorFlow stacks from it: four
    [4, 3] arrays in a list are one [4, 4, 3] constant) and as each of its
    parts (a layer may read the outer list as a structure: a list of
    recurrent states, each a list of rows)."""
    if isinstance(value, keras.KerasTensor) or hasattr(value, "shape"):
        return [value]
    if hasattr(value, "__array__"):  # converts to an array (TensorFlow converts it so)
        try:
            return [np.asarray(value)]
        except (ValueError, TypeError):
            return []
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _constant_leaves(item)]
    if isinstance(value, (list, tuple)):
        parts = [leaf for item in value for leaf in _constant_leaves(item)]
        if _array_like(value):
            try:
                return [np.asarray(value)] + parts
            except (ValueError, TypeError):  # arrays of unequal shapes: TensorFlow refuses them
                pass
        return parts
    return []


def _leaves(arguments, keywords):
    return _constant_leaves([list(arguments), dict(keywords or {})])


# Operation attributes that describe axes and shapes; every other attribute
# (nan_to_num's replacements, clip's bounds, elu's alpha) is a value combined
# with the input, whatever its type.
_STRUCTURAL_ATTRIBUTES = frozenset({
    "name", "axis", "axes", "axis1", "axis2", "source", "destination", "newshape",
    "pad_width", "repeats", "num_classes", "decimals", "keepdims", "ord", "mode", "dtype",
    "sparse", "ragged", "subscripts",
})


def _position_free(leaves, rank):
    """Every constant (an argument that is not a graph tensor) has fewer
    axes than `rank`, or as many with a first axis of 1: none lines up
    with the batch axis, where its rows would give each example a value
    by its position in the batch (which an added record shifts)."""
    for leaf in leaves:
        if isinstance(leaf, keras.KerasTensor) or not hasattr(leaf, "shape"):
            continue
        shape = np.shape(leaf)
        if rank is None or len(shape) > rank or shape and len(shape) == rank and shape[0] != 1:
            return False
    return True


def _aligned(arguments, keywords):
    """Every graph tensor argument has the same rank and every constant is
    `_position_free`: broadcasting keeps axis 0 the batch's."""
    leaves = _leaves(arguments, keywords)
    ranks = {len(leaf.shape) for leaf in leaves if isinstance(leaf, keras.KerasTensor)}
    return len(ranks) == 1 and _position_free(leaves, ranks.pop())


def _tensor_ranks(values):
    return [len(leaf.shape) for leaf in _constant_leaves(values)
            if isinstance(leaf, keras.KerasTensor)]


def constants_position_free(arguments, keywords, outputs=()):
    """A graph operation's constant arguments are `_position_free` against
    the lowest rank among its tensors, inputs and `outputs`: none lines up
    with the batch axis of any of them (a reduction's `initial` of shape
    [B, D] broadcasts against its [B, D] output, not its [B, T, D] input).

    Example:

    >>> x = keras.Input((4, 3))
    >>> constants_position_free([x, np.ones((1, 4, 3))], {})
    True
    >>> constants_position_free([x, np.ones((4, 4, 3))], {})
    False
    """
    ranks = _tensor_ranks([list(arguments), dict(keywords or {}), list(outputs)])
    return _position_free(_leaves(arguments, keywords), min(ranks) if ranks else None)


def layer_constants_position_free(arguments, keywords):
    """No constant a layer is called with (an array, not a graph tensor;
    scalars aside) has a first axis longer than 1, or more axes than the
    call's tensors. A layer reads its arguments by their meaning, not by
    numpy broadcasting: a mask, an initial state or KerasHub's `positions`
    and `padding_mask` lead with the batch at any rank ([B, T] beside a
    [B, T, D] input), so a constant one would give each example a row by
    its position in the batch, which an added record shifts.

    Example:

    >>> x = keras.Input((4, 3))
    >>> layer_constants_position_free([x], {"mask": np.ones((1, 4), bool)})
    True
    >>> layer_constants_position_free([x], {"positions": np.ones((4, 4), "int32")})
    False
    """
    ranks = _tensor_ranks([list(arguments), dict(keywords or {})])
    highest = max(ranks) if ranks else None
    for leaf in _leaves(arguments, keywords):
        if isinstance(leaf, keras.KerasTensor) or not hasattr(leaf, "shape"):
            continue
        shape = np.shape(leaf)
        if shape and (shape[0] != 1 or highest is None or len(shape) > highest):
            return False
    return True


def _keras_operation(operation):
    """True for an operation class of Keras's own (a user's class of the
    same name is not the operation named here)."""
    return type(operation).__module__.startswith("keras.src.ops.")


def operation_keeps_examples(operation, arguments, keywords=None, outputs=None):
    """True if a weightless Keras `operation`, a Functional graph node
    called on positional `arguments` and keyword arguments `keywords`
    (tensors that lead with the batch), keeps examples independent and the
    batch on axis 0 (see the module).

    Args:
        operation: the node's Keras operation.
        arguments: the node's positional arguments (`node.arguments.args`).
        keywords: its keyword arguments (`node.arguments.kwargs`).
        outputs: its output tensors (`node.outputs`); computed from the
            arguments when None.
    """
    if not _keras_operation(operation):
        return False
    name = type(operation).__name__
    # Constants in the arguments, and those the operation holds (every
    # attribute but its axes and shapes: nan_to_num's replacements, clip's
    # bounds, elu's alpha).
    held = [value for key, value in vars(operation).items()
            if not key.startswith("_") and key not in _STRUCTURAL_ATTRIBUTES]
    if outputs is None:
        try:
            outputs = operation.compute_output_spec(*arguments, **(keywords or {}))
        except Exception:  # noqa: BLE001 - arguments the operation cannot take
            return False
    if not constants_position_free(list(arguments) + held, keywords, [outputs]):
        return False
    rank = _first_rank(arguments)
    if name == "ConvertToTensor":
        # A dtype conversion, entry by entry (Keras adds one where a layer
        # converts a mask it was handed: pooling after a masked Attention).
        # Densifying a ragged or sparse tensor (ragged or sparse False; the
        # symbolic tensor may not say it is ragged) pads every row to the
        # batch's longest, so one record's length moves the others'.
        return (getattr(operation, "sparse", None) is None
                and getattr(operation, "ragged", None) is None
                and _aligned(arguments, keywords))
    if name in ELEMENTWISE:
        if name == "Where" and (len(arguments) < 3 or arguments[1] is None
                                or arguments[2] is None):
            return False  # where(condition) alone: the coordinates of its True entries
        return _aligned(arguments, keywords)
    if name in ALONG_AXES:
        return _off_batch(_axes(getattr(operation, "axis", None)), rank)
    if name in INSERT_AXIS:
        axes = _axes(getattr(operation, "axis", None))
        return rank is not None and _off_batch(axes, rank + len(axes or ()))
    if name == "Squeeze":
        return _off_batch(_axes(getattr(operation, "axis", None)), rank)
    if name == "Transpose":
        axes = _axes(getattr(operation, "axes", None))
        return axes is not None and rank == len(axes) and axes[0] % rank == 0
    if name == "Swapaxes":
        return _off_batch(_axes([operation.axis1, operation.axis2]), rank)
    if name == "Moveaxis":
        return (_off_batch(_axes(operation.source), rank)
                and _off_batch(_axes(operation.destination), rank))
    if name == "Matmul":
        if (len(arguments) != 2 or not isinstance(arguments[0], keras.KerasTensor)
                or rank is None or rank < 2):
            return False
        other = arguments[1]
        if isinstance(other, keras.KerasTensor):  # a batch of matrix products
            return _rank(other) == rank and rank >= 3
        return np.ndim(other) >= 2  # a fixed matrix on each example's rows
    if name == "Reshape":
        shape = getattr(arguments[0], "shape", None) if arguments else None
        return _reshape_keeps_batch(getattr(operation, "newshape", None), shape)
    if name == "Pad":
        width = getattr(operation, "pad_width", None)
        return (isinstance(width, (list, tuple)) and rank is not None and len(width) == rank
                and tuple(width[0]) == (0, 0))
    if name == "Tile":
        repeats = _axes(getattr(operation, "repeats", None))
        return (repeats is not None and rank is not None
                and (len(repeats) < rank or len(repeats) == rank and repeats[0] == 1))
    if name == "GetItem":
        return len(arguments) > 1 and _leaves_batch_alone(arguments[1], rank)
    return False
