"""Per-example gradients of a Keras model, in two ways.

DP needs each example's gradient (to clip it) but rarely the gradients
themselves: DP-SGD needs per-example norms and a reweighted sum. This module
gives both through one interface, `PerExampleGradients`:

* "fast" (book-keeping, Bu et al. 2023): one batched forward and backward
  pass. For every Dense and Conv2D layer the pre-activation output gets a zero
  "probe" added; the gradient of the summed loss with respect to the probe is
  each example's output gradient G_i. With the layer input X_i (for Conv2D its
  extracted patches) the example's kernel gradient is X_i^T G_i, so its norm
  and any weighted sum over examples follow without a per-example backward
  pass. Inside `tf.vectorized_map` Conv2DBackpropFilter falls back to a
  while_loop, one example at a time; this path avoids it.
* "vectorized": `tf.vectorized_map` over examples of an ordinary backward
  pass; works for any layer whose computation keeps examples independent.

"auto" takes the fast path when every trainable variable belongs to a
supported layer, else the vectorized one. Layers that mix examples within a
batch (BatchNormalization) have no per-example gradient and are refused.

Example:

>>> import keras, tensorflow as tf
>>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> loss = keras.losses.get("mse")
>>> grads, y_pred, losses = compute_per_example_gradients(
...     model, tf.ones([4, 3]), tf.zeros([4, 2]), tf.ones([4]), loss)
>>> grads.sq_norms().shape
TensorShape([4])
"""

import keras
import numpy as np
import tensorflow as tf

METHODS = ("auto", "fast", "vectorized")

_MIXING_LAYERS = (keras.layers.BatchNormalization,)


class LinearGrads:
    """Per-example gradients of a layer computing Z = X W (+ b).

    Stored factored: example i's kernel gradient is X_i^T G_i summed over the
    positions S (sequence steps, or conv output pixels whose input patches
    form X), its bias gradient the sum of G_i over positions.

    Args:
        x: float tensor [B, S, K], layer inputs (or extracted patches).
        g: float tensor [B, S, O], gradients of the loss at the layer's
            pre-activation outputs.
        kernel: the kernel variable (K*O elements, any shape).
        bias: the bias variable [O], or None.
    """

    def __init__(self, x, g, kernel, bias=None):
        self.x = x
        self.g = g
        self.variables = [kernel] + ([bias] if bias is not None else [])
        self._kernel_shape = kernel.shape
        positions = x.shape[1]
        fan_in, fan_out = x.shape[2], g.shape[2]
        # Gram-matrix ("ghost") norms cost S^2 (K + O) per example against
        # S K O for materialised per-example kernels: pick the cheaper.
        self._ghost = positions is not None and positions * (fan_in + fan_out) < (
            fan_in * fan_out
        )
        self._materialized = None

    def _per_example_kernel(self):
        """[B, K, O] per-example kernel gradients, computed once per step."""
        if self._materialized is None:
            self._materialized = tf.einsum("bsk,bso->bko", self.x, self.g)
        return self._materialized

    def sq_norms(self):
        if self.x.shape[1] == 1 or self._ghost:
            # Factored norms multiply a term in |x|^2 by one in |g|^2: each
            # example's x and g are scaled to max 1 first, so that a huge
            # input with a zero output gradient (a saturated unit) gives a
            # finite norm rather than inf * 0.
            x, x_scale = _scaled_to_unit_max(self.x)
            g, g_scale = _scaled_to_unit_max(self.g)
            if self.x.shape[1] == 1:
                kernel = tf.reduce_sum(tf.square(x), [1, 2]) * tf.reduce_sum(tf.square(g), [1, 2])
            else:
                x_gram = tf.einsum("bsk,btk->bst", x, x)
                g_gram = tf.einsum("bso,bto->bst", g, g)
                kernel = tf.reduce_sum(x_gram * g_gram, [1, 2])
            kernel *= tf.square(x_scale * g_scale)
        else:
            kernel = tf.reduce_sum(tf.square(self._per_example_kernel()), [1, 2])
        if len(self.variables) == 1:
            return kernel
        return kernel + tf.reduce_sum(tf.square(tf.reduce_sum(self.g, 1)), 1)

    def dots(self, vectors):
        kernel = tf.reshape(vectors[0], [self.x.shape[2], self.g.shape[2]])
        # Two-operand contractions: a three-operand tf.einsum can be far slower.
        result = tf.reduce_sum(tf.einsum("bsk,ko->bso", self.x, kernel) * self.g, [1, 2])
        if len(self.variables) == 2:
            result += tf.einsum("bo,o->b", tf.reduce_sum(self.g, 1), vectors[1])
        return result

    def weighted_sum(self, weights):
        keep = tf.not_equal(weights, 0.0)[:, None, None]
        g = tf.where(keep, self.g, tf.zeros_like(self.g))
        if self._materialized is not None:
            per_example = tf.where(keep, self._materialized, tf.zeros_like(self._materialized))
            kernel = tf.tensordot(weights, per_example, axes=1)
        else:
            x = tf.where(keep, self.x, tf.zeros_like(self.x))
            # Weight G, then one matmul over (example, position) rows: measured
            # 60x faster than tf.einsum("b,bsk,bso->ko") for a 784x256 Dense
            # layer at batch 2048 on 2 CPU cores.
            weighted_g = g * weights[:, None, None]
            kernel = tf.matmul(
                tf.reshape(x, [-1, self.x.shape[2]]),
                tf.reshape(weighted_g, [-1, self.g.shape[2]]),
                transpose_a=True,
            )
        sums = [tf.reshape(kernel, self._kernel_shape)]
        if len(self.variables) == 2:
            sums.append(tf.einsum("b,bso->o", weights, g))
        return sums

    def materialize(self):
        batch = tf.shape(self.x)[0]
        kernel = self._per_example_kernel()
        grads = [tf.reshape(kernel, tf.concat([[batch], self._kernel_shape], 0))]
        if len(self.variables) == 2:
            grads.append(tf.reduce_sum(self.g, 1))
        return grads


