"""`validate(model)`: everything fit would refuse or run slowly, in one report.

Opacus's `ModuleValidator.validate` lists the modules it cannot train
privately; `validate` does the same for a Keras model, before `compile`
where it can, by asking the checks fit and compile themselves make (it adds
none of its own): the per-example support checks
(`check_per_example_support`), the batched path's plan (`plan_for`: the
vectorized fallback and the per-layer vjp fallback are slow, not refused),
trainable BatchNormalization layers called in training mode
(`inference_mode`), a `train_step` override, text inputs, the loss
(`tfdp.models.losses`) and the compile settings tfdp refuses. What only
tracing the step can tell (a layer that writes a variable in `call()`,
oneDNN's hazard on the vectorized path) is checked when fit traces the
step, and the report says so.

Example:

>>> import keras, tfdp
>>> inputs = keras.Input((4,))
>>> h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(8)(inputs))
>>> report = tfdp.per_example.validate(tfdp.DPModel(inputs, keras.layers.Dense(2)(h)))
>>> report.ok
False
>>> [finding.subject for finding in report.refused]
["layer 'bn' (BatchNormalization)"]
"""

from tfdp.per_example.inference_mode import batch_normalizations_in_training, check_inference_call
from tfdp.per_example.plan import plan_for

__all__ = ["Finding", "ValidationReport", "validate"]

_TRACED = ("Checked only when fit traces the step: a layer that writes a variable in call() "
           "(it would store training data), and, on the vectorized path with oneDNN, "
           "sequence matmuls that crash TensorFlow.")


class Finding:
    """One thing fit would refuse, or run on a slow path.

    Attributes:
        severity: "refused" (fit or compile raises before the first step) or
            "slow" (trains, on a slower per-example path).
        subject: what it is about: "layer 'name' (Class)", "loss",
            "optimizer", "setting run_eagerly", "model", "input 'name'".
        reason: why, as fit's own message says it.
        fix: what to change.
    """

    def __init__(self, severity, subject, reason, fix):
        self.severity = severity
        self.subject = subject
        self.reason = reason
        self.fix = fix

    def as_dict(self):
        """The finding as a dict (the `tfdp validate` command prints these)."""
        return {"severity": self.severity, "subject": self.subject, "reason": self.reason,
                "fix": self.fix}

    def __repr__(self):
        return f"Finding({self.severity!r}, {self.subject!r})"


class ValidationReport:
    """What `validate` found.

    Attributes:
        path: the per-example path fit would take (`per_example_path`'s line).
        findings: every `Finding`, refusals first.
        refused: the findings fit or compile would refuse.
        slow: the findings that train on a slower path.
        ok: True when nothing would be refused.
    """

    def __init__(self, path, findings):
        self.path = path
        self.findings = sorted(findings, key=lambda f: f.severity != "refused")
        self.refused = [f for f in self.findings if f.severity == "refused"]
        self.slow = [f for f in self.findings if f.severity == "slow"]
        self.ok = not self.refused

    def __str__(self):
        head = ("fit would refuse this model" if self.refused
                else "fit accepts this model" + (" (on a slower path)" if self.slow else ""))
        lines = [f"{head}: {len(self.refused)} refused, {len(self.slow)} slow", self.path]
        for number, finding in enumerate(self.findings, 1):
            lines += [f"{number}. [{finding.severity}] {finding.subject}",
                      f"   why: {finding.reason}", f"   fix: {finding.fix}"]
        lines.append(_TRACED)
        return "\n".join(lines)

    def as_dict(self):
        """The report as a dict (what `tfdp validate` prints as JSON)."""
        return {"ok": self.ok, "path": self.path,
                "findings": [f.as_dict() for f in self.findings], "traced_checks": _TRACED}


def _layer(layer):
    return f"layer '{layer.name}' ({type(layer).__name__})"


def _layer_findings(model):
    from tfdp.per_example import support_problems

    for layer, message in support_problems(model):
        yield Finding("refused", _layer(layer), message,
                      "change the layer's setting as the reason says, then rebuild the model")
    for layer in batch_normalizations_in_training(model):
        try:
            check_inference_call(layer, True)
        except ValueError as error:
            yield Finding("refused", _layer(layer), str(error),
                          "call it (or its model) with training=False, freeze it, or "
                          "tfdp.per_example.fix_batch_normalization(model)")


def _path_findings(model, plan):
    method = getattr(model, "per_example_gradients", "auto")
    if method == "vectorized":
        return
    if plan.path == "vectorized":
        severity = "refused" if method in ("batched", "fast") else "slow"
        yield Finding(severity, "model", f"the whole model runs on the vectorized path: {plan.reason}",
                      "replace or declare the layer named (tfdp.per_example.declare_per_example "
                      "for a custom layer that keeps examples independent), or write a "
                      "subclassed model functionally")
    for name in plan.fallback_layers:
        layer = next(l for l, _ in plan.handlers if l.name == name)
        yield Finding("slow", _layer(layer),
                      "it has weights and no per-example rule: its own vjp runs per example "
                      "(the per-layer fallback)",
                      "none needed; a rule (tfdp.per_example.register_rule) would be faster")


