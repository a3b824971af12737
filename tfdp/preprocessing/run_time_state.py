"""A cheap per-step token of the preprocessing state a DP step can see.

`tfdp.preprocessing.provenance` fingerprints each preprocessing layer's
whole state (a 20,000-word vocabulary takes about 0.4 s), so it checks it
when fit starts, at each epoch's start, when the step is traced and before
anything is written. Between those, a callback could adapt a layer on the
raw private data for a few steps and restore it before the epoch ends. What
those steps can see of a layer is of two kinds:

- what the compiled step captured when it was traced (a lookup table, a
  `Normalization`'s mean tensor, `Discretization`'s boundaries): fixed for
  every step of that trace, and checked when it is traced;
- what it reads as it runs: variables (TF-IDF weights, an adaptable layer's
  own weights) and the contents of a mutable lookup table.

`token` lists the second kind, the values of those variables, plus which
lookup table each layer holds (a re-adapted lookup holds a new one: no
retrace runs on it unchecked), so comparing two tokens before every step
costs a read of those variables, not a fingerprint of the vocabulary.

Example:

>>> import keras, numpy as np
>>> norm = keras.layers.Normalization()
>>> norm.adapt(np.array([[1.0], [3.0]]))
>>> before = token([norm])
>>> same(before, token([norm]))
True
>>> norm.adapt(np.array([[5.0], [9.0]]))
>>> same(before, token([norm]))
False
"""

import numpy as np
import tensorflow as tf


def token(layers):
    """What the running step reads of `layers`' state, and which lookup
    tables they hold.

    Args:
        layers: Keras layers holding data-derived state (their sublayers
            are included).

    Returns:
        A list to compare with `same`.
    """
    variables, tables, seen = [], [], set()
    for root in layers:
        for layer in root._flatten_layers(include_self=True):  # pylint: disable=protected-access
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            variables += [getattr(v, "value", v) for v in layer.variables]
            variables += [v for v in vars(layer).values() if isinstance(v, tf.Variable)]
            table = getattr(layer, "lookup_table", None)
            if table is not None:
                tables.append(table)
    # One call reads them all: a third of the time of one read each.
    found = [np.array(t, copy=True) for t in _read(variables)] if variables else []
    for table in tables:
        found.append(table)  # a new table (a lookup adapted again): compared by identity
        if not isinstance(table, tf.lookup.StaticHashTable):  # its contents can change
            found.extend(np.array(t, copy=True) for t in table.export())
    return found


def same(first, second):
    """Whether two `token`s are equal."""
    return len(first) == len(second) and all(
        a is b if not isinstance(a, np.ndarray) else (
            isinstance(b, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype
            and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
        for a, b in zip(first, second))


@tf.function(autograph=False)
def _read(variables):
    return [tf.identity(variable) for variable in variables]