def _scaled_to_unit_max(tensor):
    """(tensor / s, s), s [B] the largest |entry| of each example (an
    all-zero example is divided by 1 and keeps s = 0)."""
    scale = tf.reduce_max(tf.abs(tensor), axis=[1, 2])
    safe = tf.where(scale > 0, scale, tf.ones_like(scale))
    return tensor / safe[:, None, None], scale


class MaterializedGrads:
    """Per-example gradients held in full, one [B, *shape] tensor a variable.

    Args:
        variables: list of variables.
        grads: list of tensors [B, *variable.shape], aligned with variables.
    """

    def __init__(self, variables, grads):
        self.variables = list(variables)
        self.grads = list(grads)

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
        sums = []
        for g in self.grads:
            keep = tf.reshape(tf.not_equal(weights, 0.0), [-1] + [1] * (g.shape.rank - 1))
            safe = tf.where(keep, g, tf.zeros_like(g))
            sums.append(tf.tensordot(weights, safe, axes=1))
        return sums

    def materialize(self):
        return list(self.grads)


class PerExampleGradients:
    """Per-example gradients of a model's trainable variables.

    Each example's gradient is the concatenation over `parts` (each a
    `LinearGrads` or `MaterializedGrads`) plus an optional constant `offsets`
    shared by every example (weight decay inside the per-example loss adds
    lambda * theta to every example's gradient).

    Args:
        variables: the model's trainable variables, in the order results use.
        parts: objects covering every variable exactly once.
        offsets: optional list aligned with `variables`, added to every
            example's gradient.

    Example:

    >>> v = tf.Variable([0.0, 0.0])
    >>> g = PerExampleGradients([v], [MaterializedGrads([v], [tf.eye(2)])])
    >>> g.weighted_sum(tf.constant([1.0, 2.0]))[0].numpy()
    array([1., 2.], dtype=float32)
    """

    def __init__(self, variables, parts, offsets=None):
        self.variables = list(variables)
        self.parts = list(parts)
        self.offsets = offsets
        position = {id(v): i for i, v in enumerate(self.variables)}
        covered = [position[id(v)] for part in self.parts for v in part.variables]
        if sorted(covered) != list(range(len(self.variables))):
            raise ValueError(
                "Per-example gradient parts must cover every trainable variable "
                "exactly once."
            )
        self._order = covered

    def with_offsets(self, offsets):
        """Returns the same gradients with `offsets` added to every example's."""
        if self.offsets is not None:
            offsets = [a + b for a, b in zip(self.offsets, offsets)]
        return PerExampleGradients(self.variables, self.parts, offsets)

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


def check_per_example_support(model):
    """Raises a clear error if a layer mixes examples within a batch.

    Args:
        model: a Keras model.

    Raises:
        ValueError: for BatchNormalization (its batch statistics make every
            example's output depend on the others, so per-example gradients,
            and so clipping, are undefined).
    """
    for layer in _all_layers(model):
        if isinstance(layer, _MIXING_LAYERS):
            raise ValueError(
                f"Layer '{layer.name}' ({type(layer).__name__}) mixes examples "
                "within a batch, so per-example gradients (and DP clipping) are "
                "undefined. Use keras.layers.LayerNormalization or "
                "GroupNormalization instead. Received: layer="
                f"{type(layer).__name__}"
            )


