"""Test double: Poisson draws forced to given records, step by step.

`force_draws(monkeypatch, draws)` makes every `PoissonSampler` draw step t's
records `draws[t % len(draws)]` (step numbers count from the model's steps
so far: 0, 1, ... for a new model). The forced draw goes through the real
padding, pipeline and train step; only the random choice is replaced, in
the TensorFlow graph like the real one.
"""

import numpy as np
import tensorflow as tf

from tfdp.data import PoissonSampler


def force_draws(monkeypatch, draws):
    lengths = [len(draw) for draw in draws]
    table = np.zeros((len(draws), max(max(lengths), 1)), np.int64)
    for row, draw in enumerate(draws):
        table[row, : len(draw)] = draw
    table, lengths = tf.constant(table), tf.constant(lengths, tf.int64)

    def sample_indices(self, key, step):
        row = step % len(draws)
        return table[row][: lengths[row]]

    monkeypatch.setattr(PoissonSampler, "sample_indices", sample_indices)
