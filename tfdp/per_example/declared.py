"""The Keras layers a declared layer holds, read at the ranks they run on.

`declare_per_example` vouches for a custom layer's own computation; the
allow-listed Keras layers it holds (which rules may run on the batch,
`sublayers_on_the_batch`) are read like a graph's, by
`configuration.configuration_problem`. Their axes mean something only
against the rank of what they are called on, and a weightless layer
(Softmax, Activation, UnitNormalization) records no input shape: its axis
-1 is the batch axis of a [B] tensor, one value an example. Two reads:

* when the plan is made (`held_layer_problem`), each held layer that
  recorded its input's rank: one configured to mix examples sends the model
  to the vectorized path;
* when the DP step is traced (`held_calls_checked`), every call of every
  held layer, at the rank of the tensor it really receives (whatever
  branch, `training` value or static batch size the call takes): one that
  mixes examples is refused with `HeldLayerMixesExamples`, before the first
  step.

A call none of whose tensor arguments can be the batch (variables, and
tensors whose first axis has a static length where the step's batch has
none, or another one) is not read: a softmax over learned mixing weights
trains. Otherwise the layer is read at the rank of the first argument that
can be the batch, and an attention's inputs and masks one by one
(`configuration.attention_call_problem`).

Example:

>>> import keras, tensorflow as tf, tfdp
>>> @tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
... class Weighting(keras.layers.Layer):
...     def __init__(self):
...         super().__init__()
...         self.score, self.norm = keras.layers.Dense(1), keras.layers.Softmax(name="norm")
...     def call(self, x):  # a softmax over the batch's scores: mixes examples
...         return x * self.norm(self.score(x)[:, 0])[:, None]
>>> model = keras.Sequential([keras.Input((3,)), Weighting()])
>>> with held_calls_checked(model, batch_size=2):
...     model(tf.ones([2, 3]))
Traceback (most recent call last):
...
tfdp.per_example.declared.HeldLayerMixesExamples: ...Layer 'norm' (Softmax) held by ...
"""

import contextlib
import functools

import keras
import tensorflow as tf
from keras.src import tree

from tfdp.per_example.call_hooks import hooked_calls
from tfdp.per_example.configuration import (
    configuration_problem,
    first_axis_could_be_batch,
    layer_input_rank,
)
from tfdp.per_example.registry import _DECLARED, ALLOWED


class HeldLayerMixesExamples(ValueError):
    """A Keras layer held by a declared layer runs over the batch axis."""

    # AutoGraph re-raises an error from traced code as its own type only
    # when the type takes its message alone (else as a StagingError).
    __init__ = Exception.__init__


def held_layers(layer):
    """The allow-listed Keras layers inside `layer`, at any depth."""
    return [sub for sub in layer._flatten_layers(include_self=False) if type(sub) in ALLOWED]


def held_layer_problem(layer):
    """(held layer, why it mixes examples) for the first Keras layer inside
    declared `layer` whose configuration mixes examples at the input rank it
    recorded, or None. A layer that recorded no rank is read when the step
    is traced (`held_calls_checked`)."""
    for sub in held_layers(layer):
        rank = layer_input_rank(sub)
        if rank is None:
            continue
        problem = configuration_problem(sub, rank=rank)
        if problem:
            return sub, problem
    return None


def _tensor_shapes(args, kwargs):
    """Shapes of a call's tensor arguments that are not variables."""
    shapes = []
    for value in tree.flatten((args, kwargs)):
        if isinstance(value, (tf.Variable, keras.Variable)):
            continue
        shape = getattr(value, "shape", None)
        if shape is not None and hasattr(value, "dtype"):
            shapes.append(tf.TensorShape(shape))
    return shapes


def _checked(sub, owner, call, batch_size):
    def checked_call(*args, **kwargs):
        shapes = _tensor_shapes(args, kwargs)
        batched = [shape for shape in shapes if shape.rank is None
                   or (shape.rank > 0 and first_axis_could_be_batch(shape[0], batch_size))]
        if shapes and not batched:
            return call(*args, **kwargs)  # no argument can be the batch: nothing to mix
        rank = batched[0].rank if batched else None
        problem = configuration_problem(
            sub, rank=rank, call=(args, kwargs),
            could_be_batch=functools.partial(first_axis_could_be_batch, batch_size=batch_size))
        if problem:
            raise HeldLayerMixesExamples(
                f"Layer '{sub.name}' ({type(sub).__name__}) held by the declared layer "
                f"'{owner.name}' ({type(owner).__name__}) {problem} in the DP step: it mixes "
                "examples, so one record would move the others' clipped gradients and the "
                "privacy guarantee would not hold. Call it on tensors whose first axis is "
                "the batch and whose other axes are the features it normalizes, or remove "
                "the declaration (tfdp then runs the layer one example at a time). "
                f"Received: inputs of ranks {[shape.rank for shape in shapes]}")
        return call(*args, **kwargs)

    return checked_call


@contextlib.contextmanager
def held_calls_checked(model, batch_size=None):
    """Runs `model` with every call of a Keras layer held by a declared
    layer checked at the rank of its input (see the module). Hooks each
    such layer's `call` while open, around any hook already installed (the
    batched pass's rules), and puts the previous one back.

    Args:
        model: the model the DP step runs.
        batch_size: the batch's static size in the step, or None.
    """
    held = {}
    for owner in model._flatten_layers(include_self=False):
        if type(owner) in _DECLARED:
            for sub in held_layers(owner):
                held.setdefault(id(sub), (sub, owner))
    with hooked_calls([(sub, functools.partial(_checked, sub, owner, batch_size=batch_size))
                       for sub, owner in held.values()]):
        yield