def _all_layers(model):
    stack = list(getattr(model, "layers", []))
    while stack:
        layer = stack.pop()
        yield layer
        stack.extend(getattr(layer, "layers", []) or [])


def _is_fast_layer(layer):
    if getattr(layer, "compute_dtype", None) != "float32":
        return False
    if getattr(layer, "quantization_mode", None) is not None:
        return False
    if getattr(layer, "lora_enabled", False):
        return False
    if type(layer) is keras.layers.Dense:
        return True
    return (
        type(layer) is keras.layers.Conv2D
        and layer.groups == 1
        and layer.data_format == "channels_last"
    )


def _graph_of(model):
    """The Functional graph to run, or None (then only vectorized works)."""
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    if hasattr(model, "_run_through_graph") and hasattr(model, "_nodes_by_depth"):
        return model
    return None


def fast_path_available(model):
    """True if every trainable variable belongs to a Dense or Conv2D layer
    called once in the model's own graph (the book-keeping path applies)."""
    graph = _graph_of(model)
    if graph is None:
        return False
    # Calls inside this graph only: a layer also has nodes from calls
    # outside it (e.g. `model.build` on a Sequential with an Input).
    nodes = [node for depth in graph._nodes_by_depth.values() for node in depth]
    covered = []
    for layer in graph.layers:
        if not layer.trainable_variables:
            continue
        calls = sum(node.operation is layer for node in nodes)
        if not _is_fast_layer(layer) or calls != 1:
            return False
        covered.extend(layer.trainable_variables)
    return len(covered) == len(model.trainable_variables)


class _Recorder:
    """Runs a Functional graph, probing Dense and Conv2D outputs."""

    def __init__(self, tape, training):
        self.tape = tape
        self.training = training
        self.records = []

    def operation_fn(self, operation):
        from keras.src.models.functional import operation_fn

        if isinstance(operation, keras.layers.Layer) and _is_fast_layer(operation):
            return lambda inputs: self._probed_call(operation, inputs)
        return operation_fn(operation, training=self.training)

    def _probed_call(self, layer, inputs):
        inputs = tf.convert_to_tensor(inputs)
        if isinstance(layer, keras.layers.Conv2D):
            outputs = layer.convolution_op(inputs, layer.kernel)
        else:
            outputs = keras.ops.matmul(inputs, layer.kernel)
        if layer.bias is not None:
            outputs = outputs + layer.bias
        probe = tf.zeros_like(outputs)
        self.tape.watch(probe)
        outputs = outputs + probe
        self.records.append((layer, inputs, probe))
        if layer.activation is not None:
            outputs = layer.activation(outputs)
        return outputs


# Below this many input channels, gathering patches copies too little per
# index and a convolution with an identity kernel is faster (measured on the
# tanh CNN at batch 2048, 2 CPU cores: 1 channel, identity 34 ms against
# gather 99 ms; 16 channels, gather 5 ms against identity 55 ms and
# tf.image.extract_patches 19 ms).
_IDENTITY_CONV_MAX_CHANNELS = 8


def _extract_patches(layer, inputs):
    """[B, H', W', kh*kw*cin] input patches in the kernel's (kh, kw, cin) order."""
    kh, kw = layer.kernel_size
    channels = inputs.shape[-1]
    if channels < _IDENTITY_CONV_MAX_CHANNELS:
        size = kh * kw * channels
        identity = tf.reshape(tf.eye(size, dtype=inputs.dtype), [kh, kw, channels, size])
        return tf.nn.conv2d(
            inputs,
            identity,
            strides=list(layer.strides),
            padding=layer.padding.upper(),
            dilations=list(layer.dilation_rate),
        )
    if inputs.shape[1] is not None and inputs.shape[2] is not None:
        return _gather_patches(layer, inputs)
    sh, sw = layer.strides
    dh, dw = layer.dilation_rate
    return tf.image.extract_patches(
        inputs,
        sizes=[1, kh, kw, 1],
        strides=[1, sh, sw, 1],
        rates=[1, dh, dw, 1],
        padding=layer.padding.upper(),
    )


