"""A layer's `call` run through other code for the length of a pass.

Three parts of the batched pass hook layers' calls: the rules
(`Recorder.hooked`), the inference-mode checks (`inference_mode_calls`) and
the declared layers' checks (`declared.held_calls_checked`). Each sets
`call` on the layer instance over whatever was there (an earlier hook, or
a `call` the user set) and puts that back when the pass ends.

Example:

>>> import keras, tensorflow as tf
>>> layer = keras.layers.Activation("relu")
>>> with hooked_calls([(layer, lambda call: lambda x: 2.0 * call(x))]):
...     float(layer(tf.constant([1.0]))[0])
2.0
>>> "call" in layer.__dict__
False
"""

import contextlib


@contextlib.contextmanager
def hooked_calls(hooks):
    """Sets `layer.call = wrap(layer.call)` for each (layer, wrap) while open,
    and puts back each layer's previous instance `call` (or none), last
    hooked first.

    Args:
        hooks: iterable of (layer, wrap), wrap taking the current `call`
            and returning the one to run.
    """
    installed = []
    try:
        for layer, wrap in hooks:
            hooked = wrap(layer.call)
            installed.append((layer, layer.__dict__.get("call")))
            object.__setattr__(layer, "call", hooked)
        yield
    finally:
        for layer, previous in reversed(installed):
            if previous is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", previous)
