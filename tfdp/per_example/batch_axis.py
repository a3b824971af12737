"""Whether a declared layer runs its sublayers on the batch, or on other tensors.

The batched pass looks into a layer without weights of its own and runs each
sublayer with weights through its rule, which reads axis 0 of the sublayer's
input as the examples. That holds for Keras's composite layers
(MultiHeadAttention's projections) but not for every layer a user declares
per-example: keras.io's `TokenAndPositionEmbedding` looks up
`positions = range(maxlen)`, a tensor without the batch axis, so an Embedding
rule there read positions as examples (a ratio of 1.022 against the bound
when the sequence was as long as the batch). `sublayers_off_the_batch` runs
the layer symbolically on its own inputs, whose batch axis is unknown (None),
and names every sublayer that receives a first input with a known first axis:
such a layer takes the per-layer fallback (its own vjp per example) instead.

Example:

>>> import keras
>>> from keras import ops
>>> class Positions(keras.layers.Layer):
...     def __init__(self, **kwargs):
...         super().__init__(**kwargs)
...         self.table = keras.layers.Embedding(4, 2)
...     def call(self, x):
...         return x + self.table(ops.arange(4))
>>> layer = Positions()
>>> _ = layer(keras.Input((4, 2)))
>>> sublayers_off_the_batch(layer)
['embedding']
"""

import tensorflow as tf
from keras.src import backend


def sublayers_off_the_batch(layer):
    """Names of `layer`'s sublayers that its call runs on a tensor whose
    first axis is not the (unknown) batch axis, or None when the layer has no
    symbolic inputs to run it on (never called in a Functional graph)."""
    nodes = getattr(layer, "_inbound_nodes", None) or []
    calls = [node.arguments for node in nodes if getattr(node, "arguments", None) is not None]
    if not calls:
        return None
    found = []
    sublayers = list(layer._flatten_layers(include_self=False, recursive=True))  # pylint: disable=protected-access

    def recording(sublayer, call):
        def record(*args, **kwargs):
            first = tf.nest.flatten(args[:1] or list(kwargs.values())[:1])
            if any(getattr(t, "shape", None) is not None and t.shape.rank
                   and t.shape[0] is not None for t in first):
                found.append(sublayer.name)
            return call(*args, **kwargs)
        return record

    for sublayer in sublayers:
        object.__setattr__(sublayer, "call", recording(sublayer, sublayer.call))
    try:
        for arguments in calls:
            backend.compute_output_spec(layer.call, *arguments.args, **arguments.kwargs)
    except Exception:  # pylint: disable=broad-except
        return None  # cannot tell: the caller takes the safe path
    finally:
        for sublayer in sublayers:
            object.__delattr__(sublayer, "call")
    return sorted(set(found))
