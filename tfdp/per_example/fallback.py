"""Per-layer fallback: per-example gradients of one layer by its own vjp.

A layer with weights and no rule is called normally in the batched pass; its
inputs are recorded and its outputs probed. Its per-example gradients are
then the vjp of that layer alone, run on each example's recorded inputs with
that example's output gradient, vectorized over examples
(`tf.vectorized_map`). Only this layer is re-run per example, not the model.

The re-run draws its own randomness: a layer that is random inside (its own
dropout) gets the gradient of a fresh draw, still one example's alone.

Example:

>>> import keras, tensorflow as tf
>>> from tfdp.per_example.recorder import Recorder
>>> layer = keras.layers.PReLU()
>>> layer.build((None, 3))
>>> with tf.GradientTape() as tape:
...     recorder = Recorder(tape)
...     with recorder.hooked([(layer, LayerFallback())]):
...         total = tf.reduce_sum(layer(-tf.ones([2, 3])))
>>> recorder.compute_gradients(total)
>>> LayerFallback().parts(layer, recorder.records_of(layer))[0].sq_norms().numpy().round(4)
array([3., 3.], dtype=float32)
"""

import numpy as np
import tensorflow as tf

from tfdp.per_example.grads import MaterializedGrads
from tfdp.per_example.onednn import vectorized_map
from tfdp.per_example.rules.common import sum_per_example


def _as_tensor(value):
    """Arrays and tensors as tensors; Python values (flags, None) unchanged."""
    if isinstance(value, (tf.Tensor, tf.Variable, np.ndarray)):
        return tf.convert_to_tensor(value)
    return value


class LayerFallback:
    """The vectorized vjp of a single layer (see the module docstring)."""

    def call(self, layer, recorder, call, *args, **kwargs):
        args, kwargs = tf.nest.map_structure(_as_tensor, (args, kwargs))
        outputs = call(*args, **kwargs)
        record = recorder.record(layer, call=call, inputs=(args, kwargs))
        flat = tf.nest.flatten(outputs)
        probed = [
            record.probe(str(i), t) if t.dtype.is_floating else t for i, t in enumerate(flat)
        ]
        return tf.nest.pack_sequence_as(outputs, probed)

    def parts(self, layer, records):
        variables = [v for v in layer.variables if v.trainable]
        per_call = [self._per_example(layer, record) for record in records]
        return [MaterializedGrads(variables, [sum_per_example(list(g)) for g in zip(*per_call)])]

    @staticmethod
    def _per_example(layer, record):
        variables = [v for v in layer.variables if v.trainable]
        flat = tf.nest.flatten(record.inputs)
        batched = [i for i, v in enumerate(flat) if isinstance(v, tf.Tensor) and v.shape.rank]
        names = sorted(record.grads, key=int)
        output_grads = [record.grads[name] for name in names]

        def one_example(example):
            tensors, grads = example
            values = list(flat)
            for i, t in zip(batched, tensors):
                values[i] = t[None]
            args, kwargs = tf.nest.pack_sequence_as(record.inputs, values)
            with tf.GradientTape() as tape:
                outputs = record.call(*args, **kwargs)
            floats = [t for t in tf.nest.flatten(outputs) if t.dtype.is_floating]
            return tape.gradient(
                floats, variables,
                output_gradients=[tf.cast(g[None], f.dtype) for g, f in zip(grads, floats)],
                unconnected_gradients="zero",
            )

        return vectorized_map(one_example, ([flat[i] for i in batched], output_grads),
                              f"layer '{layer.name}' ({type(layer).__name__}, per-layer fallback)")
