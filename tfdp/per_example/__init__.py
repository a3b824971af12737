"""Per-example gradients of a Keras model: the cost of DP, paid once a batch.

DP needs each example's gradient (to clip it) but rarely the gradients
themselves: DP-SGD needs per-example norms and a reweighted sum.
`compute_per_example_gradients` returns both through one interface
(`PerExampleGradients`), by one of two paths:

* "batched" (default where it applies): ONE forward and backward pass over
  the batch records, for each layer with weights, its inputs and the gradient
  at its outputs; a rule per layer family (`tfdp.per_example.rules`: Dense,
  EinsumDense, Embedding, convolutions, normalizations, recurrent layers)
  turns them into per-example norms and sums, factored ("ghost") where
  cheaper. A layer with weights and no rule falls back to its own vjp,
  vectorized over examples (`fallback`).
* "vectorized": `tf.vectorized_map` of the whole model's backward pass, one
  example at a time: for subclassed models and models with a layer that is
  not known to keep examples independent (`registry`; declare a custom
  per-example layer with `declare_per_example`).

`per_example_gradients="auto"` on `DPModel` takes the batched path where it
applies and logs the path once; "batched" (alias "fast") insists on it.
A BatchNormalization in training mode mixes examples within a batch: it has
no per-example gradient and is refused. A frozen one runs in inference mode
and is accepted; a trainable one is accepted when every call of it in the DP
step passes `training=False` (then its gamma and beta train, the statistics
fixed; `inference_mode`), and `fix_batch_normalization` replaces trainable
ones with GroupNormalization.

Example:

>>> import keras, tensorflow as tf
>>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> loss = lambda y, p: tf.reduce_sum(tf.square(y - p), -1)
>>> grads, y_pred, losses = compute_per_example_gradients(
...     model, tf.ones([4, 3]), tf.zeros([4, 2]), tf.ones([4]), loss)
>>> grads.sq_norms().shape, grads.path
(TensorShape([4]), 'batched')
"""

import logging

import keras

from tfdp.per_example.batch_normalization import fix_batch_normalization
from tfdp.per_example.batched import batched_gradients
from tfdp.per_example.configuration import declare_per_example_activation
from tfdp.per_example.grads import LinearGrads, MaterializedGrads, PerExampleGradients
from tfdp.per_example.plan import plan_for
from tfdp.per_example.registry import declare_per_example, register_rule
from tfdp.per_example.validation import validate
from tfdp.per_example.vectorized import vectorized_gradients

__all__ = [
    "METHODS",
    "LinearGrads",
    "MaterializedGrads",
    "PerExampleGradients",
    "check_per_example_support",
    "compute_per_example_gradients",
    "declare_per_example",
    "declare_per_example_activation",
    "fix_batch_normalization",
    "plan_for",
    "register_rule",
    "validate",
]

METHODS = ("auto", "batched", "fast", "vectorized")

logger = logging.getLogger("tfdp")


def check_per_example_support(model):
    """Raises a clear error if a layer cannot have per-example gradients.

    A trainable BatchNormalization is checked where it runs, call by call,
    when the DP step is traced (`tfdp.per_example.inference_mode`): only
    its calls with `training=False` are accepted.

    Raises:
        ValueError: for a BatchNormalization over axis 0 (the batch axis:
            its statistics and weights are per position in the batch), for a
            stateful recurrent layer
            (its state carries other batches' examples into later steps), and
            for a layer whose trainable weights are not float32 (noise,
            clipping and the update need float32 weights; a mixed precision
            policy such as "mixed_bfloat16" keeps them float32 and is fine).
    """
    for _, message in support_problems(model):
        raise ValueError(message)


def support_problems(model):
    """Yields (layer, message) for every layer `check_per_example_support`
    refuses, in layer order (`tfdp.per_example.validate` lists them all)."""
    for layer in model._flatten_layers(include_self=False):
        problem = _normalized_axis_problem(layer)
        if problem:
            yield layer, problem
        if getattr(layer, "stateful", False):
            yield layer, (
                f"Layer '{layer.name}' ({type(layer).__name__}) is stateful: its state "
                "carries earlier batches' examples into later steps, so one record "
                "would influence steps it was not sampled for and the privacy "
                "accounting would not hold. Use stateful=False. Received: stateful=True"
            )
        low = [v.name for v in layer.trainable_variables if v.dtype != "float32"]
        if low:
            yield layer, (
                f"Layer '{layer.name}' keeps its trainable weights {low} in "
                f"{layer.variable_dtype}: tfdp clips, noises and updates float32 weights. "
                "Use a float32 or mixed precision policy ('mixed_bfloat16', "
                "'mixed_float16'), whose weights stay float32. "
                f"Received: dtype_policy={layer.dtype_policy.name}"
            )


def _normalized_axis_problem(layer):
    if not isinstance(layer, keras.layers.BatchNormalization):
        return None
    rank = getattr(layer.input_spec, "ndim", None)
    if layer.axis == 0 or (rank and layer.axis % rank == 0):
        return (
            f"Layer '{layer.name}' ({type(layer).__name__}) normalizes over axis 0, the "
            "batch axis: its statistics, gamma and beta are per position in the batch "
            "(in training mode it normalizes over the batch's examples), so an "
            "example's output depends on its position or on the other examples, and "
            "it has no per-example gradient. Normalize over a feature axis (axis=-1, "
            "the channels) instead. "
            f"Received: axis={layer.axis}"
        )
    return None


def compute_per_example_gradients(
    model, x, y, weights, loss_fn, method="auto", training=True
):
    """Per-example gradients of `weights_i * loss_fn(y_i, model(x_i))`.

    Args:
        model: a built Keras model (single output).
        x: model inputs, batch first (a tensor, or a list/tuple/dict of them).
        y: targets, batch first.
        weights: float tensor [B]: sample weight times padding mask.
        loss_fn: callable(y_true, y_pred) -> per-example losses [B].
        method: "auto", "batched" ("fast" is an alias) or "vectorized" (see
            the module docstring).
        training: passed to layers (Dropout and the like).

    Returns:
        (PerExampleGradients, y_pred, per-example losses [B]); the
        gradients' `path` says which path ran.
    """
    if method not in METHODS:
        raise ValueError(f"Expected `method` in {METHODS}. Received: method={method!r}")
    if method == "vectorized":
        return vectorized_gradients(model, x, y, weights, loss_fn, training)
    plan = plan_for(model)
    if plan.path == "vectorized" and method in ("batched", "fast"):
        raise ValueError(
            "The batched per-example path cannot run this model: "
            f"{plan.reason}. Use per_example_gradients='auto' or 'vectorized', or "
            "declare a custom layer that keeps examples independent with "
            f"tfdp.per_example.declare_per_example. Received: per_example_gradients={method!r}"
        )
    if plan.path == "vectorized":
        return vectorized_gradients(model, x, y, weights, loss_fn, training)
    return batched_gradients(model, plan, x, y, weights, loss_fn, training)
