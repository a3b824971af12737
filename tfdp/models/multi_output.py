"""Models with several outputs: each example's loss sums its heads' losses.

`DPModel(inputs, [head_a, head_b])` (or a dict of outputs) compiles as Keras
does, with one loss for every output, a list of losses (one per output, in
the outputs' order) or a dict (keyed by output name), and optional
`loss_weights` (a list or dict of the same form). Each example's loss is

    loss_i = sum over outputs k of  w_k * loss_k(y_k,i, y_pred_k,i)

(an output's per-example loss reduced over its other axes as a single
output's is), and that one value is what is differentiated: each example's
gradient over every head together is clipped as ONE unit and noised once, so
the heads share the clip norm C instead of each taking C (which would let
one record move the update by sqrt(K) C). A sample weight of shape [N]
weighs the whole sum, as Keras weighs every output's loss with it; a list
or dict of them (one per output, Keras's form) weighs each output's loss
inside the sum (`OutputLosses.weighted_by_output`).

An output whose loss is None (a list entry, or a name missing from a dict
of losses for a dict of outputs) trains nothing through its own loss: it
adds 0, and its target may be left out of a dict `y`. Refused before the
first step, with the way round: per-token weights, `class_weight` (Keras
refuses it for several outputs too), lists and dicts that do not match the
outputs, and no output with a loss. Metrics (`compile(metrics=...)`) see
the drawn examples unweighted, as for one output.

Example:

>>> import keras, numpy as np, tfdp
>>> inputs = keras.Input((3,))
>>> model = tfdp.DPModel(inputs, [keras.layers.Dense(2, name="kind")(inputs),
...                               keras.layers.Dense(1, name="size")(inputs)])
>>> losses = output_losses(model, {"kind": "sparse_categorical_crossentropy",
...                                "size": "mse"}, {"kind": 1.0, "size": 0.5})
>>> losses.names, losses.weights
(['kind', 'size'], [1.0, 0.5])
"""

import numpy as np
import tensorflow as tf

from tfdp.models.losses import per_example_loss

WAY_ROUND = "Docs: docs/guides/your-model.md, 'Several outputs'."


def output_names(model):
    """The model's output names in its outputs' order (tf.nest's order for a
    dict of outputs); for a subclassed model, whose outputs are its call()'s,
    the names its losses were compiled with ("output_0", ...); else None.
    Example: `output_names(model)` -> ['kind', 'size']."""
    names = _graph_output_names(model)
    compiled = getattr(model, "_per_example_loss", None)
    if names is None and isinstance(compiled, OutputLosses):
        return compiled.names
    return names


def _graph_output_names(model):
    try:
        outputs = model.outputs
    except AttributeError:  # a subclassed model: its outputs are its call()'s
        return None
    if not outputs:
        return None
    names = list(getattr(model, "output_names", None) or [])
    return names if len(names) == len(outputs) else [f"output_{i}" for i in range(len(outputs))]


def has_several_outputs(model, loss=None):
    """True for a model with several outputs, or, when its outputs are not
    known yet, for a list or dict of losses."""
    if isinstance(getattr(model, "_per_example_loss", None), OutputLosses):
        return True  # compiled with one loss per output
    names = _graph_output_names(model)
    if names is not None:
        return len(names) > 1
    return isinstance(loss, (list, tuple, dict))


class OutputLosses:
    """One per-example loss (or None) and weight per output, in output order.

    Attributes:
        names: output names (or positions as "output_i" for a model whose
            outputs are known only once called).
        losses: callable(y_true, y_pred) -> [B] for each output, None for an
            output without a loss.
        weights: the float loss weight of each output.
    """

    def __init__(self, names, losses, weights):
        self.names, self.losses, self.weights = names, losses, weights

    def flat_targets(self, y_true):
        """y given as a tuple (output order) or a dict (by output name) as a
        list in output order (None where a dict leaves an output out)."""
        if isinstance(y_true, dict):
            return [y_true.get(name) for name in self.names]
        if isinstance(y_true, (list, tuple)) and len(y_true) == len(self.names):
            return list(y_true)
        raise ValueError(
            f"A model with {len(self.names)} outputs {self.names} needs one target per "
            "output: y as a list or tuple in the outputs' order, or a dict keyed by output "
            f"name. {WAY_ROUND} Received: y of type {type(y_true).__name__}"
        )

    def per_output(self, y_true, y_pred):
        """[(name, weight, losses [B] float32)] for each output with a loss."""
        predictions = ([y_pred[name] for name in self.names] if isinstance(y_pred, dict)
                       and set(self.names) <= set(y_pred) else tf.nest.flatten(y_pred))
        targets = self.flat_targets(y_true)
        return [(name, weight, loss(target, prediction))
                for name, weight, loss, target, prediction
                in zip(self.names, self.weights, self.losses, targets, predictions)
                if loss is not None]

    def __call__(self, y_true, y_pred):
        """Each example's weighted sum of its outputs' losses, float32 [B]."""
        terms = [weight * losses for _, weight, losses in self.per_output(y_true, y_pred)]
        return tf.add_n(terms)

    def weighted_by_output(self, y_and_weights, y_pred):
        """As `__call__`, each output's loss also weighed by its own sample
        weight: `y_and_weights` is (y, weights), weights a tuple (output
        order) or dict (by name) of [B] tensors (1 for an output left out)."""
        y_true, weights = y_and_weights
        by_name = dict(zip(self.names, self.flat_targets(weights)))
        terms = []
        for name, weight, losses in self.per_output(y_true, y_pred):
            own = by_name.get(name)
            if own is not None:
                losses = losses * tf.cast(tf.reshape(own, [-1]), tf.float32)
            terms.append(weight * losses)
        return tf.add_n(terms)


