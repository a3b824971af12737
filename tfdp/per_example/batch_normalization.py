"""`fix_batch_normalization`: a model whose trainable BatchNormalization
layers are replaced by GroupNormalization, which keeps examples independent.

A trainable `BatchNormalization` normalizes with the batch's statistics in
training, so every example's output depends on the others and per-example
gradients are undefined (DP-SGD refuses it); its moving statistics would
also store the training data. A frozen one (`trainable=False`) runs in
inference mode, a per-example affine map, and DP training accepts it as it
is. Like Opacus's `ModuleValidator.fix`, this returns a copy of the model
with each TRAINABLE BatchNormalization replaced by a `GroupNormalization`
over the same channel axis: per-example statistics over groups of channels
(Wu and He 2018), the usual replacement in DP training (De et al. 2022 use
it for their DP image models). Its `gamma` and `beta` are the batch
normalization's (they carry over); the moving mean and variance have no
counterpart and are dropped. Every other layer keeps its weights. Frozen
BatchNormalization layers are kept.

Example:

>>> import keras
>>> inputs = keras.Input((8, 8, 6))
>>> hidden = keras.layers.BatchNormalization(name="bn")(keras.layers.Conv2D(6, 3)(inputs))
>>> model = keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(hidden))
>>> fixed, changes = fix_batch_normalization(model)
>>> changes
["'bn': BatchNormalization -> GroupNormalization(groups=6, axis=-1)"]
>>> type(fixed.get_layer("bn")).__name__
'GroupNormalization'
"""

import keras

__all__ = ["fix_batch_normalization"]


def _groups_for(channels, groups):
    """The largest divisor of `channels` that is at most `groups`."""
    return max(g for g in range(1, min(groups, channels) + 1) if channels % g == 0)


def fix_batch_normalization(model, groups=32):
    """Returns (a copy of `model` without trainable BatchNormalization, the
    changes made, one line per replaced layer).

    Args:
        model: a built Functional or Sequential Keras model (a `DPModel` or
            `DPSequential` too: the copy is of the same class, uncompiled),
            nested models included.
        groups: the most groups each GroupNormalization splits its channels
            into (32, Wu and He's default); fewer when the channel count has
            no such divisor (each layer uses the largest divisor of its
            channel count that is at most `groups`).

    Raises:
        ValueError: for a subclassed model (its layers cannot be replaced
            from outside; replace them in its code), or a BatchNormalization
            normalizing over several axes.
    """
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"Expected `groups` to be an int >= 1. Received: groups={groups!r}")
    from tfdp.per_example.registry import is_graph_model

    if not is_graph_model(model):
        raise ValueError(
            "fix_batch_normalization rebuilds Functional and Sequential models; a "
            "subclassed model's layers are created in its own code: replace "
            "BatchNormalization there (keras.layers.GroupNormalization). Received: "
            f"model={type(model).__name__}"
        )
    changes, pairs, replaced = [], [], set()

    def clone(layer):
        if type(layer) is keras.layers.BatchNormalization and layer.trainable:
            axis = layer.axis if isinstance(layer.axis, int) else None
            if axis is None:
                raise ValueError(
                    f"Layer '{layer.name}' normalizes over several axes; GroupNormalization "
                    f"takes one channel axis. Received: axis={layer.axis!r}"
                )
            channels = layer.gamma.shape[0] if layer.scale else layer.moving_mean.shape[0]
            count = _groups_for(int(channels), groups)
            new = keras.layers.GroupNormalization(
                groups=count, axis=axis, epsilon=layer.epsilon, center=layer.center,
                scale=layer.scale, name=layer.name, dtype=layer.dtype_policy)
            changes.append(f"'{layer.name}': BatchNormalization -> GroupNormalization("
                           f"groups={count}, axis={axis})")
            replaced.add(id(new))
        else:
            new = layer.__class__.from_config(layer.get_config())
        pairs.append((layer, new))
        return new

    def call(layer, *args, **kwargs):
        if id(layer) in replaced:  # BatchNormalization's mask argument has no counterpart
            kwargs.pop("mask", None)
        return layer(*args, **kwargs)

    # A Sequential lists its layers (Keras refuses a call_function for it);
    # it passes a mask only to a layer whose call takes one.
    sequential = isinstance(model, keras.Sequential)
    fixed = keras.models.clone_model(model, clone_function=clone,
                                     call_function=None if sequential else call, recursive=True)
    for old, new in pairs:
        _carry_weights(old, new)
    return fixed, changes


def _carry_weights(old, new):
    """Copies `old`'s weights into `new`: all of them for a layer of the same
    class, gamma and beta for a BatchNormalization turned GroupNormalization."""
    if type(new) is type(old):
        if old.weights:
            new.set_weights(old.get_weights())
        new.trainable = old.trainable
        return
    for name in ("gamma", "beta"):
        source, target = getattr(old, name, None), getattr(new, name, None)
        if source is not None and target is not None:
            target.assign(source)
