"""Crafted records for the sensitivity search: the shapes of attacks on clipping.

A record is a nest like the data, (x, y) or (x, y, sample_weight), of
arrays without the batch axis. `RecordSpace` knows each leaf's role (input,
target, weight), kind (float, int, bool) and range; the functions below
build candidates from a template record (a real one):

* `extremes`: inputs and targets scaled to, or filled with, 1e-30 .. 1e30;
  token ids and labels at the ends of their range; sample weights 1e30.
* `nonfinite`: NaN, +Inf and -Inf in one entry or every entry of an input,
  target or weight.
* `cancelling_positions`: records whose per-position terms cancel, the
  attack on factored ("ghost") norms sum_{s,t} (x_s . x_t)(g_s . g_t),
  which in float32 can round to 0 for a gradient that is not small.
  Positions (axis 0 of a leaf of rank >= 2: a sequence step, an image row)
  are tied to one vector x, with targets that alternate around the model's
  prediction (y_s = p_s +- A u + delta v), so the output gradients of a
  squared error are G = [g, -g + delta, ...] with |g| >> |delta|; or the
  inputs alternate (x_s = +-A u + delta v) under an ordinary target. Token
  inputs are tied to one id (or alternate two), labels alternate two
  classes.
* `flush_to_zero`: the floating-point boundary of a factored weighted sum
  x^T (w g): one position holds huge inputs (up to 3e38) behind the zero
  rows of the first layer's kernel (a zero-initialised layer) with a tiny
  but normal output gradient g_0, a second position cancels it exactly
  (inputs 1 there, output gradient -huge g_0) and adds one ordinary input.
  The clip factor w is about C / (huge |g_0|), so w g_0 falls below 2^-126,
  where the CPU and XLA flush float32 results to zero: the huge position's
  term vanishes and its partner is left uncancelled. Targets set the output
  gradients (under a squared error g is proportional to prediction -
  target).
* `tiny_inputs`: inputs at 2^-126 / |M| and at the smallest normal and a
  subnormal magnitude (M the first layer's kernel, the offset of weight
  decay before clipping is lambda M): every product x_k M_ko is flushed,
  while x^T g is not, because the output gradient is huge, from a sample
  weight up to 3e38 (or a huge target when there is no weight). The
  output gradient is aligned with M^T x so that the record's gradient meets
  the weight-decay offset, and scaled so that its norm is near the offset's
  (or C).

>>> import numpy as np
>>> space = RecordSpace((np.zeros((4, 2, 3), np.float32), np.zeros((4, 2, 1), np.float32)),
...                     label_classes=1)
>>> [name for name, _ in extremes(space, space.template)][:2]
['inputs x 1e-40', 'targets x 1e-40']
"""

import numpy as np
import tensorflow as tf

# 1e-40 is subnormal in float32 (below 2^-126); 3e38 is near float32's largest.
MAGNITUDES = (1e-40, 1e-30, 1e-10, 1e10, 1e30, 3e38)

# (|g|, |delta|) of the alternating targets, and (A, delta) of alternating
# inputs: depth of the cancellation 1e4 (float32 keeps 7 digits of the
# squares, 1e8 of cancellation deep), then 1e4 again at larger scale.
_TARGET_CANCELLATIONS = ((1e6, 1e2), (1e8, 1e4), (1e4, 1.0))
_INPUT_CANCELLATIONS = ((1e6, 1e2), (1e8, 1e4))


class RecordSpace:
    """The leaves of a record: role, kind and range of each.

    Args:
        data: (x, y) or (x, y, sample_weight), arrays with one row a record.
        label_classes: classes of integer targets (the model's last output
            dimension), or 1 when unknown (then the data's range is used);
            for a model with several outputs, a list: one per target leaf,
            in the outputs' order.

    Attributes:
        template: the data's first record.
        roles: per flat leaf, "x", "y" or "w".
        kinds: per flat leaf, "float", "int" or "bool".
        ranges: per flat leaf, (low, high) of an int leaf, else None.
    """

    def __init__(self, data, label_classes):
        self.structure = data
        flat = tf.nest.flatten(data)
        parts = [tf.nest.flatten(part) for part in data]
        self.roles = [role for role, part in zip("xyw", parts) for _ in part]
        self.template = tf.nest.pack_sequence_as(data, [np.asarray(a[0]) for a in flat])
        self.kinds, self.ranges = [], []
        per_target = list(label_classes) if isinstance(label_classes, (list, tuple)) else None
        for role, array in zip(self.roles, flat):
            classes = label_classes
            if role == "y" and per_target is not None:
                classes = per_target.pop(0) if per_target else 1
            array = np.asarray(array)
            kind = "bool" if array.dtype == bool else (
                "float" if np.issubdtype(array.dtype, np.floating) else "int")
            self.kinds.append(kind)
            if kind != "int":
                self.ranges.append(None)
            elif role == "y" and classes > 1:
                self.ranges.append((0, int(classes) - 1))
            else:
                self.ranges.append((int(array.min()), int(array.max())))

    def leaves(self, record):
        return [np.array(leaf, copy=True) for leaf in tf.nest.flatten(record)]

    def pack(self, leaves):
        return tf.nest.pack_sequence_as(self.structure, leaves)

    def indices(self, role=None, kind=None):
        """Flat indices of the leaves with this role and kind (None: any)."""
        return [i for i, (r, k) in enumerate(zip(self.roles, self.kinds))
                if role in (None, r) and kind in (None, k)]

    def target_index(self):
        return self.indices("y")[0]

    def random_value(self, index, rng, size=None):
        """Random values for an int or bool leaf, within its range."""
        if self.kinds[index] == "bool":
            return rng.random(size) < 0.5
        low, high = self.ranges[index]
        return rng.integers(low, high + 1, size)