def _names_for(model, loss):
    names = _graph_output_names(model)
    if names is not None:
        return names
    count = len(loss)  # a subclassed model: positions, from the list of losses
    return [f"output_{i}" for i in range(count)]


def by_output(names, value, argument):
    """`value` (one for all, a list in output order, or a dict by name) as a
    list in output order; None where a dict leaves an output out."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(names), key=str)
        if unknown:
            raise ValueError(
                f"`{argument}` names outputs the model does not have: {unknown}. The "
                f"model's outputs are {names}. Received: {argument} with keys "
                f"{sorted(value, key=str)}"
            )
        return [value.get(name) for name in names]
    if isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise ValueError(
                f"Expected one `{argument}` entry per output ({len(names)}: {names}), in "
                f"the outputs' order, or a dict keyed by output name. Received: "
                f"{argument} with {len(value)} entries"
            )
        return list(value)
    return [value] * len(names)


def output_losses(model, loss, loss_weights=None):
    """Resolves `compile`'s `loss` and `loss_weights` for a model with
    several outputs into an `OutputLosses`.

    Raises:
        ValueError: naming the output and the way round, for a list or dict
            that does not match the outputs, a loss weight that is not a
            finite number, a loss a DP model cannot take, or no loss at all.
    """
    names = _names_for(model, loss)
    if loss is None:
        raise ValueError(
            "A DP model needs a loss to compute per-example gradients. Received: loss=None")
    losses = by_output(names, loss, "loss")
    missing = [name for name in names if isinstance(loss, dict) and name not in loss]
    if missing and not isinstance(getattr(model, "_outputs_struct", None), dict):
        raise ValueError(  # Keras's rule for a list of outputs
            f"A dict of losses for a model with a list of outputs names every output: "
            f"{missing} missing. Give an output without a loss the loss None. Received: "
            f"loss with keys {sorted(loss, key=str)}"
        )
    if loss_weights is None:
        weights = [1.0] * len(names)
    elif isinstance(loss_weights, (list, tuple, dict)):
        weights = [1.0 if w is None else w for w in by_output(names, loss_weights, "loss_weights")]
    else:
        raise ValueError(
            f"A model with {len(names)} outputs {names} takes `loss_weights` as a list "
            "(in the outputs' order) or a dict keyed by output name, as Keras does. "
            f"Received: loss_weights={loss_weights!r}"
        )
    for name, weight in zip(names, weights):
        if isinstance(weight, bool) or not isinstance(weight, (int, float, np.floating, np.integer)) \
                or not np.isfinite(weight):
            raise ValueError(
                f"The loss weight of output '{name}' must be a finite number: it scales "
                "that output's loss inside each example's clipped loss. Received: "
                f"loss_weights for '{name}' = {weight!r}"
            )
    if all(one is None for one in losses):
        raise ValueError(
            f"No output of {names} has a loss: there is nothing to train. Give at least "
            f"one output a loss. {WAY_ROUND} Received: loss={loss!r}"
        )
    resolved = []
    for name, one in zip(names, losses):
        if one is None:
            resolved.append(None)
            continue
        if isinstance(one, (list, tuple, dict)):
            raise ValueError(
                f"Output '{name}' is one tensor and takes one loss. Received: loss for "
                f"'{name}' = {one!r}"
            )
        try:
            resolved.append(per_example_loss(one))
        except ValueError as error:
            raise ValueError(f"The loss of output '{name}': {error}") from error
    return OutputLosses(names, resolved, [float(w) for w in weights])


def compiled_losses(model, loss, loss_weights=None):
    """(per-example loss, per-token loss) for `compile`: the joint loss of
    a model with several outputs (and no per-token loss), else the one
    output's (`tfdp.models.losses`, `tfdp.models.sequence_loss`)."""
    from tfdp.models.sequence_loss import token_weighted_loss

    if has_several_outputs(model, loss):
        return output_losses(model, loss, loss_weights), _no_token_weights
    return per_example_loss(loss), token_weighted_loss(loss)


