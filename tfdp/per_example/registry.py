"""Which layers keep examples independent, and which have per-example rules.

The batched per-example pass (one forward and backward pass over the whole
batch) is exact only if every example's output depends on that example
alone. `ALLOWED` lists the Keras layers known to keep examples independent;
any other layer (a Lambda, a custom subclass) sends the model to the
whole-model vectorized path unless the user declares it:

>>> import keras, tfdp
>>> @tfdp.per_example.declare_per_example
... class Scale(keras.layers.Layer):
...     def call(self, x):
...         return 2.0 * x
>>> is_per_example(Scale())
True

A declared layer with weights and no rule gets its per-example gradients
from the per-layer fallback (`tfdp.per_example.fallback`). Rules map a layer
class to the module that computes its per-example gradients from the batched
pass (`register_rule`).
"""

import keras

from tfdp.per_example.configuration import without_front_padded_attention_mask
from tfdp.per_example.graph_operations import (
    layer_constants_position_free,
    operation_keeps_examples,
)
from tfdp.per_example.preprocessing_layers import keeps_examples_independent
from tfdp.per_example.random_augmentation import is_keyed_augmentation

_L = keras.layers

# Layers whose output for one example depends only on that example's inputs
# (and, on the batched pass, on randomness keyed by them: dropout and noise
# layers, `tfdp.per_example.keyed_noise`).
ALLOWED = {
    # Layers with weights (each has a rule, or falls back per layer).
    _L.Dense, _L.EinsumDense, _L.Embedding,
    _L.Conv1D, _L.Conv2D, _L.Conv3D, _L.DepthwiseConv1D, _L.DepthwiseConv2D,
    _L.SeparableConv1D, _L.SeparableConv2D, _L.Conv1DTranspose, _L.Conv2DTranspose,
    _L.Conv3DTranspose,
    _L.LayerNormalization, _L.GroupNormalization, _L.UnitNormalization,
    _L.PReLU,
    _L.LSTM, _L.GRU, _L.SimpleRNN, _L.RNN, _L.Bidirectional, _L.TimeDistributed,
    _L.LSTMCell, _L.GRUCell, _L.SimpleRNNCell,
    _L.MultiHeadAttention, _L.Attention, _L.AdditiveAttention,
    # Weightless reshaping, pooling and merging.
    _L.InputLayer, _L.Flatten, _L.Reshape, _L.Permute, _L.RepeatVector, _L.Identity,
    _L.Cropping1D, _L.Cropping2D, _L.Cropping3D,
    _L.ZeroPadding1D, _L.ZeroPadding2D, _L.ZeroPadding3D,
    _L.UpSampling1D, _L.UpSampling2D, _L.UpSampling3D,
    _L.MaxPooling1D, _L.MaxPooling2D, _L.MaxPooling3D,
    _L.AveragePooling1D, _L.AveragePooling2D, _L.AveragePooling3D,
    _L.GlobalMaxPooling1D, _L.GlobalMaxPooling2D, _L.GlobalMaxPooling3D,
    _L.GlobalAveragePooling1D, _L.GlobalAveragePooling2D, _L.GlobalAveragePooling3D,
    _L.Add, _L.Subtract, _L.Multiply, _L.Average, _L.Maximum, _L.Minimum,
    _L.Concatenate, _L.Dot,
    _L.Activation, _L.ReLU, _L.LeakyReLU, _L.ELU, _L.Softmax,
    _L.Dropout, _L.SpatialDropout1D, _L.SpatialDropout2D, _L.SpatialDropout3D,
    _L.GaussianNoise, _L.GaussianDropout, _L.AlphaDropout,
    _L.Masking, _L.Rescaling, _L.Normalization,
}
for _name in ("RMSNormalization", "GroupQueryAttention"):
    if hasattr(_L, _name):
        ALLOWED.add(getattr(_L, _name))

_DECLARED = set()
_SUBLAYERS_ON_THE_BATCH = set()
RULES = {}


def declare_per_example(layer_class=None, *, sublayers_on_the_batch=False):
    """Declares that `layer_class` keeps examples independent.

    Use it (as a function or a class decorator) for a custom layer whose
    output for each example depends only on that example: the model then takes
    the fast batched path, and the layer's weights (its sublayers' included)
    get their per-example gradients from the layer's own vjp, one example at a
    time (the per-layer fallback). Declaring a layer that mixes examples (a
    batch mean) would let one record move every other example's clipped
    gradient, voiding the privacy guarantee; do not declare such a layer.
    The Keras layers and models it holds as attributes are still read like a
    model's graph (a Softmax over the batch axis inside refuses the batched
    path, `tfdp.per_example.declared`); layers it creates inside `call` or
    keeps where Keras does not track them, a batch moved off axis 0 before
    a held layer reads it (a transposed batch), constants it passes a held
    layer whose rows line up with the batch, a held dropout or noise
    layer called on a tensor that is not the batch but has its length (its
    masks are keyed by the examples', `keyed_noise`), and held layers called
    inside a `tf.function` of its own that was traced before training (its
    graph is reused, so the step never sees those calls) are covered by the
    declaration alone: call held layers as `layer(x)` in `call` itself.

    Args:
        layer_class: a `keras.layers.Layer` subclass.
        sublayers_on_the_batch: a second, stronger claim: the layer calls each
            sublayer that has weights on tensors whose axis 0 is the batch,
            row i being example i (as a transformer block calls its attention
            and dense layers). Those sublayers then run their own fast rules.
            A layer that calls a sublayer on anything else (positions, a
            transposed or reshaped batch, rows reordered) must not claim it:
            the rule would read that tensor's rows as examples. Default
            False.

    Returns:
        `layer_class`, unchanged (or, called with only the keyword, a
        decorator).

    Example:

    >>> import keras
    >>> @declare_per_example(sublayers_on_the_batch=True)
    ... class Block(keras.layers.Layer):
    ...     def __init__(self, **kwargs):
    ...         super().__init__(**kwargs)
    ...         self.dense = keras.layers.Dense(4)
    ...     def call(self, x):
    ...         return x + self.dense(x)
    >>> is_per_example(Block()), runs_sublayer_rules(Block())
    (True, True)
    """
    if layer_class is None:
        return lambda cls: declare_per_example(cls, sublayers_on_the_batch=sublayers_on_the_batch)
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(
            "Expected a keras.layers.Layer subclass. Received: "
            f"layer_class={layer_class!r}"
        )
    _DECLARED.add(layer_class)
    if sublayers_on_the_batch:
        _SUBLAYERS_ON_THE_BATCH.add(layer_class)
    else:
        _SUBLAYERS_ON_THE_BATCH.discard(layer_class)
    return layer_class


