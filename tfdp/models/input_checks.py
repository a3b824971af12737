"""Checks of `fit`'s arguments that name what is wrong before the first step.

Each function raises a ValueError naming the argument and the value
received; none of them reads more of the data than the check needs.

Example:

>>> import numpy as np
>>> as_array("x", [[1.0, 2.0], [3.0]])
Traceback (most recent call last):
...
ValueError: Expected `x` to be a rectangular numeric array (pad ragged rows to one length, or use a tfdp.data.RecordSource). Received: x with rows of different lengths
"""

import numpy as np


def as_array(name, value):
    """`np.asarray(value)`, refusing ragged and non-numeric data by name."""
    try:
        array = np.asarray(value)
    except ValueError:
        array = None
    if array is None or array.dtype == object:
        raise ValueError(
            f"Expected `{name}` to be a rectangular numeric array (pad ragged rows to "
            "one length, or use a tfdp.data.RecordSource). Received: "
            f"{name} with rows of different lengths"
        )
    if array.ndim == 0:
        raise ValueError(
            f"Expected `{name}` to have one entry per example. Received: {name}={value!r}"
        )
    return array


def check_label_values(y, units):
    """Labels are numbers; class indices fit a model with `units` outputs."""
    if y.dtype.kind not in "biuf":
        raise ValueError(
            "Expected numeric labels (class indices or targets); map strings to "
            f"class indices first. Received: y of dtype {y.dtype}"
        )
    is_index_vector = y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1)
    if not (units and units > 1 and is_index_vector and len(y)):
        return
    if y.dtype.kind == "f" and not np.all(np.isfinite(y) & (y == np.round(y))):
        return  # targets, not class indices
    low, high = y.min(), y.max()
    if low < 0 or high >= units:
        raise ValueError(
            f"Labels must be class indices in [0, {units - 1}] for a model with "
            f"{units} outputs. Received: labels in [{low:g}, {high:g}]"
        )


def class_weights_for(y, class_weight):
    """Per-example weights from a `class_weight` dict that covers every class."""
    if y.ndim > 2 or (y.ndim == 2 and y.shape[1] != 1):
        raise ValueError(
            "`class_weight` needs integer class labels of shape [N]. Received: "
            f"y of shape {y.shape}"
        )
    labels = y.reshape(-1).astype(np.int64)
    missing = sorted(set(np.unique(labels).tolist()) - set(int(k) for k in class_weight))
    if missing:
        raise ValueError(
            f"`class_weight` has no weight for classes {missing[:10]} found in y. "
            f"Received: class_weight with keys {sorted(class_weight)[:10]}"
        )
    table = {int(k): float(v) for k, v in class_weight.items()}
    return np.asarray([table[c] for c in labels], np.float32)


def check_sample_weight_shape(sample_weight, y):
    """One weight per example ([N]), or one per token (y's shape)."""
    if sample_weight.ndim == 1 or sample_weight.shape == y.shape:
        return
    if sample_weight.ndim == 2 and sample_weight.shape[1] == 1:
        return
    raise ValueError(
        "Expected `sample_weight` of shape [N] (one weight per example) or of y's "
        f"shape {y.shape} (one per token). Received: sample_weight of shape "
        f"{sample_weight.shape}"
    )


def check_validation_data(validation_data):
    """Validation arrays of equal lengths, found before any budget is spent."""
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) < 2:
        return
    lengths = []
    for part in validation_data:
        leaves = list(part.values()) if isinstance(part, dict) else part
        leaves = leaves if isinstance(leaves, (tuple, list)) else [leaves]
        lengths += [len(leaf) for leaf in leaves if hasattr(leaf, "__len__")]
    if len(set(lengths)) > 1:
        raise ValueError(
            "Expected the arrays of `validation_data` to have one entry per example "
            f"each. Received: validation_data with lengths {lengths}"
        )