def extremes(space, base):
    """Candidates with extreme magnitudes (module docstring)."""
    out = []
    inputs, target = space.indices("x", "float"), space.indices("y", "float")
    for magnitude in MAGNITUDES:
        for name, chosen, fill in (
            ("inputs x", inputs, False), ("targets x", target, False),
            ("inputs and targets x", inputs + target, False), ("inputs =", inputs, True),
            ("sample weight =", space.indices("w", "float"), True),
        ):
            if not chosen:
                continue
            leaves = space.leaves(base)
            with np.errstate(over="ignore"):  # x 3e38 overflows to inf: a candidate too
                for i in chosen:
                    leaves[i] = (np.full_like(leaves[i], magnitude, np.float64) if fill
                                 else leaves[i] * magnitude)
            out.append((f"{name} {magnitude:g}", space.pack(leaves)))
    for index in space.indices(kind="int"):
        for end in space.ranges[index]:
            leaves = space.leaves(base)
            leaves[index] = np.full_like(leaves[index], end)
            out.append((f"{'labels' if space.roles[index] == 'y' else 'ids'} = {end}", space.pack(leaves)))
    return out


def nonfinite(space, base):
    """Candidates with NaN or infinite entries (module docstring)."""
    out = []
    for index in space.indices(kind="float"):
        for value in (np.nan, np.inf, -np.inf):
            for every in (False, True):
                leaves = space.leaves(base)
                leaf = np.array(leaves[index], np.float64)
                if every:
                    leaf[...] = value
                else:
                    leaf.reshape(-1)[0] = value
                leaves[index] = leaf
                where = {"x": "input", "y": "target", "w": "sample weight"}[space.roles[index]]
                out.append((f"{where} {'all' if every else 'one entry'} {value}", space.pack(leaves)))
    return out


def _signs(positions):
    """+1, -1, +1, ... over positions; 0 on a last, unpaired position."""
    signs = np.where(np.arange(positions) % 2 == 0, 1.0, -1.0)
    if positions % 2:
        signs[-1] = 0.0
    return signs


def _unit(rng, shape):
    vector = rng.normal(size=shape)
    return vector / max(np.linalg.norm(vector), 1e-30)


def _alternating(shape, rng, amplitude, delta):
    """+-amplitude u + delta v along axis 0 (u, v random unit vectors)."""
    u, v = _unit(rng, shape[1:]), _unit(rng, shape[1:])
    signs = _signs(shape[0]).reshape((-1,) + (1,) * (len(shape) - 1))
    return signs * amplitude * u + delta * v


def _tied_inputs(space, base, rng, amplitude, delta=None):
    """Every input position the same (delta None) or alternating inputs."""
    leaves = space.leaves(base)
    for index in space.indices("x"):
        leaf, kind = leaves[index], space.kinds[index]
        if kind == "float" and leaf.ndim >= 2:
            if delta is None:
                leaves[index] = np.broadcast_to(amplitude * _unit(rng, leaf.shape[1:]), leaf.shape).copy()
            else:
                leaves[index] = _alternating(leaf.shape, rng, amplitude, delta)
        elif kind == "int" and leaf.ndim >= 1:
            first, second = space.random_value(index, rng, 2)
            leaves[index] = np.full_like(leaf, first)
            if delta is not None and leaf.shape[0] > 1:
                leaves[index][1::2] = second
        elif kind == "bool":
            leaves[index] = np.ones_like(leaf)
    return leaves


