"""The Keras layers a declared layer holds, read at the ranks its call feeds them.

`declare_per_example` vouches for a custom layer's own computation; the
allow-listed Keras layers it holds (which rules may run on the batch,
`sublayers_on_the_batch`) are read like a graph's, by
`configuration.configuration_problem`. Their axes mean something only
against the rank of what they are called on, and a weightless layer
(Softmax, Activation, UnitNormalization) records no input shape: its axis
-1 is the batch axis of a [B] tensor, one value an example. The ranks come
from replaying the declared layer's recorded calls symbolically, each held
layer's `call` wrapped to note its input's rank. A held layer the replay
does not reach (a branch it did not take, a declared layer with no
recorded call, a replay that fails) is read without a rank, as
`configuration_problem` reads it: only axes that cannot be the batch's
pass.

Example:

>>> import keras, tfdp
>>> @tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
... class Weighting(keras.layers.Layer):
...     def __init__(self):
...         super().__init__()
...         self.score, self.norm = keras.layers.Dense(1), keras.layers.Softmax()
...     def call(self, x):  # a softmax over the batch's scores: mixes examples
...         return x * self.norm(self.score(x)[:, 0])[:, None]
>>> block = Weighting()
>>> _ = keras.Sequential([keras.Input((3,)), block])
>>> held_layer_problem(block)[1]
'reduces over the batch axis (axis=-1)'
"""

from keras.src import backend, tree

from tfdp.per_example.configuration import configuration_problem
from tfdp.per_example.registry import ALLOWED


def _first_rank(args, kwargs):
    """Rank of the first tensor among a call's arguments (or None)."""
    for value in tree.flatten((args, kwargs)):
        shape = getattr(value, "shape", None)
        if shape is not None and hasattr(value, "dtype"):
            return len(shape)
    return None


def call_ranks(layer, held):
    """{id(sub): set of input ranks} of each layer in `held` over a symbolic
    replay of `layer`'s recorded calls; {} when it has none or the replay
    fails."""
    nodes = getattr(layer, "_inbound_nodes", None) or []
    if not nodes:
        return {}
    ranks = {id(sub): set() for sub in held}
    installed = []
    try:
        for sub in held:
            def noted(*args, _sub=sub, _call=sub.call, **kwargs):
                rank = _first_rank(args, kwargs)
                if rank is not None:
                    ranks[id(_sub)].add(rank)
                return _call(*args, **kwargs)

            object.__setattr__(sub, "call", noted)
            installed.append(sub)
        for node in nodes:
            backend.compute_output_spec(layer.call, *node.arguments.args,
                                        **node.arguments.kwargs)
    except Exception:  # noqa: BLE001 - no ranks: every held layer is read without one
        return {}
    finally:
        for sub in installed:
            object.__delattr__(sub, "call")
    return ranks


def held_layer_problem(layer):
    """(held layer, why it may mix examples) for the first allow-listed
    Keras layer inside declared `layer` whose configuration may, at a rank
    the replay saw it called with (or without a rank where it saw none);
    None when there is none."""
    held = [sub for sub in layer._flatten_layers(include_self=False) if type(sub) in ALLOWED]
    ranks = call_ranks(layer, held)
    for sub in held:
        for rank in sorted(ranks.get(id(sub), ())) or [None]:
            problem = configuration_problem(sub, rank=rank)
            if problem:
                return sub, problem
    return None
