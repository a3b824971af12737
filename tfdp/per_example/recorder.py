"""The one batched forward and backward pass that per-example rules read.

While the model runs on the whole batch, every layer with a rule (or the
per-layer fallback) is called through its handler instead of its own `call`.
The handler computes the layer's output itself, adding a zero "probe" tensor
where it needs the gradient (a pre-activation, an embedding lookup, each time
step's gate pre-activations) and recording the inputs it needs. The gradient
of the weighted loss sum with respect to a probe is each example's gradient
at that point, since no layer on the allow-list mixes examples.

Example:

>>> import keras, tensorflow as tf
>>> from tfdp.per_example.rules import dense
>>> layer = keras.layers.Dense(2)
>>> layer.build((None, 3))
>>> with tf.GradientTape() as tape:
...     recorder = Recorder(tape)
...     with recorder.hooked([(layer, dense.DenseRule())]):
...         out = layer(tf.ones([4, 3]))
...     total = tf.reduce_sum(out)
>>> recorder.compute_gradients(total)
>>> recorder.records_of(layer)[0].grads["z"].shape
TensorShape([4, 2])
"""

import contextlib
import functools

import tensorflow as tf

from tfdp.per_example.call_hooks import hooked_calls


class Record:
    """Tensors one call of a layer recorded, and its probes' gradients.

    Attributes:
        values: dict of tensors recorded in the forward pass.
        grads: dict name -> gradient of the loss sum at that probe, filled by
            `Recorder.compute_gradients`.
    """

    def __init__(self, recorder, values):
        self._recorder = recorder
        self.values = values
        self.probes = {}
        self.grads = {}

    def probe(self, name, tensor):
        """Returns `tensor + 0` whose gradient will be `grads[name]`."""
        probe = tf.zeros_like(tensor)
        self._recorder.tape.watch(probe)
        self.probes[name] = probe
        return tensor + probe

    def __getattr__(self, name):
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)


class Recorder:
    """Runs layer calls through handlers and collects their records.

    Args:
        tape: the `tf.GradientTape` recording the batched pass.
        example_keys: int64 [B], a hash of each example's inputs, which
            layers keyed per example draw by (`keyed_noise.input_keys`).
    """

    def __init__(self, tape, example_keys=None):
        self.tape = tape
        self.example_keys = example_keys
        self._records = {}

    def record(self, layer, **values):
        """A new `Record` of one call of `layer`."""
        record = Record(self, values)
        self._records.setdefault(id(layer), []).append(record)
        return record

    def records_of(self, layer):
        """The records of every call of `layer`, in call order."""
        return self._records.get(id(layer), [])

    @contextlib.contextmanager
    def hooked(self, handlers):
        """Routes each `layer.call` through `handler.call` while open.

        Args:
            handlers: list of (layer, handler); the handler is called as
                `handler.call(layer, recorder, original_call, *args, **kwargs)`.
        """
        def through(layer, handler):
            return lambda call: functools.partial(handler.call, layer, self, call)

        with hooked_calls([(layer, through(layer, handler)) for layer, handler in handlers]):
            yield self

    def compute_gradients(self, total):
        """Fills every record's `grads` with d total / d probe."""
        records = [r for calls in self._records.values() for r in calls]
        probes = [(r, name, p) for r in records for name, p in r.probes.items()]
        grads = self.tape.gradient(
            total, [p for _, _, p in probes], unconnected_gradients="zero"
        )
        for (record, name, _), grad in zip(probes, grads):
            record.grads[name] = grad