def _alternating_targets(space, leaves, prediction, rng, amplitude, delta):
    """Targets around `prediction` that alternate by +-amplitude (float), or
    two alternating classes (int); None if the target has no positions."""
    index = space.target_index()
    target = leaves[index]
    if space.kinds[index] == "int":
        if target.ndim == 0:
            return None
        first, second = space.random_value(index, rng, 2)
        target = np.full_like(target, first)
        target[1::2] = second
        return target
    if target.ndim == 0 or (target.ndim == 1 and target.shape[0] < 2):
        return None
    shape = target.shape if target.ndim >= 2 else target.shape + (1,)
    center = prediction.reshape(shape) if prediction.size == target.size else np.zeros(shape)
    return (center + _alternating(shape, rng, amplitude, delta)).reshape(target.shape)


def cancelling_positions(space, base, predict, rng, seeds=4):
    """Candidates whose per-position gradient terms cancel (module docstring).

    Args:
        space: the `RecordSpace`.
        base: template record.
        predict: callable(record) -> the model's prediction, float64.
        rng: numpy Generator.
        seeds: random directions tried per pattern.

    Returns:
        List of (name, record); empty when no input or target has positions.
    """
    has_positions = any(
        np.ndim(leaf) >= (2 if kind == "float" else 1)
        for leaf, kind, role in zip(space.leaves(base), space.kinds, space.roles) if role in "xy"
    )
    if not has_positions:
        return []
    out = []
    index = space.target_index()
    for _ in range(seeds):
        for amplitude, delta in _TARGET_CANCELLATIONS:
            leaves = _tied_inputs(space, base, rng, 1.0 if amplitude > 1e4 else 1e3)
            target = _alternating_targets(space, leaves, predict(space.pack(leaves)), rng, amplitude, delta)
            if target is not None:
                leaves[index] = target
                out.append((f"tied inputs, targets +-{amplitude:g} (delta {delta:g})", space.pack(leaves)))
        for amplitude, delta in _INPUT_CANCELLATIONS:
            leaves = _tied_inputs(space, base, rng, amplitude, delta)
            if space.kinds[index] == "float":
                prediction = predict(space.pack(leaves))
                if prediction.size == leaves[index].size:
                    leaves[index] = prediction.reshape(leaves[index].shape) + _unit(rng, leaves[index].shape)
            out.append((f"inputs +-{amplitude:g} (delta {delta:g})", space.pack(leaves)))
    return out


# float32's smallest normal: CPU and XLA flush smaller results to zero.
SMALLEST_NORMAL = 2.0**-126
HUGE = 3e38
_FLUSH_GRADIENTS = (1e-33, 1e-35)  # |g_0|: normal, while w g_0 is not
_TINY_RATIOS = (0.5, 1.0, 2.0)      # record's gradient norm / the offset's (or C)


def first_kernel(model, space):
    """The first layer's kernel that reads the record's float input, as
    float64 [features, outputs] (the input's last axis first), or None.

    The layer is the first one with a weight of rank >= 2 that has an axis
    of the input's feature size (a Dense, convolution or EinsumDense
    kernel); its other axes are flattened into the outputs.
    """
    inputs = space.indices("x", "float")
    if len(inputs) != 1:
        return None
    leaf = np.asarray(space.leaves(space.template)[inputs[0]])
    if leaf.ndim < 1:
        return None
    features = leaf.shape[-1]
    for layer in model.layers:
        for weight in layer.trainable_weights:
            shape = tuple(weight.shape)
            if len(shape) < 2:
                continue
            axis = len(shape) - 2 if shape[-2] == features else (
                shape.index(features) if features in shape else None)
            if axis is not None:
                value = np.asarray(weight.numpy(), np.float64)
                return np.moveaxis(value, axis, 0).reshape(features, -1)
    return None