def runs_sublayer_rules(layer):
    """Whether the batched pass may run `layer`'s sublayers through their own
    rules: every allow-listed layer (Keras's composite layers call their
    sublayers on the batch), and a declared layer only when it claims
    `sublayers_on_the_batch`; other declared layers take their own vjp."""
    if type(layer) in _DECLARED:
        return type(layer) in _SUBLAYERS_ON_THE_BATCH
    return True


def register_rule(*layer_classes):
    """Class decorator registering a rule for exactly these layer classes.

    A rule has `supports(layer) -> bool`, `call(layer, recorder, call,
    *args, **kwargs)` (runs the layer in the batched pass, adding probes
    through `recorder`) and `parts(layer, records)` (per-example gradient
    parts from the recorded tensors: `tfdp.per_example.grads.Part`
    subclasses, whose norms are upper bounds of what their weighted sum adds
    for ANY record; build them from `LinearGrads`, `MaterializedGrads` or
    `EmbeddingGrads` rather than computing norms yourself; their methods
    run after the pass and must write nothing: each run is scanned by the
    pass's rules as the step is traced, `tfdp.models.state_writes`).
    Subclasses of a registered class do not inherit its rule: they may
    compute something else. A class may have
    several rules (Dense with and without LoRA): the first registered one
    that supports the layer runs it.
    """

    def register(rule_class):
        rule = rule_class()
        for layer_class in layer_classes:
            RULES.setdefault(layer_class, []).append(rule)
        return rule_class

    return register


def rule_for(layer):
    """The first rule registered for `layer`'s exact class that supports it."""
    for rule in RULES.get(type(layer), []):
        if rule.supports(layer):
            return rule
    return None


def is_per_example(layer):
    """True if `layer` is known (or declared) to keep examples independent
    (Keras's random augmentation layers: keyed per example on the batched
    pass, `tfdp.per_example.random_augmentation`; text and lookup layers:
    `tfdp.per_example.preprocessing_layers`)."""
    return (type(layer) in ALLOWED or type(layer) in _DECLARED or is_batch_normalization(layer)
            or keeps_examples_independent(layer) or is_keyed_augmentation(layer))


def is_batch_normalization(layer):
    """True for a Keras BatchNormalization. In inference mode each example's
    output is (x - moving_mean) / sqrt(moving_variance + epsilon) * gamma +
    beta, with no statistic updated: Keras runs a frozen one
    (`trainable=False`) so whatever `training` says (its call normalizes with
    the batch only when `training and self.trainable`), and the DP step runs
    a trainable one only when called with `training=False`, refusing any
    call in training mode at trace time (`tfdp.per_example.inference_mode`).

    Example:

    >>> is_batch_normalization(keras.layers.BatchNormalization())
    True
    >>> is_batch_normalization(keras.layers.LayerNormalization())
    False
    """
    return type(layer) is _L.BatchNormalization


def node_is_per_example(node):
    """True if a Functional graph node keeps examples independent.

    Layers are checked by class, and the constants they are called with
    (none may line up with the batch axis, masks included); a weightless
    operation by `tfdp.per_example.graph_operations` (elementwise, along
    axes other than the batch's, or reshaping around it).
    """
    operation = node.operation
    if isinstance(operation, keras.layers.Layer):
        return ((is_per_example(operation) or is_graph_model(operation))
                and not node_constants_meet_batch(node))
    return operation_keeps_examples(operation, node.arguments.args, node.arguments.kwargs,
                                    node.outputs)


def node_constants_meet_batch(node):
    """True if a layer's graph node is called with a constant (by name or
    by position, a mask or an initial state included) whose first axis is
    longer than 1: it could line up with the batch axis
    (`graph_operations.layer_constants_position_free`). An attention mask
    that MultiHeadAttention pads in front (a causal [T, T] array) holds no
    batch axis (`configuration.without_front_padded_attention_mask`)."""
    args, kwargs = without_front_padded_attention_mask(
        node.operation, node.arguments.args, node.arguments.kwargs)
    return not layer_constants_position_free(args, kwargs)


def is_graph_model(layer):
    """True for a Sequential or Functional model running its own graph."""
    from keras.src.models.functional import Functional

    if isinstance(layer, keras.Sequential):
        return type(layer).call is keras.Sequential.call
    return isinstance(layer, Functional) and type(layer).call is Functional.call
