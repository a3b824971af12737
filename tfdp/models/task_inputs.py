"""Errors that say how to wrap a Keras or KerasHub model in a `DPModel`.

`tfdp.DPModel` is a Functional model: it takes a graph's inputs and
outputs, `tfdp.DPModel(task.inputs, task.outputs)`, not a model (Keras's
own error for that is "Layer.__init__() takes 1 positional argument but 2
were given"). A KerasHub task's graph starts after its preprocessor (the
tokenizer and packer that `task.fit` runs on raw text), so the `DPModel`
trains on token ids: texts go through `task.preprocessor` first (Keras's
own error for text is "Invalid dtype: str256").

Example:

>>> import numpy as np
>>> check_no_text({"token_ids": np.zeros((2, 8), "int32")})
"""

import keras
import numpy as np
import tensorflow as tf


def _preprocessor_advice(what):
    return (
        f"The wrapped graph does not include {what}'s preprocessor (its tokenizer and "
        f"packer): run {what}.preprocessor on the texts first and fit on what it returns "
        "(a text classifier's preprocessor returns the inputs x, a causal LM's "
        "(x, y, sample_weight) to pass as fit(x, y, sample_weight=...))."
    )


def check_graph_arguments(args, kwargs):
    """Refuses a model passed where `DPModel` takes its inputs and outputs.

    Args:
        args, kwargs: the arguments `tfdp.DPModel` received.

    Raises:
        ValueError: naming `DPModel(model.inputs, model.outputs)`, and the
            preprocessor when the model has one (a KerasHub task).
    """
    given = args[0] if args else kwargs.get("inputs")
    if not isinstance(given, keras.layers.Layer):
        return
    what = "task" if hasattr(given, "preprocessor") else "model"
    message = (
        f"tfdp.DPModel takes a model's inputs and outputs, not the model: "
        f"tfdp.DPModel({what}.inputs, {what}.outputs)."
    )
    if what == "task":
        message += " " + _preprocessor_advice("task")
    raise ValueError(f"{message} Received: {type(given).__name__} {given.name!r}")


_TEXT_LAYERS = (keras.layers.TextVectorization, keras.layers.StringLookup)


def reads_text(model):
    """True if `model` holds a Keras layer that maps strings to numbers
    (`TextVectorization`, `StringLookup`): it then takes text inputs."""
    if model is None:
        return False
    layers = model._flatten_layers(include_self=False)  # pylint: disable=protected-access
    return any(isinstance(layer, _TEXT_LAYERS) for layer in layers)


def check_no_text(x, model=None):
    """Refuses text inputs unless `model` reads text (a DPModel computes on numbers).

    Args:
        x: the inputs `fit` received (an array or tensor, or a structure).
        model: the model; text is accepted when it holds a
            `TextVectorization` or `StringLookup` layer (`reads_text`),
            whose state `tfdp.preprocessing` checks.

    Raises:
        ValueError: naming `task.preprocessor` and `TextVectorization`, if
            an input holds strings and the model reads none.
    """
    if reads_text(model):
        return
    for path, leaf in _leaves_with_paths(x):
        if isinstance(leaf, tf.Tensor):
            text = leaf.dtype == tf.string
            dtype = leaf.dtype.name
        else:
            dtype = getattr(leaf, "dtype", None)
            text = dtype is not None and np.dtype(dtype).kind in "USO"
            dtype = "text" if text and np.dtype(dtype).kind in "US" else dtype  # not <U{length}
        if text:
            raise ValueError(
                f"The input x{path} holds text (dtype {dtype}); a DPModel computes on "
                "numbers, or reads text through a keras.layers.TextVectorization or "
                "StringLookup layer in the model (its vocabulary adapted with "
                "tfdp.preprocessing.adapt_privately or declared public). For "
                "tfdp.DPModel(task.inputs, task.outputs) of a KerasHub task: "
                f"{_preprocessor_advice('task')} Received: x{path} of dtype {dtype}"
            )


def text_as_tensors(structure):
    """`structure` with every NumPy array of text made a `tf.string` tensor
    (Keras builds a model on tensors; it rejects NumPy's text dtypes).

    Example:

    >>> text_as_tensors((np.array(["a b"]), np.zeros(1)))[0].dtype
    tf.string
    """
    def convert(leaf):
        if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "US":
            return tf.constant(leaf.astype(str))
        return leaf

    return tf.nest.map_structure(convert, structure)


def _leaves_with_paths(x):
    if isinstance(x, dict):
        for key in x:
            for path, leaf in _leaves_with_paths(x[key]):
                yield f"[{key!r}]{path}", leaf
    elif isinstance(x, (list, tuple)):
        for i, item in enumerate(x):
            for path, leaf in _leaves_with_paths(item):
                yield f"[{i}]{path}", leaf
    else:
        yield "", x
