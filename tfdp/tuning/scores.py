"""A trial's score: a noisy count on private data, or an exact one on public data.

Each validation record adds a per-example score clipped to [0, 1] (NaN counts
0): for accuracy, 1 for a correct prediction. The model predicts each record
alone (`predict_each`) and the score function sees one record at a time
(`per_example`), so no record changes another's score, whatever the layers or
the score do with a batch. On private data the sum gets Gaussian noise
N(0, sigma^2) before it is divided by a public number of records (a split's
expected size), so adding or removing one record moves the sum by at most 1
and the release is `GaussianDpEvent(sigma)`; the noise comes from float64
normals (full tails). On data the user declares public the score is exact
and free.

Example:

>>> import numpy as np
>>> y_true = np.array([0, 1, 2, 1])
>>> y_pred = np.eye(3)[[0, 1, 1, 1]]
>>> accuracy(y_true, y_pred).tolist()
[1.0, 1.0, 0.0, 1.0]
>>> score, event = release_score(accuracy(y_true, y_pred), 4, None, np.random.default_rng(0))
>>> score, event
(0.75, None)
"""

import dp_accounting
import numpy as np

from tfdp.mechanisms import gaussian
from tfdp.tuning.hiding import Refusal


def accuracy(y_true, y_pred):
    """1.0 where the arg-max class equals the label (integer or one-hot), else 0.0."""
    y_pred = np.asarray(y_pred)
    if y_pred.ndim != 2 or y_pred.shape[-1] < 2:
        raise Refusal(
            "The default score (accuracy) needs class scores of shape (n, classes >= 2); "
            "pass score=fn(y_true, y_pred) returning one value in [0, 1] per example. "
            f"Received: predictions of shape {y_pred.shape}"
        )
    y_true = np.asarray(y_true)
    labels = y_true.argmax(-1) if y_true.ndim == 2 and y_true.shape[-1] == y_pred.shape[-1] \
        else y_true.reshape(len(y_pred))
    return (y_pred.argmax(-1) == labels).astype(np.float64)


def predict_each(model, x):
    """`model`'s predictions for the records of `x`, each record run alone.

    A batched `predict` lets a layer that mixes the batch at inference move
    every record's prediction with one record; eager calls on one record
    each also trace nothing (a traced predict per trial would count trials
    in TensorFlow's retracing warnings).

    Example:

    >>> import keras
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    >>> predict_each(model, np.zeros((4, 2))).shape
    (4, 3)
    """
    if len(x) == 0:
        return np.zeros((0,) + tuple(model.outputs[0].shape[1:]), "float32")
    return np.concatenate([np.asarray(model(x[i:i + 1], training=False)) for i in range(len(x))])


def per_example(score, y_true, y_pred):
    """`score` of every example, called on that example alone, as float64
    values in [0, 1] (NaN -> 0).

    `score(y_true, y_pred)` gets a batch of one example and must return one
    value per example (shape (1,)); a reduced scalar is refused.
    """
    values = np.zeros(len(y_pred), np.float64)
    for i in range(len(y_pred)):
        value = np.asarray(score(y_true[i:i + 1], y_pred[i:i + 1]), dtype=np.float64)
        if value.shape != (1,):
            raise Refusal(
                "`score(y_true, y_pred)` must return one value per example (the search calls "
                "it on one example at a time, so that no example moves another's score). "
                f"Received: shape {value.shape} for 1 example"
            )
        values[i] = value[0]
    return np.clip(np.nan_to_num(values, nan=0.0, posinf=1.0, neginf=0.0), 0.0, 1.0)


def release_score(values, count, noise_multiplier, rng):
    """(score, event): the sum of `values` over the public `count`, noised
    when `noise_multiplier` is set.

    Args:
        values: per-example scores in [0, 1] (`per_example`).
        count: the public number the sum is divided by (a split's expected
            size: its realised size depends on the data).
        noise_multiplier: sigma of the Gaussian noise on their sum, or None
            for public data (exact, no event).
        rng: a `numpy.random.Generator`.

    Returns:
        The score (a float) and `GaussianDpEvent(sigma)`, or None when public.
    """
    total = float(np.sum(values))
    if noise_multiplier is None:
        return total / count, None
    total += float(gaussian.numpy_normal(rng, noise_multiplier))  # the whole tail
    return total / count, dp_accounting.GaussianDpEvent(noise_multiplier)
