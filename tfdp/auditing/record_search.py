"""Searches for the record that moves a DP step the most.

Both searches score every candidate with the real step's ratio
(`NeighbourStep.ratio`, one train step each) and keep the best.

* `gradient_ascent` moves the record's float inputs and float targets along
  the gradient of a smooth surrogate: the L2 norm of the record's clipped
  gradient as the mechanism computes it (`clipped_sum` of a one-record
  batch, divided by C), differentiated through the per-example pass with
  TensorFlow's autodiff. Each step moves every leaf by `rate` times its RMS
  along the normalised gradient, so records of any scale move.
* `discrete_search` changes token ids, labels and masks: random records
  first, then greedy changes of one entry at a time, kept when the ratio
  does not drop.

Example (the surrogate of a record whose gradient is clipped is 1):

>>> import keras, numpy as np, tfdp
>>> from tfdp.auditing.crafted_records import RecordSpace
>>> from tfdp.auditing.neighbour_step import NeighbourStep
>>> model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(1)])
>>> model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0), loss="mse")
>>> data = (np.ones((4, 3), "float32"), np.zeros((4, 1), "float32"))
>>> with NeighbourStep(model, data, records=3, batch_size=4, physical_batch_size=None) as step:
...     value, gradients = ClippedContribution(step, RecordSpace(data, 1))((np.full(3, 100.0),
...                                                                        np.zeros(1)))
>>> round(value, 5), [g.shape for g in gradients]
(1.0, [(3,), (1,)])
"""

import math

import numpy as np
import tensorflow as tf

from tfdp.per_example import compute_per_example_gradients


class ClippedContribution:
    """Value and gradient of ||clipped gradient of one record|| / C.

    Args:
        step: the entered `NeighbourStep` whose model and optimizer are used.
        space: the `RecordSpace`; gradients are taken for its float inputs
            and float targets.
    """

    def __init__(self, step, space):
        self.step = step
        self.watched = [i for i in space.indices(kind="float") if space.roles[i] in "xy"]
        self._function = tf.function(self._value_and_gradients, reduce_retracing=True,
                                     autograph=False)

    def _value_and_gradients(self, arrays):
        model, optimizer = self.step.model, self.step.optimizer
        leaves = tf.nest.flatten(arrays)
        watched = [leaves[i] for i in self.watched]
        with tf.GradientTape() as tape:
            tape.watch(watched)
            x, y = arrays[0], arrays[1]
            weights, loss_fn, targets = tf.ones([1]), model._per_example_loss, y
            if len(arrays) > 2 and arrays[2].shape.rank > 1:
                loss_fn, targets = model._per_token_loss, (y, arrays[2])
            elif len(arrays) > 2:
                weights = tf.cast(tf.reshape(arrays[2], [-1]), tf.float32)
            per_example, _, _ = compute_per_example_gradients(
                model, x, targets, weights, loss_fn, model.per_example_gradients
            )
            sums, _ = optimizer.clipped_sum(
                per_example, {"mask": tf.ones([1]), "expected_batch_size": tf.constant(1.0)}
            )
            value = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(s)) for s in sums]))
            value = value / optimizer.clip_norm()  # C_t with adaptive clipping
        return value, tape.gradient(value, watched)

    def __call__(self, record):
        """(value, gradients of the watched leaves as float64 arrays, or None
        where no gradient flows)."""
        batch = tf.nest.map_structure(lambda a: tf.constant(np.asarray(a)[None]),
                                      self.step.as_data(record))
        try:
            value, gradients = self._function(batch)
        finally:
            self.step.restore()  # the pass drew dropout masks: seed states moved
        # The vectorized path's gradient of an input is IndexedSlices (its
        # tf.vectorized_map gathers each example): made dense here.
        return float(value), [None if g is None
                              else tf.cast(tf.convert_to_tensor(g), tf.float64).numpy()[0]
                              for g in gradients]


def gradient_ascent(step, space, contribution, starts, steps, rate=0.5):
    """Normalised gradient ascent from each start; scored by the real ratio.

    Args:
        step: `NeighbourStep`.
        space: `RecordSpace`.
        contribution: `ClippedContribution` (None: nothing to move).
        starts: records to start from.
        steps: total ascent steps (real train steps), shared by the starts.
        rate: step length as a fraction of each leaf's RMS.

    Returns:
        (ratio, record, evaluations) of the best record found, or
        (0.0, None, 0) when nothing moved.
    """
    best = (0.0, None)
    evaluations = 0
    per_start = max(1, steps // max(1, len(starts)))
    for start in starts:
        record = start
        for _ in range(per_start):
            if evaluations >= steps:
                break
            _, gradients = contribution(record)
            leaves = space.leaves(record)
            moved = False
            for index, gradient in zip(contribution.watched, gradients):
                scale = math.sqrt(float(np.mean(np.square(gradient)))) if gradient is not None else 0.0
                if not (math.isfinite(scale) and scale > 0):
                    continue
                leaf = np.asarray(leaves[index], np.float64)
                size = math.sqrt(float(np.mean(np.square(leaf))))
                size = size if math.isfinite(size) and size > 0 else 1.0
                leaves[index] = leaf + rate * size * gradient / scale
                moved = True
            if not moved:
                break
            record = space.pack(leaves)
            ratio = step.ratio(record)
            evaluations += 1
            if best[1] is None or ratio > best[0]:
                best = (ratio, record)
    return best[0], best[1], evaluations


def discrete_search(step, space, base, steps, rng):
    """Random, then greedy one-entry changes of int and bool leaves.

    Returns:
        (ratio, record, evaluations); (0.0, None, 0) without such leaves.
    """
    indices = [i for i in space.indices() if space.kinds[i] in ("int", "bool")]
    if not indices or steps < 1:
        return 0.0, None, 0
    best_ratio, best = -1.0, None
    for _ in range(max(1, steps // 2)):
        leaves = space.leaves(base)
        for i in indices:
            leaves[i] = np.asarray(space.random_value(i, rng, np.shape(leaves[i])), leaves[i].dtype)
        record = space.pack(leaves)
        ratio = step.ratio(record)
        if ratio >= best_ratio:
            best_ratio, best = ratio, record
    for _ in range(steps - max(1, steps // 2)):
        leaves = space.leaves(best)
        i = indices[rng.integers(len(indices))]
        leaf = leaves[i].reshape(-1)
        leaf[rng.integers(leaf.size)] = space.random_value(i, rng)
        record = space.pack(leaves)
        ratio = step.ratio(record)
        if ratio >= best_ratio:
            best_ratio, best = ratio, record
    return best_ratio, best, steps