def _patch_geometry(size, kernel, stride, dilation, padding):
    """(output size, padding before, padding after) of one spatial axis, as TF pads."""
    span = (kernel - 1) * dilation + 1
    if padding == "same":
        out = -(-size // stride)
        total = max((out - 1) * stride + span - size, 0)
        return out, total // 2, total - total // 2
    return (size - span) // stride + 1, 0, 0


def _gather_patches(layer, inputs):
    """Patches by one tf.gather over the padded image's pixels (static H, W)."""
    (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.strides, layer.dilation_rate
    height, width, channels = inputs.shape[1], inputs.shape[2], inputs.shape[3]
    out_h, top, bottom = _patch_geometry(height, kh, sh, dh, layer.padding)
    out_w, left, right = _patch_geometry(width, kw, sw, dw, layer.padding)
    padded_w = width + left + right
    rows = (np.arange(out_h) * sh)[:, None, None, None] + (np.arange(kh) * dh)[None, None, :, None]
    cols = (np.arange(out_w) * sw)[None, :, None, None] + (np.arange(kw) * dw)[None, None, None, :]
    pixel = (rows * padded_w + cols).reshape(out_h, out_w, kh * kw)
    padded = tf.pad(inputs, [[0, 0], [top, bottom], [left, right], [0, 0]])
    flat = tf.reshape(padded, [tf.shape(inputs)[0], -1, channels])
    patches = tf.gather(flat, tf.constant(pixel, tf.int32), axis=1)
    return tf.reshape(patches, [tf.shape(inputs)[0], out_h, out_w, kh * kw * channels])


def _layer_inputs_as_rows(layer, inputs):
    """Layer inputs as [B, S, K] rows whose product with the kernel gives Z."""
    if isinstance(layer, keras.layers.Conv2D):
        inputs = _extract_patches(layer, inputs)
    return _as_rows(inputs)


def _as_rows(tensor):
    """[B, ..., C] as [B, S, C], S static when the middle dimensions are.

    A static S lets `LinearGrads` choose ghost norms or the one-position
    shortcut while tracing (with S unknown it would materialise per-example
    kernels).
    """
    middle = tensor.shape[1:-1]
    positions = middle.num_elements() if middle.is_fully_defined() else -1
    return tf.reshape(tensor, [tf.shape(tensor)[0], positions, tensor.shape[-1]])


def _fast_gradients(model, x, y, weights, loss_fn, training):
    graph = _graph_of(model)
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        recorder = _Recorder(tape, training)
        outputs = graph._run_through_graph(
            graph._standardize_inputs(x), operation_fn=recorder.operation_fn
        )
        y_pred = outputs[0] if isinstance(outputs, (list, tuple)) and len(outputs) == 1 else outputs
        losses = loss_fn(y, y_pred)
        total = tf.reduce_sum(losses * weights)
    probes = [probe for _, _, probe in recorder.records]
    output_grads = tape.gradient(total, probes, unconnected_gradients="zero")
    parts = []
    for (layer, inputs, _), g in zip(recorder.records, output_grads):
        rows = _layer_inputs_as_rows(layer, inputs)
        g_rows = _as_rows(g)
        parts.append(LinearGrads(rows, g_rows, layer.kernel, layer.bias))
    return PerExampleGradients(model.trainable_variables, parts), y_pred, losses


def _vectorized_gradients(model, x, y, weights, loss_fn, training):
    variables = model.trainable_variables

    def one_example(example):
        x_i, y_i, w_i = tf.nest.map_structure(lambda t: t[None], example)
        with tf.GradientTape() as tape:
            pred = model(x_i, training=training)
            loss = loss_fn(y_i, pred)
            weighted = tf.reduce_sum(loss * w_i)
        grads = tape.gradient(weighted, variables, unconnected_gradients="zero")
        return grads, pred[0], loss[0]

    grads, y_pred, losses = tf.vectorized_map(one_example, (x, y, weights))
    parts = [MaterializedGrads(variables, grads)]
    return PerExampleGradients(variables, parts), y_pred, losses


def compute_per_example_gradients(
    model, x, y, weights, loss_fn, method="auto", training=True
):
    """Per-example gradients of `weights_i * loss_fn(y_i, model(x_i))`.

    Args:
        model: a built Keras model (single output).
        x: model inputs, batch first.
        y: targets, batch first.
        weights: float tensor [B]: sample weight times padding mask.
        loss_fn: callable(y_true, y_pred) -> per-example losses [B].
        method: "auto", "fast" or "vectorized" (see module docstring).
        training: passed to layers (Dropout and the like).

    Returns:
        (PerExampleGradients, y_pred, per-example losses [B]).
    """
    if method not in METHODS:
        raise ValueError(f"Expected `method` in {METHODS}. Received: method={method!r}")
    fast = fast_path_available(model)
    if method == "fast" and not fast:
        raise ValueError(
            "The fast per-example gradient path needs every trainable layer to "
            "be a float32 Dense or Conv2D (groups=1, channels_last) called once "
            "in a Functional or Sequential model. Use "
            "per_example_gradients='auto' or 'vectorized'. Received: "
            "per_example_gradients='fast'"
        )
    if method == "fast" or (method == "auto" and fast):
        return _fast_gradients(model, x, y, weights, loss_fn, training)
    return _vectorized_gradients(model, x, y, weights, loss_fn, training)