def _no_token_weights(y_and_weights, y_pred):
    raise ValueError(
        "Per-token sample weights need one output with a per-token loss; this model "
        "has several outputs. Give one sample weight per example (shape [N]). "
        f"{WAY_ROUND} Received: sample_weight of rank 2 or more"
    )


def label_units(model):
    """What `fit` checks class-index labels against: the last dimension of
    the model's one output (None if unknown), or {name: that of each output}
    for several outputs. Example: `label_units(model)` -> {'kind': 2, 'size': 1}."""
    outputs = getattr(model, "outputs", None)
    if not outputs:
        return None
    units = [o.shape[-1] if len(o.shape) else None for o in outputs]
    if len(outputs) == 1:
        return units[0]
    return dict(zip(output_names(model), units))


def check_targets(model, y, name="y"):
    """`y` for a model with several outputs as a tuple (output order) or a
    dict (by output name) of arrays, each one row per example.

    Raises:
        ValueError: for one array where there are several outputs, a list of
            another length, a dict with unknown names or missing an output
            that has a loss (naming it), and rows that disagree in number.
    """
    from tfdp.models.input_checks import as_array

    losses = getattr(model, "_per_example_loss", None)
    names = output_names(model) or getattr(losses, "names", None)
    if isinstance(y, dict):
        unknown = sorted(set(y) - set(names), key=str)
        needed = [n for n, loss in zip(names, getattr(losses, "losses", [])) if loss is not None]
        missing = [n for n in needed if n not in y]
        if unknown or missing:
            raise ValueError(
                f"Expected `{name}` as a dict with a target for each output that has a "
                f"loss ({needed}), keyed by the model's output names {names}. Received: "
                f"{name} with keys {sorted(y, key=str)}"
                + (f" (unknown: {unknown})" if unknown else "")
                + (f" (missing: {missing})" if missing else "")
            )
        targets = {key: as_array(f"{name}['{key}']", y[key]) for key in names if key in y}
    elif isinstance(y, (list, tuple)) and len(y) == len(names):
        targets = tuple(as_array(f"{name}[{i}]", one) for i, one in enumerate(y))
    else:
        count = len(y) if isinstance(y, (list, tuple)) else "one array"
        raise ValueError(
            f"This model has {len(names)} outputs {names}: give `{name}` as a list (one "
            "target array per output, in the outputs' order) or a dict keyed by output "
            f"name, as Keras takes them. {WAY_ROUND} Received: {name} with {count} "
            f"{'entries' if isinstance(count, int) else ''}".rstrip()
        )
    lengths = {len(a) for a in tf.nest.flatten(targets)}
    if len(lengths) > 1:
        raise ValueError(
            f"Expected every output's target in `{name}` to have one row per example. "
            f"Received: {name} with {sorted(lengths)} rows"
        )
    return targets


def check_sample_weight(sample_weight, class_weight, name="sample_weight"):
    """`sample_weight` for a model with several outputs: one weight per
    example ([N]) for the whole sum, or a list (output order) or dict (by
    output name) of them, one per output, each weighing its output's loss.

    Raises:
        ValueError: for per-token sample weights and `class_weight`, each
            with the way round.
    """
    if class_weight is not None:
        raise ValueError(
            "`class_weight` is not supported for a model with several outputs (Keras "
            "refuses it too): pass the weight of each example's class as sample_weight "
            f"(shape [N]), or weigh classes inside that output's loss. {WAY_ROUND} "
            "Received: class_weight given"
        )
    if sample_weight is None:
        return None
    if isinstance(sample_weight, (list, tuple, dict)):  # one weight per example per output
        items = sample_weight.items() if isinstance(sample_weight, dict) else enumerate(sample_weight)
        weights = {key: _one_per_example(f"{name}[{key!r}]", one) for key, one in items}
        return weights if isinstance(sample_weight, dict) else tuple(weights.values())
    return _one_per_example(name, sample_weight)


