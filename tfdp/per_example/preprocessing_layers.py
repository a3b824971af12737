"""Keras preprocessing layers that map each example on its own.

Lookups (`StringLookup`, `IntegerLookup`), `Hashing`, `Discretization`,
`CategoryEncoding` and `TextVectorization` compute each example's output
from that example's values and the layer's fixed state (a vocabulary, IDF
weights, bin boundaries), with no trainable weight, so the batched
per-example pass stays exact. One exception: a `TextVectorization` with
`output_mode="int"` and no `output_sequence_length` pads every text to the
longest one in the batch, so an example's output (its padding) depends on
the other examples; it is not on the list (set `output_sequence_length`).
Nor is one with `ragged=True`: its rows keep their own lengths, and the
first operation that makes them dense pads them all to the batch's longest.

Their state itself must come from private or public data
(`tfdp.preprocessing`), which `fit` checks separately.

Example:

>>> import keras
>>> keeps_examples_independent(keras.layers.TextVectorization(output_sequence_length=8))
True
>>> keeps_examples_independent(keras.layers.TextVectorization())
False
>>> keeps_examples_independent(keras.layers.TextVectorization(output_sequence_length=8,
...                                                           ragged=True))
False
"""

import keras

_L = keras.layers
_ELEMENTWISE = (_L.StringLookup, _L.IntegerLookup, _L.Hashing, _L.Discretization,
                _L.CategoryEncoding)


def keeps_examples_independent(layer):
    """True for a preprocessing layer whose output for an example is that example's alone."""
    if type(layer) in _ELEMENTWISE:
        return True
    if type(layer) is _L.TextVectorization:
        # pylint: disable=protected-access
        if layer._ragged:
            return False
        return layer._output_mode != "int" or layer._output_sequence_length is not None
    return False