def _model_findings(model):
    from tfdp.models.dp_model import DPTrainingMixin, _check_train_step
    from tfdp.models.losses import check_one_output
    from tfdp.models.task_inputs import check_no_text

    if not isinstance(model, DPTrainingMixin):
        yield Finding("refused", "model", f"{type(model).__name__} is not a tfdp model: "
                      "plain Keras fit trains without privacy",
                      "build it as tfdp.DPModel(inputs, outputs) or tfdp.DPSequential(layers)")
        return
    try:
        check_one_output(model)
    except ValueError as error:
        yield Finding("refused", "model", str(error),
                      "concatenate the heads into one output and compile with one loss that "
                      "weighs each head's loss per example")
    try:
        _check_train_step(model)
    except ValueError as error:
        yield Finding("refused", "model", str(error),
                      "remove the train_step override (customise the loss, call() or a callback)")
    for tensor in getattr(model, "inputs", None) or []:
        if tensor.dtype == "string":
            import numpy as np

            try:
                check_no_text(np.empty((0,), object), model)
            except ValueError as error:
                yield Finding("refused", f"input '{tensor.name}'", str(error),
                              "read the text with a TextVectorization or StringLookup in the "
                              "model (adapted privately or declared public: "
                              "tfdp.preprocessing), or turn it into token ids outside the "
                              "model (a KerasHub preprocessor)")


def _loss_findings(loss):
    from tfdp.models.losses import ROW_WISE_LOSSES, unreduced_loss

    try:
        unreduced_loss(loss)
    except ValueError as error:
        fix = ("compile with one loss for one output (for several heads, concatenate them "
               "into one output with one loss that weighs each head's loss per example)"
               if isinstance(loss, (list, tuple, dict))
               else "pass a Keras loss, its name, or a function returning one loss per example")
        yield Finding("refused", "loss", str(error), fix)
        return
    import keras

    resolved = keras.losses.get(loss) if isinstance(loss, str) else loss
    function = getattr(resolved, "fn", resolved)
    if function not in ROW_WISE_LOSSES:
        yield Finding("slow", "loss", f"{loss!r} is not a known row-wise Keras loss: it is "
                      "evaluated one example at a time", "none needed; a Keras row-wise loss "
                      "(crossentropy, mse, ...) runs batched")


def _setting_findings(model, optimizer, settings):
    from tfdp.optimizers import DPOptimizer

    if optimizer is not None and not isinstance(optimizer, DPOptimizer):
        yield Finding("refused", "optimizer", f"{type(optimizer).__name__} is not a tfdp "
                      "optimizer: it would apply the batch's mean gradient, unclipped and "
                      "without noise", "use tfdp.optimizers.DPSGD (or DPOptimizer, SADPSGD, "
                      "DPIS, AdaDP) with l2_norm_clip and noise_multiplier or target_epsilon")
    if settings.get("run_eagerly"):
        yield Finding("refused", "setting run_eagerly", "an eager step has no graph to check "
                      "for layers that write training data into their variables",
                      "leave run_eagerly=False")
    if settings.get("auto_scale_loss") and model.dtype_policy.name == "mixed_float16":
        yield Finding("refused", "setting auto_scale_loss", "a DP model computes its loss and "
                      "per-example gradients in float32 and cannot train through Keras's "
                      "LossScaleOptimizer", "leave auto_scale_loss unset (tfdp sets it False)")


def validate(model, loss=None, optimizer=None, **compile_settings):
    """Lists every layer, loss and setting `fit` would refuse or run slowly.

    Call it on a built model, before `compile` (pass the `loss`,
    `optimizer` and compile settings you mean to use) or after (the
    compiled ones are read). It raises nothing: each problem is a `Finding`
    with its reason and fix, the refusals first.

    Args:
        model: a `tfdp.DPModel` or `tfdp.DPSequential` (a plain Keras model
            is reported as refused).
        loss: the loss for `compile` (default: the compiled one, if any).
        optimizer: the optimizer for `compile` (default: the compiled one).
        **compile_settings: other `compile` arguments to check
            (`run_eagerly`, `auto_scale_loss`).

    Returns:
        A `ValidationReport`; `print(report)` shows it, `report.ok` is
        False when fit would refuse.

    Example:

    >>> import keras, tfdp
    >>> inputs = keras.Input((4,))
    >>> model = tfdp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    >>> tfdp.per_example.validate(model, loss="mse").ok
    True
    """
    plan = plan_for(model)
    findings = list(_model_findings(model))
    findings += _layer_findings(model)
    findings += _path_findings(model, plan)
    path = path_line(model, plan, findings)
    if getattr(model, "compiled", False):
        loss = model.loss if loss is None else loss
        optimizer = model.optimizer if optimizer is None else optimizer
        compile_settings.setdefault("run_eagerly", model.run_eagerly)
    if loss is not None:
        findings += _loss_findings(loss)
    findings += _setting_findings(model, optimizer, compile_settings)
    return ValidationReport(path, findings)


def path_line(model, plan=None, findings=None):
    """`per_example_path`'s line: the path, and, when fit would refuse the
    model itself (a layer, a train_step override), that it would, so that
    the line never promises a path fit then refuses."""
    if getattr(model, "per_example_gradients", "auto") == "vectorized":
        line = "per-example gradients: whole-model vectorized_map (requested)"
    else:
        line = (plan or plan_for(model)).describe()
    if findings is None:
        findings = list(_model_findings(model)) + list(_layer_findings(model))
    refused = [f.subject for f in findings if f.severity == "refused"]
    if refused:
        line += (f"; but fit refuses {', '.join(dict.fromkeys(refused))} "
                 "(tfdp.per_example.validate(model) says why and the fix)")
    return line
