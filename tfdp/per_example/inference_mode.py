"""Trainable BatchNormalization in the DP step: only in inference mode.

A `BatchNormalization` called with `training=False` is a per-example affine
map, y = gamma * (x - moving_mean) / sqrt(moving_variance + epsilon) + beta:
its gamma and beta have exact per-example gradients
(`tfdp.per_example.rules.batch_normalization`) and its moving statistics do
not move. Called with `training=True` (or with `training` left unspecified
under `fit`, which means True), a trainable one normalizes with the batch's
statistics, which mixes examples, and writes its moving statistics, which
would store the training data. `inference_mode_calls` runs the DP step's
forward pass with every call of a trainable BatchNormalization (or of an
instance of a subclass) checked at trace time, `training` read whether it
is passed by keyword or by position: a call in training mode is refused,
naming the layer.

keras.io's fine-tuning recipe calls a pretrained base with `training=False`
inside a Functional model (`x = base_model(inputs, training=False)`).
Keras 3.15's Functional models pass the outer call's `training=True` to each
node instead, overriding that argument (keras-team/keras#20285; newer Keras
lets the node's own argument win, keras-team/keras#23364). In the DP step
tfdp honours it as written: a layer whose every call in the model's graphs
passes `training=False` runs with `training=False`.

Example:

>>> import keras, tensorflow as tf
>>> inputs = keras.Input((3,))
>>> norm = keras.layers.BatchNormalization(name="bn")
>>> model = keras.Model(inputs, norm(inputs))
>>> with inference_mode_calls(model):
...     model(tf.ones([2, 3]), training=True)
Traceback (most recent call last):
...
tfdp.per_example.inference_mode.BatchNormalizationInTraining: ...Layer 'bn' (BatchNormalization) is trainable and runs in training mode ...
>>> model = keras.Model(inputs, norm(inputs, training=False))
>>> with inference_mode_calls(model):
...     model(tf.ones([2, 3]), training=True).shape
TensorShape([2, 3])
"""

import contextlib
import functools
import inspect

import keras
import numpy as np

from tfdp.per_example.call_hooks import hooked_calls


class BatchNormalizationInTraining(ValueError):
    """A trainable BatchNormalization called in training mode in the DP step."""

    # AutoGraph re-raises an error from traced code as its own type only
    # when the type takes its message alone (else as a StagingError).
    __init__ = Exception.__init__


def is_trainable_batch_normalization(layer):
    """True for a Keras BatchNormalization, or an instance of a subclass,
    with `trainable=True` (Keras normalizes such a layer with the batch when
    `training` is True)."""
    return isinstance(layer, keras.layers.BatchNormalization) and layer.trainable


def check_inference_call(layer, training):
    """Refuses a call of a trainable BatchNormalization that is not in
    inference mode (`training` False, or None: Keras's default, inference).

    Raises:
        BatchNormalizationInTraining: a ValueError naming the layer and the
            `training` value received.
    """
    if not is_trainable_batch_normalization(layer):
        return
    if training is None or (isinstance(training, (bool, np.bool_)) and not training):
        return
    raise BatchNormalizationInTraining(
        f"Layer '{layer.name}' ({type(layer).__name__}) is trainable and runs in training "
        "mode in the DP step: it normalizes with the batch's statistics, so every "
        "example's output depends on the others and per-example gradients (and DP "
        "clipping) are undefined, and it writes its moving statistics, which would "
        "store the training data. Under fit, `training` left unspecified means True. "
        "Call it (or the model that holds it) with training=False: it then runs as a "
        "per-example affine map with fixed statistics and its gamma and beta train. "
        "Or freeze it (`layer.trainable = False`), or replace it with "
        "`tfdp.per_example.fix_batch_normalization(model)` (GroupNormalization). "
        f"Received: training={training!r}"
    )


