"""The seeds a model's random layers draw in a physical chunk: the step's,
the same in every chunk.

A step in physical chunks runs the model once a chunk, and each run's
`SeedGenerator.next()` advances the layer's generator: an example moved to
a later chunk (a record drawn before it) would draw with a later seed, and
get another mask or transform, whether the layer is keyed per example
(dropout, noise, augmentation on the batched pass) or Keras's own (the
whole-model vectorized path, the per-layer fallback's re-run). Inside
`chunk_keys` (the chunked step holds it around its loop) a generator's
`next()` instead returns its state where the step began, offset by the
call's rank among the chunk's draws from it, and writes nothing: the same
seeds for every chunk. The step then sets the state one step past where it
began.

Example:

>>> import keras
>>> generator = keras.random.SeedGenerator(0)
>>> began = generator.state.value
>>> with chunk_keys([(generator, began)]):
...     first, second = generator.next(), generator.next()
...     restart_chunk()
...     again = generator.next()
>>> [bool((a == b).numpy().all()) for a, b in ((first, began), (again, first), (second, first))]
[True, True, False]
"""

import contextlib
import functools

import tensorflow as tf

_CALLS = []  # the open block's count of draws a generator, this chunk


def _chunk_next(generator, began, ordered=True):
    calls = _CALLS[-1]
    rank = calls.get(id(generator), 0)
    calls[id(generator)] = rank + 1
    return began + tf.constant([0, 1], began.dtype) * rank


@contextlib.contextmanager
def chunk_keys(generators):
    """Within the block, each of `generators` ((SeedGenerator, its state's
    value where the step began) pairs) draws the step's seeds, counted by
    call since the last `restart_chunk`."""
    _CALLS.append({})
    for generator, began in generators:
        generator.__dict__["next"] = functools.partial(_chunk_next, generator, began)
    try:
        yield
    finally:
        for generator, _ in generators:
            generator.__dict__.pop("next", None)
        _CALLS.pop()


def restart_chunk():
    """Counts draws afresh: a new chunk's first draw from each generator is
    the step's first seed again."""
    if _CALLS:
        _CALLS[-1].clear()
