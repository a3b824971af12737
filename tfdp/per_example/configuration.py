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
- an attention whose inputs or masks put the batch among its attended
  axes: an `Attention` or `AdditiveAttention` with a query, value or key of
  rank 2 or of unequal ranks ([B, B] scores), a `MultiHeadAttention` mask of
  too low a rank (`attention_call_problem`).
- an elementwise merge (`Add`, `Subtract`, `Multiply`, `Average`,
  `Maximum`, `Minimum`) of inputs of unequal ranks: Keras broadcasts them
  from the right, so the lower-rank input's batch axis meets another axis
  of the others ([B, T, D] + [B, 1] adds example t's value to every
  example's position t when B == T; `merge_call_problem`).
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

import inspect

import keras
import numpy as np

_ACTIVATION_ATTRIBUTES = ("activation", "recurrent_activation")
_AXIS_ATTRIBUTES = ("axis", "axes", "attention_axes")
# Layers whose `axis` names the features a fixed (adapted, not batch)
# statistic is kept for: no reduction runs over it in the call, but on the
# batch axis it would give each example the statistic of its position in
# the batch, which an added record shifts.
_STATISTIC_AXIS_LAYERS = (keras.layers.Normalization,)

_DECLARED_ACTIVATIONS = set()

# Merge layers that combine their inputs entry by entry, broadcasting them.
_ELEMENTWISE_MERGES = (keras.layers.Add, keras.layers.Subtract, keras.layers.Multiply,
                       keras.layers.Average, keras.layers.Maximum, keras.layers.Minimum)

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
# Every attention layer whose inputs and masks `attention_call_problem` reads.
_ATTENTION = _SEQUENCE_ATTENTION + tuple(
    getattr(keras.layers, name) for name in ("MultiHeadAttention", "GroupQueryAttention")
    if hasattr(keras.layers, name))


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


def _recorded_calls(layer):
    """(args, kwargs) of the layer's recorded calls: its graph nodes, and
    its build shapes as one call (a held layer records no node)."""
    calls = [(node.arguments.args, node.arguments.kwargs)
             for node in getattr(layer, "_inbound_nodes", None) or []]
    for shape in (getattr(layer, "_build_shapes_dict", None) or {}).values():
        if _is_shape(shape):
            calls.append(([keras.KerasTensor(shape)], {}))
        elif isinstance(shape, (list, tuple)) and shape and all(map(_is_shape, shape)):
            calls.append(([[keras.KerasTensor(inner) for inner in shape]], {}))
    return calls


def _is_shape(value):
    """True for a shape: a list or tuple of lengths (ints or None)."""
    return isinstance(value, (list, tuple)) and all(
        d is None or isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in value)


def first_axis_could_be_batch(length, batch_size=None):
    """Whether a first axis of static `length` (None: unknown) of a tensor a
    layer receives when the step is traced can be the batch, whose static
    size is `batch_size` (None: unknown, a step without a fixed batch).

    Example:

    >>> first_axis_could_be_batch(None), first_axis_could_be_batch(3)
    (True, False)
    >>> first_axis_could_be_batch(8, batch_size=8)
    True
    """
    if length is None:
        return True
    return batch_size is not None and length == batch_size


def _rank(tensor):
    shape = getattr(tensor, "shape", None)
    return None if shape is None or not hasattr(tensor, "dtype") else len(shape)


def _leading(tensor):
    return tensor.shape[0] if _rank(tensor) else None


def _keras_mask(tensor):
    """The mask Keras attached to `tensor` (it passes it on to a layer's
    mask arguments left empty), or None."""
    return getattr(tensor, "_keras_mask", None) if tensor is not None else None


def attention_call_problem(layer, args, kwargs, could_be_batch=None):
    """Why one call of an attention layer mixes examples, or None.

    Attention and AdditiveAttention contract the last two axes of their
    query and key, lining up the axes before them from the right: inputs of
    rank 2, or of unequal ranks, put the batch among the attended axes
    ([B, B] scores). MultiHeadAttention and GroupQueryAttention pad a mask
    of too low a rank with axes in front, where its batch axis then meets
    the scores' query or key axes: a batch-led attention mask needs rank
    2 n + 1 (batch, then n query and n key axes), a query, value or key
    mask the rank of its input less one, and with n > 1 attention axes no
    batch-led query, value or key mask keeps its batch aligned.

    A mask not passed is read where Keras reads it: the `_keras_mask` its
    input carries (an `Embedding(mask_zero=True)` or a `Masking` before it);
    MultiHeadAttention reads its query's own mask even when a query mask is
    passed, so both are read.

    Args:
        layer: an attention layer (`_ATTENTION`).
        args, kwargs: the call's arguments.
        could_be_batch: callable(static length or None) -> whether a first
            axis of that length can be the batch, for a call of real tensors
            (when the step is traced). None for a call the graph recorded:
            there every KerasTensor leads with the batch, whatever its static
            length (a `batch_size` on the model's inputs fixes it), and other
            values (constants) do not.
    """
    if could_be_batch is None:
        def batch_led(tensor):
            return isinstance(tensor, keras.KerasTensor)
    else:
        def batch_led(tensor):
            return could_be_batch(_leading(tensor))
    try:
        bound = inspect.signature(type(layer).call).bind(layer, *args, **kwargs).arguments
    except TypeError:  # the call itself raises the error
        return None
    if isinstance(layer, _SEQUENCE_ATTENTION):
        inputs = bound.get("inputs")
        inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        masks = bound.get("mask")
        if masks is None:
            masks = [None] * len(inputs)
        masks = list(masks) if isinstance(masks, (list, tuple)) else [masks]
        masks = [_keras_mask(of) if mask is None else mask for mask, of in zip(masks, inputs)]
        pairs = list(zip(["query mask", "value mask"], masks, inputs))
        attention_mask, axes = None, 1
    else:
        inputs = [bound.get(name) for name in ("query", "value", "key")]
        pairs = []
        for name, of in (("query mask", inputs[0]), ("value mask", inputs[1]),
                         ("key mask", inputs[2] if inputs[2] is not None else inputs[1])):
            mask = bound.get(name.replace(" ", "_"))
            pairs.append((name, _keras_mask(of) if mask is None else mask, of))
        if isinstance(layer, keras.layers.MultiHeadAttention):
            # Its call reads the query's own mask and drops the argument.
            pairs.append(("query mask", _keras_mask(inputs[0]), inputs[0]))
        attention_mask = bound.get("attention_mask")
        axes = len(getattr(layer, "_attention_axes", None) or (1,))
    ranks = [_rank(t) for t in inputs if t is not None]
    known = [r for r in ranks if r is not None]
    if known and (min(known) < 3 or len(set(known)) > 1):
        return (f"attends over the batch axis (query, value and key of ranks {known}: "
                "attention needs equal ranks of at least 3, else each example's scores "
                "span the batch)")
    for name, mask, of in pairs:
        if mask is None or _rank(mask) is None or _rank(of) is None:
            continue
        if axes > 1 and batch_led(mask):
            # Keras builds a mask of the input's rank from it, short of the
            # scores' rank by n - 1: padded in front, its batch axis meets
            # the first query axis.
            return (f"attends over the batch axis (a {name} with {axes} attention axes: "
                    "Keras pads the mask it builds from it in front, where its batch axis "
                    "meets the attended axes)")
        if _rank(mask) < _rank(of) - 1 and batch_led(mask):
            return (f"attends over the batch axis (a {name} of rank {_rank(mask)} for an "
                    f"input of rank {_rank(of)}: its batch axis meets the attended axes)")
    if (attention_mask is not None and _rank(attention_mask) is not None
            and _rank(attention_mask) < 2 * axes + 1 and batch_led(attention_mask)):
        return (f"attends over the batch axis (an attention mask of rank "
                f"{_rank(attention_mask)}: a mask with the batch needs rank {2 * axes + 1}, "
                "else its batch axis meets the attended axes)")
    return None


def without_front_padded_attention_mask(layer, args, kwargs):
    """A call's (args, kwargs) with its constant attention mask taken out
    where Keras pads it in front: MultiHeadAttention and GroupQueryAttention
    add leading axes to a mask of rank below 2 n + 1 (n attention axes), so
    a constant one (a causal [T, T] array) is the same for every example
    and holds no batch axis. Every other call (a subclass's too: it may read
    the mask otherwise) comes back as it was.

    Example:

    >>> import keras
    >>> x = keras.Input((5, 4))
    >>> causal = np.tril(np.ones((5, 5), bool))
    >>> layer = keras.layers.MultiHeadAttention(1, 4)
    >>> _ = layer(x, x)
    >>> without_front_padded_attention_mask(layer, (x, x), {"attention_mask": causal})[1]
    {'attention_mask': None}
    """
    if type(layer) not in _ATTENTION or type(layer) in _SEQUENCE_ATTENTION:
        return args, kwargs  # a subclass may read the mask otherwise
    try:
        bound = inspect.signature(type(layer).call).bind(layer, *args, **kwargs)
    except TypeError:  # the call itself raises the error
        return args, kwargs
    mask = bound.arguments.get("attention_mask")
    axes = len(getattr(layer, "_attention_axes", None) or (1,))
    if (mask is None or isinstance(mask, keras.KerasTensor) or _tensor_inside(mask)
            or np.ndim(mask) >= 2 * axes + 1):
        return args, kwargs
    bound.arguments["attention_mask"] = None
    return bound.args[1:], bound.kwargs


def _tensor_inside(value):
    """True for a nest holding a graph tensor."""
    if isinstance(value, (list, tuple)):
        return any(_tensor_inside(item) for item in value)
    return isinstance(value, keras.KerasTensor)


def merge_call_problem(args):
    """Why one call of an elementwise merge layer (`_ELEMENTWISE_MERGES`)
    on positional `args` mixes examples, or None: inputs of unequal ranks
    broadcast from the right, where a lower-rank input's batch axis meets
    another axis of the others.

    Example:

    >>> merge_call_problem([[keras.KerasTensor((None, 4, 3)), keras.KerasTensor((None, 1))]])
    'broadcasts inputs of ranks [3, 2] against each other, the batch axis of one against another axis of the others'
    """
    inputs = args[0] if args else None
    inputs = list(inputs) if isinstance(inputs, (list, tuple)) else []
    ranks = [_rank(t) for t in inputs]
    known = [r for r in ranks if r is not None]
    if len(set(known)) > 1:
        return (f"broadcasts inputs of ranks {known} against each other, the batch axis of "
                "one against another axis of the others")
    return None


# Constants a layer combines with its input by broadcasting: one with as
# many axes as the input (its first longer than 1), or more, lines up with
# the batch axis or puts new axes in front of it, though Keras gives the
# output the input's shape.
# Read by name on every layer (Rescaling's scale and offset, Masking's
# mask_value, a normalization's epsilon, GaussianNoise's stddev, an
# activation layer's slope or threshold); its weights are not constants.
_BROADCAST_CONSTANTS = ("scale", "offset", "mask_value", "epsilon", "stddev", "rate", "alpha",
                        "negative_slope", "threshold", "max_value")


def constants_problem(layer, rank):
    """Why a constant a layer broadcasts against its input of `rank`
    (`_BROADCAST_CONSTANTS`, or a dropout `noise_shape` of another length
    than the rank) would meet the batch axis, or None.

    Example:

    >>> constants_problem(keras.layers.Rescaling(scale=[0.5, 2.0]), rank=3) is None
    True
    >>> constants_problem(keras.layers.Rescaling(scale=[[[[2.0]]], [[[3.0]]]]), rank=3)
    'broadcasts scale of shape (2, 1, 1, 1) against the batch axis of an input of rank 3'
    >>> constants_problem(keras.layers.LayerNormalization(epsilon=np.ones((4, 1, 1))), rank=3)
    'broadcasts epsilon of shape (4, 1, 1) against the batch axis of an input of rank 3'
    """
    for name in _BROADCAST_CONSTANTS:
        value = getattr(layer, name, None)
        if value is None or isinstance(value, (keras.Variable, str)) or callable(value):
            continue
        try:
            shape = np.shape(value)
        except (ValueError, TypeError):  # arrays of unequal shapes
            return f"has a {name} that is not one array"
        if rank is None and len(shape) > 0:
            return f"has a {name} of shape {shape} for an input of unknown rank"
        if rank is not None and (len(shape) > rank or len(shape) == rank and shape[0] != 1):
            return (f"broadcasts {name} of shape {shape} against the batch axis of an input "
                    f"of rank {rank}")
    noise_shape = getattr(layer, "noise_shape", None)
    if noise_shape is not None and (rank is None or len(noise_shape) != rank):
        return f"draws a dropout mask of shape {tuple(noise_shape)} for an input of rank {rank}"
    return None


def _call_ranks(layer, rank, call):
    """The input ranks to check `layer` at: the given call's (or `rank`),
    else every rank it recorded (a layer called at several ranks is read at
    each), or [None] when none is known."""
    if call is not None:
        return [rank]
    ranks = {rank} if rank is not None else set()
    for args, kwargs in _recorded_calls(layer):  # build shapes and graph nodes alike
        tensors = [t for t in keras.tree.flatten((args, kwargs)) if _rank(t) is not None]
        if tensors:
            ranks.add(_rank(tensors[0]))
    return sorted(ranks) or [None]


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


def configuration_problem(layer, rank=None, call=None, could_be_batch=None):
    """Why `layer`'s configuration may mix examples, or None when it does not.

    Args:
        layer: a Keras layer whose class is allow-listed.
        rank: rank of the layer's input, batch axis included; read from the
            layer's build shapes when None.
        call: (args, kwargs) of one call of the layer (an attention's
            inputs and masks are read from it); its recorded calls when None.
        could_be_batch: callable(static length or None) -> whether a first
            axis of that length can be the batch, for a call of real
            tensors; None for the calls the graph recorded
            (`attention_call_problem`).
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
    if isinstance(layer, _SEQUENCE_ATTENTION) and getattr(layer, "dropout", 0) > 0:
        # Its call draws the mask itself (no Dropout layer to key per example).
        return (f"draws its attention dropout mask (dropout={layer.dropout}) by position in "
                "the batch")
    if isinstance(layer, _ATTENTION):
        for args, kwargs in _recorded_calls(layer) if call is None else [call]:
            problem = attention_call_problem(layer, args, kwargs, could_be_batch)
            if problem:
                return problem
    if isinstance(layer, _ELEMENTWISE_MERGES):
        for args, _ in _recorded_calls(layer) if call is None else [call]:
            problem = merge_call_problem(args)
            if problem:
                return problem
    equation = getattr(layer, "equation", None)
    if isinstance(layer, keras.layers.EinsumDense) and not _keeps_batch_letter(equation):
        return f"does not keep the batch axis first (equation={equation!r})"
    for input_rank in _call_ranks(layer, rank, call):
        problem = _rank_problem(layer, input_rank)
        if problem:
            return problem
    return None


def _rank_problem(layer, rank):
    """Why `layer` mixes examples on an input of `rank` (None: unknown):
    a built-in activation that is not elementwise on a rank-1 input, a
    constant that meets the batch axis, an axis that is the batch's."""
    for attribute in _ACTIVATION_ATTRIBUTES:
        fn = getattr(layer, attribute, None)
        name = _activation_name(fn)
        if (rank == 1 and name is not None and name not in _ELEMENTWISE_ACTIVATIONS
                and fn not in _DECLARED_ACTIVATIONS):
            return f"applies {attribute}={name!r} over the batch axis of a rank-1 input"
    problem = constants_problem(layer, rank)
    if problem:
        return problem
    for attribute in _AXIS_ATTRIBUTES:
        value = getattr(layer, attribute, None)
        for axis in _axes(value):
            if _touches_batch(axis, rank):
                if isinstance(layer, _STATISTIC_AXIS_LAYERS):
                    return f"keeps a statistic per position of the batch axis ({attribute}={value!r})"
                return f"reduces over the batch axis ({attribute}={value!r})"
    return None