def _graph_models(model):
    from tfdp.per_example.registry import is_graph_model

    return [layer for layer in model._flatten_layers(include_self=True)  # pylint: disable=protected-access
            if is_graph_model(layer)]


def _inference_layers(model):
    """Layers whose every call in the model's graphs passes training=False."""
    flags = {}
    for graph_model in _graph_models(model):
        graph = getattr(graph_model, "_functional", None) or graph_model
        for nodes in getattr(graph, "_nodes_by_depth", {}).values():
            for node in nodes:
                operation = node.operation
                if isinstance(operation, keras.layers.Layer) and getattr(
                        operation, "_call_has_training_arg", False):
                    value = node.arguments.kwargs.get("training", None)
                    # A node records the signature's default when the call
                    # omits `training`: False is written by the user only
                    # where the default is not False (Dropout's and the
                    # recurrent layers' default is False: they keep the
                    # step's training=True, their dropout on).
                    explicit_false = (isinstance(value, (bool, np.bool_)) and not value
                                      and _training_default(operation) is not False)
                    flags.setdefault(id(operation), [operation, True])[1] &= explicit_false
    return [layer for layer, all_false in flags.values() if all_false]


def batch_normalizations_in_training(model):
    """The trainable BatchNormalization layers that are nodes of `model`'s
    graphs and are not called, by themselves or by a graph that holds them,
    with `training=False`: the DP step would refuse them when traced
    (`check_inference_call`). One inside a custom layer's own `call()` is
    not listed: only tracing the step tells how it is called."""
    covered = {id(sub) for layer in _inference_layers(model)
               for sub in layer._flatten_layers(include_self=True)}  # pylint: disable=protected-access
    found = {}
    for graph_model in _graph_models(model):
        graph = getattr(graph_model, "_functional", None) or graph_model
        for nodes in getattr(graph, "_nodes_by_depth", {}).values():
            for node in nodes:
                layer = node.operation
                if is_trainable_batch_normalization(layer) and id(layer) not in covered:
                    found[id(layer)] = layer
    return list(found.values())


def _training_default(layer):
    """The default of `training` in the layer class's `call` (None if none)."""
    parameter = inspect.signature(type(layer).call).parameters.get("training")
    return None if parameter is None or parameter.default is parameter.empty else parameter.default


@contextlib.contextmanager
def inference_mode_calls(model):
    """Runs `model`'s calls in the DP step with (1) the explicit
    `training=False` of its graphs' nodes honoured and (2) every call of a
    trainable BatchNormalization checked (`check_inference_call`).

    Hooks each such layer's `call` while open, around any hook already
    installed (the batched pass's rules), and puts the previous one back.
    """
    forced = {id(layer): layer for layer in _inference_layers(model)}
    checked = {id(layer): layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
               if is_trainable_batch_normalization(layer)}
    with hooked_calls([(layer, functools.partial(_hooked, layer, force=key in forced))
                       for key, layer in {**forced, **checked}.items()]):
        yield


def _hooked(layer, call, force):
    # The class's own signature: `call` may be an earlier hook's (*args, **kwargs).
    signature = inspect.signature(type(layer).call)
    named = "training" in signature.parameters
    rest = next((name for name, parameter in signature.parameters.items()
                 if parameter.kind is parameter.VAR_KEYWORD), None)

    def hooked_call(*args, **kwargs):
        try:  # `training` may come positionally, as in `bn.call(x, True)`
            bound = signature.bind_partial(layer, *args, **kwargs)
        except TypeError:  # the call itself raises the error
            return call(*args, **kwargs)
        # An omitted `training` is the signature's default (a subclass's
        # `training=True`), not None.
        bound.apply_defaults()
        arguments = bound.arguments
        holder = arguments if named or rest is None else arguments.setdefault(rest, {})
        if force:
            holder["training"] = False
            args, kwargs = bound.args[1:], bound.kwargs
        check_inference_call(layer, holder.get("training"))
        return call(*args, **kwargs)

    return hooked_call