def _one_per_example(name, sample_weight):
    weights = np.asarray(sample_weight, np.float32)
    if weights.ndim == 2 and weights.shape[1] == 1:
        weights = weights[:, 0]
    if weights.ndim != 1:
        raise ValueError(
            "A model with several outputs takes one sample weight per example (shape "
            "[N]), for every output or, as a list or dict, for each: per-token weights "
            f"need one output. {WAY_ROUND} Received: {name} of shape {weights.shape}"
        )
    return weights


def training_arrays(model, x, y, sample_weight, class_weight):
    """`fit`'s (x, y, sample_weight) for a model with several outputs, checked
    as the one-output arrays are: rows per example everywhere, numeric
    targets, one weight per example (`check_targets`, `check_sample_weight`)."""
    from tfdp.models.input_checks import check_label_values

    y = check_targets(model, y)
    sample_weight = check_sample_weight(sample_weight, class_weight)
    rows = len(tf.nest.flatten(x)[0])
    if rows == 0:
        raise ValueError("Received empty training data: x has 0 examples.")
    if any(len(a) != rows for a in tf.nest.flatten(x)):
        raise ValueError("All inputs in x must have the same number of examples.")
    named = dict(y) if isinstance(y, dict) else {f"y[{i}]": a for i, a in enumerate(y)}
    if isinstance(sample_weight, (tuple, dict)):
        by_output(output_names(model), sample_weight, "sample_weight")  # names or count
        items = sample_weight.items() if isinstance(sample_weight, dict) else enumerate(sample_weight)
        named.update({f"sample_weight[{key!r}]": one for key, one in items})
        sample_weight = like_outputs(model, sample_weight)  # how Keras reads it, every output
    elif sample_weight is not None:
        named["sample_weight"] = sample_weight
    for name, array in named.items():
        if len(array) != rows:
            raise ValueError(
                f"Expected `{name}` to have one entry per example of x ({rows}). Received: "
                f"{name} with {len(array)} entries"
            )
    check_label_values(y, None)  # numbers; their range once built (fit)
    return x, y, sample_weight


def update_output_loss_metrics(model, targets, y_pred, weights):
    """Updates the per-output loss means Keras logs for several outputs
    ("<name>_loss"), with each output's per-example loss (unweighted by its
    loss weight, as Keras logs it) averaged over the drawn examples."""
    losses = getattr(model, "_per_example_loss", None)
    trackers = getattr(getattr(model, "_compile_loss", None), "metrics", None) or []
    if not isinstance(losses, OutputLosses) or not trackers:
        return
    by_name = {metric.name: metric for metric in trackers}
    for output, _, values in losses.per_output(targets, y_pred):
        metric = by_name.get(f"{output}_loss")
        if metric is None:
            continue
        finite = tf.math.is_finite(values) & tf.math.is_finite(weights)
        kept = tf.where(finite, weights, tf.zeros_like(weights))
        values = tf.where(finite, values, tf.zeros_like(values))
        metric.update_state(
            tf.math.divide_no_nan(tf.reduce_sum(values * kept), tf.reduce_sum(kept)),
            sample_weight=tf.reduce_sum(kept),
        )


def like_outputs(model, weights):
    """Per-output `weights` with one entry for every output (ones where
    they leave one out), as a dict for a dict of outputs, else a tuple in
    the outputs' order: how Keras's compiled loss reads them by output."""
    ordered = in_output_order(model, weights)
    if isinstance(getattr(model, "_outputs_struct", None), dict):
        return dict(zip(output_names(model), ordered))
    return ordered


def in_output_order(model, y):
    """A dict `y` (targets or sample weights, by output name) as a tuple in
    the outputs' order, which is how a record's leaves line up with the
    model's outputs; an output the dict leaves out (one without a loss, or
    without its own weight) reads ones."""
    if isinstance(y, dict):
        rows = len(tf.nest.flatten(y)[0])
        return tuple(y[name] if name in y else np.ones(rows, np.float32)
                     for name in output_names(model))
    return y


def first_output(model, prediction):
    """The first output (in `output_names` order) of `model`'s `prediction`,
    or `prediction` itself when it is one tensor."""
    if isinstance(prediction, dict):
        names = output_names(model) or sorted(prediction)
        return prediction[names[0]]
    return tf.nest.flatten(prediction)[0]


__all__ = [
    "OutputLosses", "check_sample_weight", "check_targets", "compiled_losses",
    "has_several_outputs", "label_units", "output_losses", "output_names",
    "update_output_loss_metrics",
]
