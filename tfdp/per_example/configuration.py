"""Whether an allow-listed layer's CONFIGURATION keeps examples independent.

The allow-list (`tfdp.per_example.registry`) names layer classes whose call
keeps examples independent for the configurations Keras users normally pass.
Two kinds of argument can break that claim:

- an activation: `Activation(fn)`, `Dense(..., activation=fn)`, a recurrent
  layer's `activation` / `recurrent_activation`. Rules apply it to the whole
  batch, so a callable such as `lambda t: t / ops.max(ops.abs(t))` mixes
  examples. Only activations identified as Keras built-ins (by their
  registered name) or declared with `declare_per_example_activation` pass.
- an EinsumDense equation whose output drops or moves the batch axis
  (`"ab,bc->bc"` sums over the batch).
- a built-in activation that is not elementwise ("softmax", "log_softmax",
  "sparsemax", "glu": they normalize or split the last axis) on a rank-1
  input, where that axis is the batch.
- an `Attention` or `AdditiveAttention` with a rank-2 query, value or key:
  its scores span the batch ([B, B], or [B, 1, B] for a rank-3 query over
  rank-2 values), every example attending over the others.
- an axis: `Softmax(axis=0)`, `UnitNormalization(axis=0)`,
  `LayerNormalization(axis=0)`, `Concatenate(axis=0)`, `Dot(axes=0)`... reduce
  or join over the batch axis (0, or -rank).

A layer that fails either check is treated like a `Lambda`: the model takes
the exact whole-model vectorized path (or "batched" refuses), with a log
line naming the layer and why.

Example:

>>> import keras
>>> configuration_problem(keras.layers.Softmax(axis=0), rank=2)
'reduces over the batch axis (axis=0)'
>>> configuration_problem(keras.layers.Dense(3, activation="gelu"), rank=2) is None
True
"""

import keras

_ACTIVATION_ATTRIBUTES = ("activation", "recurrent_activation")
_AXIS_ATTRIBUTES = ("axis", "axes", "attention_axes")
# Layers whose `axis` names the features a fixed (adapted, not batch)
# statistic is kept for: no reduction runs over it in the call.
_STATISTIC_AXIS_LAYERS = (keras.layers.Normalization,)

_DECLARED_ACTIVATIONS = set()

# Built-in activations that act on each entry alone. Any other built-in
# (softmax, log_softmax, sparsemax normalize the last axis, glu splits it)
# mixes the entries of that axis: on a rank-1 tensor, one scalar an example,
# the batch.
_ELEMENTWISE_ACTIVATIONS = frozenset({
    "celu", "elu", "exponential", "gelu", "hard_shrink", "hard_sigmoid", "hard_silu",
    "hard_swish", "hard_tanh", "leaky_relu", "linear", "log_sigmoid", "mish", "relu",
    "relu6", "selu", "sigmoid", "silu", "soft_shrink", "softplus", "softsign",
    "sparse_plus", "sparse_sigmoid", "squareplus", "swish", "tanh", "tanh_shrink",
    "threshold",
})

# Attention layers whose scores contract the query's and key's features: on
# rank-2 inputs [B, D] the scores are [B, B].
_SEQUENCE_ATTENTION = (keras.layers.Attention, keras.layers.AdditiveAttention)


def declare_per_example_activation(fn):
    """Declares that the activation function `fn` is elementwise.

    Layers with this activation keep the fast batched path. Declare only a
    function whose output for one example depends on that example alone.

    Example:

    >>> import keras
    >>> def gelu_tanh(x):
    ...     return keras.activations.gelu(x, approximate=True)
    >>> _ = declare_per_example_activation(gelu_tanh)
    >>> configuration_problem(keras.layers.Dense(2, activation=gelu_tanh), rank=2) is None
    True

    Returns:
        `fn`, unchanged.
    """
    if not callable(fn):
        raise TypeError(f"Expected a callable activation. Received: fn={fn!r}")
    _DECLARED_ACTIVATIONS.add(fn)
    return fn


def is_builtin_activation(fn):
    """True when `fn` is the Keras activation registered under its own name."""
    if fn is None or fn in _DECLARED_ACTIVATIONS:
        return True
    try:
        name = keras.activations.serialize(fn)
        return isinstance(name, str) and keras.activations.get(name) is fn
    except (ValueError, TypeError, AttributeError, OSError):
        return False


