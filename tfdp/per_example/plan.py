"""Which per-example path a model takes, and which handler runs each layer.

The batched path (one forward and backward pass, `recorder`) needs a model
whose graph can be walked (Functional or Sequential, nested ones included)
and whose every layer and operation keeps examples independent
(`registry`). Each layer that owns trainable weights is then run by its rule,
or by the per-layer fallback when it has none; a layer without weights of its
own is looked into (MultiHeadAttention's projections, Bidirectional's two
RNNs, a nested model). Random augmentation, dropout and noise layers draw
per example, keyed by its own input (`random_augmentation`, `keyed_noise`).
Anything else takes the whole-model vectorized path, and `Plan.reason` says
why.

Example:

>>> import keras
>>> model = keras.Sequential([keras.Input((3,)), keras.layers.Lambda(lambda t: t, name="doubt"),
...                           keras.layers.Dense(2)])
>>> plan_for(model).path, plan_for(model).reason
('vectorized', "layer 'doubt' (Lambda) is not known to keep examples independent")
"""

import keras

from tfdp.per_example import rules
from tfdp.per_example.configuration import configuration_problem
from tfdp.per_example.declared import held_layer_problem
from tfdp.per_example.fallback import LayerFallback
from tfdp.per_example.keyed_noise import KeyedNoise, is_keyed_noise
from tfdp.per_example.random_augmentation import (
    KeyedAugmentation,
    augmentation_hint,
    is_keyed_augmentation,
)
from tfdp.per_example.registry import (
    _DECLARED,
    is_graph_model,
    is_per_example,
    node_constants_meet_batch,
    node_is_per_example,
    rule_for,
    runs_sublayer_rules,
)

FALLBACK = LayerFallback()
KEYED = KeyedAugmentation()
KEYED_NOISE = KeyedNoise()


class Plan:
    """A model's per-example path.

    Attributes:
        path: "batched" or "vectorized".
        handlers: for "batched", list of (layer, rule or FALLBACK).
        reason: for "vectorized", why the batched path does not apply.
        fallback_layers: names of layers run by the per-layer fallback.
        keyed_layers: names of random augmentation layers keyed per example.
    """

    def __init__(self, path, handlers=(), reason=None):
        self.path = path
        self.handlers = list(handlers)
        self.reason = reason
        self.fallback_layers = [l.name for l, h in self.handlers if h is FALLBACK]
        self.keyed_layers = [l.name for l, h in self.handlers if h is KEYED]

    def describe(self):
        """One line naming the path and what forced a fallback."""
        if self.path == "vectorized":
            return f"per-example gradients: whole-model vectorized_map ({self.reason})"
        line = "per-example gradients: batched pass with per-layer rules"
        if self.fallback_layers:
            line += "; per-layer vjp fallback for " + ", ".join(self.fallback_layers)
        if self.keyed_layers:
            line += "; random augmentation keyed per example: " + ", ".join(self.keyed_layers)
        return line


def _graph_nodes(model):
    graph = getattr(model, "_functional", None) if hasattr(model, "_functional") else model
    if graph is None:
        return None
    return [node for depth in graph._nodes_by_depth.values() for node in depth]


def _describe(layer, why):
    return f"layer '{layer.name}' ({type(layer).__name__}) {why}"


def _check_layer(layer):
    """None if `layer` (and every sublayer) keeps examples independent."""
    if is_graph_model(layer):
        return _check_graph(layer)
    if not is_per_example(layer):
        return _describe(layer, "is not known to keep examples independent" + augmentation_hint(layer))
    if type(layer) in _DECLARED:
        return _check_declared(layer)
    problem = configuration_problem(layer)
    if problem:
        return _describe(layer, problem)
    for sub in layer._flatten_layers(include_self=False, recursive=False):
        problem = _check_layer(sub)
        if problem:
            return problem
    return None


def _check_declared(layer):
    """None unless a Keras layer or graph model inside declared `layer` may
    mix examples. The declaration vouches for the layer's own computation
    and its custom sublayers; the Keras layers it holds (which rules may run
    on the batch, `sublayers_on_the_batch`) are read like the graph's at
    the ranks they recorded (`declared.held_layer_problem`; the step checks
    every call at its real rank when traced), and a graph model it holds is
    walked like the model's own graph."""
    for sub in layer._flatten_layers(include_self=False):
        if is_graph_model(sub):
            problem = _check_graph(sub)
            if problem:
                return problem
    held = held_layer_problem(layer)
    return _describe(*held) if held else None


def _check_graph(model):
    nodes = _graph_nodes(model)
    if nodes is None:
        return f"model '{model.name}' has no graph to walk"
    for node in nodes:
        operation = node.operation
        if not node_is_per_example(node):
            if isinstance(operation, keras.layers.Layer) and node_constants_meet_batch(node):
                return _describe(operation, "is called with a constant whose first axis lines "
                                 "up with the batch axis (each example would get its row by "
                                 "its position in the batch)")
            return _describe(operation, "is not known to keep examples independent"
                             + augmentation_hint(operation))
        if hasattr(operation, "_flatten_layers") and operation is not model:
            problem = _check_layer(operation)
            if problem:
                return problem
    return None


def _trainable(layer):
    """The trainable variables in `layer`, also under a sublayer marked
    trainable=False whose own sublayers were made trainable again (KerasHub's
    `backbone.enable_lora` freezes the blocks, then adds trainable LoRA
    weights inside them): Keras trains those, so tfdp must cover them."""
    return [v for v in layer.variables if v.trainable]


def _own_trainable_variables(layer):
    inner = {id(v) for sub in layer._flatten_layers(include_self=False)
             for v in _trainable(sub)}
    return [v for v in _trainable(layer) if id(v) not in inner]


def _assign_handlers(layer, handlers, seen):
    if id(layer) in seen or not _trainable(layer):
        return
    seen.add(id(layer))
    rule = rule_for(layer)
    if rule is not None:
        handlers.append((layer, rule))
    elif _own_trainable_variables(layer) or not runs_sublayer_rules(layer):
        # A declared layer may call a sublayer on tensors whose rows are not
        # its examples (keras.io's TokenAndPositionEmbedding looks up
        # positions): a sublayer's rule would read them as examples. Unless
        # it claims `sublayers_on_the_batch`, its own vjp per example covers
        # all its weights.
        handlers.append((layer, FALLBACK))
    else:
        for sub in layer._flatten_layers(include_self=False, recursive=False):
            _assign_handlers(sub, handlers, seen)


def plan_for(model):
    """The `Plan` for a built Keras model."""
    rules.load_optional()
    if not is_graph_model(model):
        return Plan("vectorized", reason=f"model '{model.name}' is subclassed (no graph)")
    problem = _check_graph(model)
    if problem:
        return Plan("vectorized", reason=problem)
    handlers, seen = [], set()
    for layer in model._flatten_layers(include_self=False, recursive=False):
        _assign_handlers(layer, handlers, seen)
    covered = [id(v) for layer, _ in handlers for v in _trainable(layer)]
    expected = [id(v) for v in model.trainable_variables]
    if sorted(covered) != sorted(expected):
        return Plan("vectorized", reason="some trainable variables belong to no layer it can run")
    handlers += [(layer, KEYED) for layer in model._flatten_layers(include_self=False)
                 if is_keyed_augmentation(layer)]
    handlers += [(layer, KEYED_NOISE) for layer in model._flatten_layers(include_self=False)
                 if is_keyed_noise(layer)]
    return Plan("batched", handlers)