def _positions(space, base, prediction, least):
    """(input index, target index, flat target shape) when the record has one
    float input of rank >= 1 and a float target with `least` or more output
    vectors whose shape the prediction has; else None."""
    inputs = space.indices("x", "float")
    target = space.target_index()
    if len(inputs) != 1 or space.kinds[target] != "float":
        return None
    leaves = space.leaves(base)
    y = leaves[target]
    if y.ndim == 0 or prediction.size != y.size:
        return None
    flat = (y.size // y.shape[-1], y.shape[-1]) if y.ndim >= 2 else (1, y.size)
    return (inputs[0], target, flat) if flat[0] >= least else None


def flush_to_zero(space, base, predict, kernel):
    """Huge inputs behind zero kernel rows, cancelled exactly (module docstring).

    Args:
        space: the `RecordSpace`.
        base: template record.
        predict: callable(record) -> the model's prediction, float64.
        kernel: `first_kernel`'s value, or None.

    Returns:
        List of (name, record); empty when the kernel has no zero rows or the
        record has no two positions.
    """
    if kernel is None:
        return []
    zero = np.flatnonzero(np.all(kernel == 0.0, axis=1))
    features = kernel.shape[0]
    if zero.size == 0 or features < 2:
        return []
    # Huge inputs where the kernel is zero (the prediction stays finite); the
    # ordinary input is a feature outside them, or the last zero one.
    huge = zero if zero.size < features else zero[:-1]
    ordinary = int(np.setdiff1d(np.arange(features), huge)[0])
    found = _positions(space, base, predict(base), least=2)
    if found is None:
        return []
    x_index, y_index, (outputs, width) = found
    leaves = space.leaves(base)
    x_shape = leaves[x_index].shape
    if int(np.prod(x_shape[:-1], dtype=np.int64)) < 2:
        return []
    x = np.zeros((int(np.prod(x_shape[:-1], dtype=np.int64)), features))
    x[0, huge] = HUGE
    x[1, huge] = 1.0
    x[1, ordinary] = 1.0
    leaves[x_index] = x.reshape(x_shape)
    record = space.pack(leaves)
    prediction = predict(record).reshape(outputs, width)
    u = np.ones(width) / np.sqrt(width)
    out = []
    for tiny in _FLUSH_GRADIENTS:
        gradient = np.zeros((outputs, width))
        gradient[0], gradient[1] = tiny * u, -HUGE * tiny * u
        # mse: g = 2 (p - y) / (outputs x width), so y = p - g (outputs x width) / 2.
        target = prediction - gradient * (outputs * width / 2.0)
        leaves = space.leaves(record)
        leaves[y_index] = target.reshape(leaves[y_index].shape)
        out.append((f"huge inputs {HUGE:g} x{huge.size} behind zero kernel rows, output "
                    f"gradient {tiny:g} cancelled", space.pack(leaves)))
    return out


def tiny_inputs(space, base, predict, kernel, scale):
    """Inputs whose products with the kernel flush, with a huge output
    gradient (module docstring).

    Args:
        space: the `RecordSpace`.
        base: template record.
        predict: callable(record) -> the model's prediction, float64.
        kernel: `first_kernel`'s value, or None.
        scale: the norm the record's gradient should reach: the weight-decay
            offset's, or C.

    Returns:
        List of (name, record); empty without a kernel whose outputs are the
        target's.
    """
    if kernel is None or not np.any(kernel):
        return []
    found = _positions(space, base, predict(base), least=1)
    if found is None:
        return []
    x_index, y_index, (outputs, width) = found
    if kernel.shape[1] != width:
        return []
    weights = space.indices("w", "float")
    leaves = space.leaves(base)
    x_shape = leaves[x_index].shape
    positions = int(np.prod(x_shape[:-1], dtype=np.int64)) if len(x_shape) > 1 else 1
    direction = np.sign(np.linalg.svd(kernel, full_matrices=False)[0][:, 0])
    direction[direction == 0] = 1.0
    largest = float(np.max(np.abs(kernel)))
    magnitudes = [SMALLEST_NORMAL, 2.0**-136]  # the smallest normal, and a subnormal
    if SMALLEST_NORMAL / largest > SMALLEST_NORMAL * 1.01:
        magnitudes.insert(1, SMALLEST_NORMAL / largest * 0.99)
    out = []
    for magnitude in magnitudes:
        x = np.zeros((positions, kernel.shape[0]))
        x[0] = magnitude * direction
        along = x[0] @ kernel                   # M^T x: the gradient meets the kernel
        v = along / np.linalg.norm(along)
        leaves = space.leaves(base)
        leaves[x_index] = x.reshape(x_shape)
        if weights:
            leaves[weights[0]] = np.full_like(leaves[weights[0]], HUGE, np.float64)
        record = space.pack(leaves)
        prediction = predict(record).reshape(outputs, width)
        weight = HUGE if weights else 1.0
        for ratio in _TINY_RATIOS:
            # |record's gradient| = |x| |g| with g = weight (2 / size) (p - y).
            amplitude = ratio * scale / (np.linalg.norm(x[0]) * weight * 2.0 / prediction.size)
            target = prediction.copy()
            target[0] -= amplitude * v
            leaves = space.leaves(record)
            leaves[y_index] = target.reshape(leaves[y_index].shape)
            out.append((f"inputs {magnitude:.3g} (products with the kernel flushed), "
                        f"{'sample weight' if weights else 'target'} huge, gradient "
                        f"{ratio:g} x {scale:.3g}", space.pack(leaves)))
    return out