def _activation_name(fn):
    """The registered name of a built-in activation (else None)."""
    try:
        name = keras.activations.serialize(fn) if callable(fn) else None
    except (ValueError, TypeError, AttributeError, OSError):
        return None
    return name if isinstance(name, str) else None


def _axes(value):
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(a for item in value for a in _axes(item))
    return (value,)


def _touches_batch(axis, rank):
    if not isinstance(axis, int):
        return True  # not an integer axis: cannot be shown to spare the batch
    if axis == 0:
        return True
    if axis < 0 and rank is None:
        # A sublayer called inside another layer's call records no input
        # shape. -1 is the batch axis only of a rank-1 input (a batch of
        # scalars), which no allow-listed layer's call feeds to its
        # softmax or normalization; other negative axes are refused.
        return axis != -1
    if axis < 0:
        return axis % rank == 0
    return False


def _keeps_batch_letter(equation):
    inputs, output = equation.replace(" ", "").split("->")
    first = inputs.split(",")[0]
    if first.startswith("..."):
        return output.startswith("...")
    return bool(first) and output[:1] == first[:1]


def layer_input_ranks(layer):
    """The ranks of all the layer's inputs, from its build shapes and its
    calls in a graph (an empty list when none is recorded)."""
    ranks = []

    def collect(shape):
        if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple)):
            for inner in shape:
                collect(inner)
        elif isinstance(shape, (list, tuple)):
            ranks.append(len(shape))

    for shape in (getattr(layer, "_build_shapes_dict", None) or {}).values():
        collect(shape)
    for node in getattr(layer, "_inbound_nodes", None) or []:
        ranks += [len(tensor.shape) for tensor in node.arguments.keras_tensors]
    return ranks


def layer_input_rank(layer):
    """The rank of the layer's first input, from its build shapes (or None)."""
    shapes = list((getattr(layer, "_build_shapes_dict", None) or {}).values())
    for node in getattr(layer, "_inbound_nodes", None) or []:
        shapes += [tensor.shape for tensor in node.arguments.keras_tensors[:1]]
    for shape in shapes:
        if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple)):
            shape = shape[0]
        if isinstance(shape, (list, tuple)):
            return len(shape)
    return None


def configuration_problem(layer, rank=None, ranks=None):
    """Why `layer`'s configuration may mix examples, or None when it does not.

    Args:
        layer: a Keras layer whose class is allow-listed.
        rank: rank of the layer's input, batch axis included; read from the
            layer's build shapes when None.
        ranks: ranks of all its tensor inputs (an attention's query, value
            and key); read from its build shapes when None.
    """
    for attribute in _ACTIVATION_ATTRIBUTES:
        fn = getattr(layer, attribute, None)
        if callable(fn) and not is_builtin_activation(fn):
            name = getattr(fn, "__name__", type(fn).__name__)
            return (
                f"has {attribute}={name}, which is not a Keras built-in activation "
                "(declare it with tfdp.per_example.declare_per_example_activation "
                "if it is elementwise)"
            )
    rank = layer_input_rank(layer) if rank is None else rank
    for attribute in _ACTIVATION_ATTRIBUTES:
        fn = getattr(layer, attribute, None)
        name = _activation_name(fn)
        if (rank == 1 and name is not None and name not in _ELEMENTWISE_ACTIVATIONS
                and fn not in _DECLARED_ACTIVATIONS):
            return f"applies {attribute}={name!r} over the batch axis of a rank-1 input"
    if isinstance(layer, _SEQUENCE_ATTENTION):
        low = [r for r in (layer_input_ranks(layer) if ranks is None else ranks)
               if r is not None and r < 3]
        if low:
            return (f"attends over the batch axis (a rank-{low[0]} query, value or key: "
                    "each example's scores span the batch)")
    equation = getattr(layer, "equation", None)
    if isinstance(layer, keras.layers.EinsumDense) and not _keeps_batch_letter(equation):
        return f"does not keep the batch axis first (equation={equation!r})"
    if isinstance(layer, _STATISTIC_AXIS_LAYERS):
        return None
    for attribute in _AXIS_ATTRIBUTES:
        value = getattr(layer, attribute, None)
        for axis in _axes(value):
            if _touches_batch(axis, rank):
                return f"reduces over the batch axis ({attribute}={value!r})"
    return None
