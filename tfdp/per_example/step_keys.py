"""The key a layer keyed per example draws for one call: the same in every
physical chunk of a step.

Layers keyed per example (random augmentation, dropout and noise layers)
draw one key a call from their seed generator and give example i the draws
of (key, a hash of example i). A step in physical chunks runs the layers
once a chunk, and each chunk's `next()` advances the generator: an example
moved to a later chunk (a record drawn before it) would get a later key, and
another mask. Inside `chunk_keys` (the chunked step holds it around its
loop) a call's key is instead the generator's state where the step began,
offset by the call's rank among the chunk's calls of that generator: the
same for every chunk. The step then sets the generator one step past where
it began.

Example:

>>> import keras
>>> generator = keras.random.SeedGenerator(0)
>>> began = generator.state.value
>>> with chunk_keys([(generator.state, began)]):
...     first, again = call_key(generator), call_key(generator)
>>> bool((first == began).numpy().all()), bool((again == first).numpy().all())
(True, False)
"""

import contextlib

import tensorflow as tf

_STEP = {"began": None, "calls": None}


@contextlib.contextmanager
def chunk_keys(seeds):
    """Within the block, `call_key` returns keys from the states `seeds`
    ((state variable, its value where the step began) pairs) held, counted
    by call."""
    previous = dict(_STEP)
    _STEP["began"] = {id(state): began for state, began in seeds}
    _STEP["calls"] = {}
    try:
        yield
    finally:
        _STEP.update(previous)


def restart_chunk():
    """Counts calls afresh: a new chunk's first call of each generator gets
    the step's first key again."""
    if _STEP["calls"] is not None:
        _STEP["calls"] = {}


def call_key(generator):
    """int64 [2]: the generator's `next()` (which advances it), or, inside
    `chunk_keys`, the step's starting state offset by this call's rank in
    the chunk (no write: the step sets the state afterwards)."""
    began = (_STEP["began"] or {}).get(id(generator.state))
    if began is None:
        return tf.cast(generator.next(), tf.int64)
    rank = _STEP["calls"].get(id(generator.state), 0)
    _STEP["calls"][id(generator.state)] = rank + 1
    return tf.cast(began, tf.int64) + tf.constant([0, 1], tf.int64) * rank
