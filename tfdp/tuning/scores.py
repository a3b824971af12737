"""A trial's score: a noisy count on private data, or an exact one on public data.

Each validation record adds a per-example score clipped to [0, 1] (NaN counts
0): for accuracy, 1 for a correct prediction. On private data the sum gets
Gaussian noise N(0, sigma^2) before it is divided by the (public) number of
records, so adding or removing one record moves the sum by at most 1 and the
release is `GaussianDpEvent(sigma)`; the noise comes from float64 normals
(full tails). On data the user declares public the score is exact and free.

Example:

>>> import numpy as np
>>> y_true = np.array([0, 1, 2, 1])
>>> y_pred = np.eye(3)[[0, 1, 1, 1]]
>>> accuracy(y_true, y_pred).tolist()
[1.0, 1.0, 0.0, 1.0]
>>> score, event = release_score(accuracy(y_true, y_pred), None, np.random.default_rng(0))
>>> score, event
(0.75, None)
"""

import dp_accounting
import numpy as np


def accuracy(y_true, y_pred):
    """1.0 where the arg-max class equals the label (integer or one-hot), else 0.0."""
    y_pred = np.asarray(y_pred)
    if y_pred.ndim != 2 or y_pred.shape[-1] < 2:
        raise ValueError(
            "The default score (accuracy) needs class scores of shape (n, classes >= 2); "
            "pass score=fn(y_true, y_pred) returning one value in [0, 1] per example. "
            f"Received: predictions of shape {y_pred.shape}"
        )
    y_true = np.asarray(y_true)
    labels = y_true.argmax(-1) if y_true.ndim == 2 and y_true.shape[-1] == y_pred.shape[-1] \
        else y_true.reshape(len(y_pred))
    return (y_pred.argmax(-1) == labels).astype(np.float64)


def per_example(score, y_true, y_pred):
    """`score(y_true, y_pred)` as float64 values in [0, 1] (NaN -> 0), one per example."""
    values = np.asarray(score(y_true, y_pred), dtype=np.float64).reshape(-1)
    if values.shape[0] != len(y_pred):
        raise ValueError(
            "`score` must return one value per validation example. Received: "
            f"{values.shape[0]} values for {len(y_pred)} examples"
        )
    return np.clip(np.nan_to_num(values, nan=0.0, posinf=1.0, neginf=0.0), 0.0, 1.0)


def release_score(values, noise_multiplier, rng):
    """(score, event): the mean of `values`, noised when `noise_multiplier` is set.

    Args:
        values: per-example scores in [0, 1] (`per_example`).
        noise_multiplier: sigma of the Gaussian noise on their sum, or None
            for public data (exact, no event).
        rng: a `numpy.random.Generator`.

    Returns:
        The score (a float) and `GaussianDpEvent(sigma)`, or None when public.
    """
    total = float(np.sum(values))
    if noise_multiplier is None:
        return total / len(values), None
    total += float(rng.normal(0.0, noise_multiplier))
    return total / len(values), dp_accounting.GaussianDpEvent(noise_multiplier)
