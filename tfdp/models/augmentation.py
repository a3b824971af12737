"""Augmentation multiplicity: k augmented copies of each example, one unit.

`fit(x, y, augment=fn, augmentations=k)` (De, Berrada, Hayes, Smith and
Balle 2022, "Unlocking high-accuracy differentially private image
classification through scale"; jax-privacy's augmult) replaces each sampled
example in the train step by k copies `fn(x_i, seed_ij)`, j < k, weighs each
copy's loss by 1/k and joins the k copies' gradients into one before
clipping, with the grouping user-level DP uses
(`PerExampleGradients.grouped`, `tfdp.models.user_level`). The unit clipped
to `l2_norm_clip` is still the example, so sampling (Poisson over examples),
the noise and the ledger are those of DP-SGD without augmentation.

A mean, not a sum: the clipping bound is per unit either way, but the mean of
the k copies' gradients is on the scale of one example's gradient, so the
learning rate and `l2_norm_clip` tuned without augmentation keep their
meaning, and k = 1 is training without multiplicity.

Randomness: copy j of example i is augmented with the seed
`(key_0 ^ h(x_i), key_1 ^ (p * 2^16 + j))`, where `key` is a secret key of
this step (two 64-bit words drawn under the optimizer's step key folded
with a constant of its own, so it is fresh for every step and every
unseeded fit, and, being a draw's output, tells `fn` nothing of the noise's
key), `h(x_i)` a hash of the
example's own content and p its position inside its unit (0, or the
record's place among a user's k records). For a fixed key each unit's
contribution is a function of its own data only: adding, removing or
replacing another example changes neither its augmentation nor its clipped
gradient. `fn` sees one example at a time (no batch axis, so it cannot mix
examples) and is refused if it draws from a stateful generator (whose draws
depend on the batch position and the run's other draws), writes a variable,
runs Python, writes files, asserts on its input (a failed check on one
record stops training) or indexes by its values (a `tf.gather`, slice or
scatter whose index the example decides: out of range on one record, the
step fails), or if any tensor of its trace has a shape that is not
static (a shape that depends on the values lets a run-time shape check fail
on one record). It is traced once, checked, and that trace is the one the
step calls.

Example:

>>> import keras, numpy as np, tfdp
>>> def flip(x, seed):                                   # one example, its own seed
...     return tf.where(tf.random.stateless_uniform([], seed) < 0.5, -x, x)
>>> model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, seed=0),
...               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
>>> x, y = np.ones((60, 3), "float32"), np.zeros(60, "int64")
>>> _ = model.fit(x, y, augment=flip, augmentations=4, batch_size=10, verbose=0)
>>> model.privacy.relation
'add_or_remove'
"""

import dis
import inspect
import random
import types

import keras
import numpy as np
import tensorflow as tf

from tfdp.mechanisms import dpsgd
from tfdp.models.state_writes import (_OUTPUT_OPS, _OUTPUT_PREFIXES, _PYTHON_OPS, _READS,
                                      function_graphs, reads_values)

__all__ = ["Augmentation", "check_augmentation", "example_hashes"]

# Folded into the optimizer's step key: the augmentation key is not the noise key.
_KEY_DOMAIN = 0x61756731
# Stateful ops that only read and draw nothing. Not Assert (allowed only on
# constants and static shapes): a check that fails on one record aborts the
# step, and whether training stopped tells that record.
_HARMLESS_STATEFUL = _READS | {"NoOp", "VarHandleOp"}


class Augmentation:
    """What `fit(augment=fn, augmentations=k)` asked for, checked.

    Args:
        augment: `fn(x, seed)` or `fn(x)` on one example (see
            `check_augmentation`), or None (copies unchanged).
        copies: k, the augmented copies of each example a step uses.
        takes_seed: whether `augment` takes the seed argument.
    """

    def __init__(self, augment, copies, takes_seed):
        self.augment = augment
        self.copies = int(copies)
        self.takes_seed = takes_seed
        self._traced = {}  # one example's specs -> the checked ConcreteFunction

    def __eq__(self, other):
        return isinstance(other, Augmentation) and (
            self.augment is other.augment and self.copies == other.copies)

    def __hash__(self):
        return hash((id(self.augment), self.copies))

    def traced(self, specs):
        """`augment` traced once on one example of `specs`, checked, as the
        ConcreteFunction the step calls: the trace that is checked is the
        one that runs (a second trace of a Python function may build other
        ops than the first).

        Args:
            specs: a nest of `tf.TensorSpec`, one example (no batch axis).

        Returns:
            A ConcreteFunction of (x, seed), or of x without the seed.

        Raises:
            ValueError: if the trace returns another structure, shape or
                dtype, or runs an op `check_augmentation` refuses.

        Example:

        >>> aug = Augmentation(lambda x, seed: -x, 2, True)
        >>> traced = aug.traced(tf.TensorSpec([3], tf.float32))
        >>> traced is aug.traced(tf.TensorSpec([3], tf.float32))
        True
        """
        key = repr(tf.nest.map_structure(lambda s: (s.shape.as_list(), s.dtype.name), specs))
        if key not in self._traced:
            self._traced[key] = _check_traced(self.augment, self.takes_seed, specs)
        return self._traced[key]

    def expand(self, x, targets, weights, mask, key, unit_rows=1, vectorized=True):
        """Each row's k augmented copies, consecutive, for the train step.

        Args:
            x: the batch's inputs (a nest of [B, ...] tensors).
            targets, weights, mask: the batch's targets (a nest), loss
                weights [B] and padding mask [B]; repeated k times each,
                weights divided by k (the unit's gradient is the mean).
            key: int64 [2], this step's augmentation key (`step_key`).
            unit_rows: rows a unit holds before augmentation (a user's k
                records in user-level DP; 1 otherwise): a row's position in
                its unit is part of its seed, so a user's repeated record
                gets other augmentations.
            vectorized: `tf.vectorized_map` over the copies (else
                `tf.map_fn`, which XLA compiles whatever `augment` does).

        Returns:
            (x, targets, weights, mask) with k * B rows, copy j of row i at
            row i * k + j.

        Example:

        >>> aug = Augmentation(lambda x, seed: x + tf.cast(seed[1] % 2, x.dtype), 2, True)
        >>> x, t, w, m = aug.expand(tf.zeros([2, 1]), tf.constant([3, 4]), tf.ones([2]),
        ...                         tf.ones([2]), tf.constant([0, 0], tf.int64))
        >>> x.numpy().ravel().tolist(), t.numpy().tolist(), w.numpy().tolist()
        ([0.0, 1.0, 0.0, 1.0], [3, 3, 4, 4], [0.5, 0.5, 0.5, 0.5])
        """
        k = self.copies
        repeat = lambda t: tf.repeat(t, k, axis=0)  # noqa: E731
        rows = tf.shape(mask)[0]
        copy = tf.tile(tf.range(k, dtype=tf.int64), [rows])
        position = repeat(tf.range(tf.cast(rows, tf.int64)) % unit_rows)
        seeds = tf.stack([key[0] ^ repeat(example_hashes(x)),
                          key[1] ^ (position * 65536 + copy)], axis=1)
        copies = tf.nest.map_structure(repeat, x)
        if self.augment is not None:
            traced = self.traced(tf.nest.map_structure(
                lambda t: tf.TensorSpec(t.shape[1:], t.dtype), copies))
            one = (lambda a: traced(a[0], a[1])) if self.takes_seed else (
                lambda a: traced(a[0]))
            if vectorized:
                copies = tf.vectorized_map(one, (copies, seeds))
            else:
                signature = tf.nest.map_structure(
                    lambda t: tf.TensorSpec(t.shape[1:], t.dtype), copies)
                copies = tf.map_fn(one, (copies, seeds), fn_output_signature=signature)
        weights = repeat(weights) / k
        return copies, tf.nest.map_structure(repeat, targets), weights, repeat(mask)


def step_key(optimizer):
    """This step's augmentation key: two 64-bit words drawn (Philox) under the
    optimizer's secret step key folded with a constant of its own, so it is
    fresh each step (and each unseeded fit).

    `fn` sees the key (an all-zero example's hash is 0), so the key is a
    draw's output, never a seed word: folding alone would give
    `[U64(step key), constant]`, whose first word is the noise streams' own
    key word (`dpsgd.gaussian_noise_like` folds the same step key).
    """
    domain = dpsgd.step_seed(optimizer.step_key(), _KEY_DOMAIN)
    return tf.random.stateless_uniform([2], seed=domain, minval=None, maxval=None,
                                       dtype=tf.int64)


def example_hashes(x):
    """A 64-bit hash of each row's content, int64 [B].

    Multilinear over the rows' bit patterns (each leaf's elements, read as
    integers, times fixed pseudo-random int64 constants, summed with
    wrap-around): plain arithmetic, so XLA compiles it; two different rows
    collide with probability at most 2^-32.

    Example:

    >>> h = example_hashes(tf.constant([[1.0, 2.0], [1.0, 2.0], [2.0, 1.0]]))
    >>> bool(h[0] == h[1]), bool(h[0] == h[2])
    (True, False)
    """
    total = None
    for leaf_index, leaf in enumerate(tf.nest.flatten(x)):
        rows = tf.shape(leaf)[0]
        words = tf.reshape(_as_int64(leaf), [rows, -1])
        size = int(np.prod(leaf.shape[1:]))
        factors = tf.random.stateless_uniform(
            [size], seed=tf.constant([leaf_index, _KEY_DOMAIN], tf.int64), minval=None, maxval=None, dtype=tf.int64)
        leaf_hash = tf.reduce_sum(words * factors[None, :], axis=1)
        total = leaf_hash if total is None else total * 1000003 + leaf_hash
    return total


def _as_int64(tensor):
    """The tensor's elements as int64: a float's bit pattern, an integer's value."""
    if tensor.dtype.is_floating:
        bits = {2: tf.int16, 4: tf.int32, 8: tf.int64}[tensor.dtype.size]
        return tf.cast(tf.bitcast(tensor, bits), tf.int64)
    return tf.cast(tensor, tf.int64)


# The most copies of an example a step averages: the published gains level
# off by 16 to 32 copies, and every copy costs a forward and backward pass.
MAX_AUGMENTATIONS = 1024


def check_augmentation(augment, augmentations, sample_x, optimizer, rows=None):
    """Validates fit's `augment` and `augmentations`; an `Augmentation` or None.

    Args:
        augment: None, or a function of one example (its inputs as `x` is
            structured, without the batch axis) and, optionally, a seed (an
            int64 tensor [2] for `tf.random.stateless_*` and
            `tf.image.stateless_random_*` ops), returning an example of the
            same structure, shapes and dtypes: `fn(x, seed)` or `fn(x)`.
        augmentations: None or k >= 1, the augmented copies of each example
            (default 1 with `augment`).
        sample_x: the inputs of a one-example batch (their shapes and dtypes).
        optimizer: the model's tfdp optimizer.
        rows: the examples a step computes at once (its batch size, or
            physical_batch_size; times a user's records), for the message
            refusing more than `MAX_AUGMENTATIONS` copies.

    Raises:
        ValueError: naming the argument and the value received.

    Example:

    >>> import tfdp
    >>> optimizer = tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0)
    >>> check_augmentation(None, 0, tf.zeros([1, 3]), optimizer)
    Traceback (most recent call last):
    ...
    ValueError: Expected `augmentations` to be an int >= 1 ... Received: augmentations=0
    """
    if augmentations is not None and (
            isinstance(augmentations, bool) or not isinstance(augmentations, (int, np.integer))
            or augmentations < 1):
        raise ValueError(
            "Expected `augmentations` to be an int >= 1 (the augmented copies of each "
            f"example a step averages) or None. Received: augmentations={augmentations!r}"
        )
    if augmentations is not None and augmentations > MAX_AUGMENTATIONS:
        at_once = "" if rows is None else (
            f" (here {rows:,} examples x {int(augmentations):,} copies = "
            f"{rows * int(augmentations):,} forward and backward passes in one step)")
        raise ValueError(
            f"Expected `augmentations` <= {MAX_AUGMENTATIONS}: a step augments every example "
            "of its batch k times and computes a gradient for each copy, so its work and "
            f"memory grow k-fold{at_once}; the accuracy gained levels off by 16 to 32 "
            f"copies. Received: augmentations={augmentations!r}"
        )
    if augment is None:
        if augmentations is not None and augmentations > 1:
            raise ValueError(
                "augmentations=k averages k augmented copies of each example: pass "
                "augment=fn too (fn(x, seed) augments one example), or the k copies would "
                f"be identical. Received: augmentations={augmentations} and augment=None"
            )
        return None
    copies = 1 if augmentations is None else int(augmentations)
    takes_seed = _takes_seed(augment)
    if not takes_seed and copies > 1:
        raise ValueError(
            "augment takes one argument, so its k copies of an example would be identical: "
            "give it a second argument, the seed, and draw its randomness with "
            "tf.random.stateless_* or tf.image.stateless_random_* ops from it "
            f"(fn(x, seed)). Received: augment={_name(augment)} with augmentations={copies}"
        )
    _check_privatize(optimizer)
    _check_no_python_randomness(augment)
    augmentation = Augmentation(augment, copies, takes_seed)
    augmentation.traced(tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape[1:], t.dtype), sample_x))
    return augmentation


def _name(augment):
    return getattr(augment, "__qualname__", None) or type(augment).__name__


def _takes_seed(augment):
    if isinstance(augment, keras.layers.Layer) or not callable(augment):
        why = ("a Keras layer keeps its own random state (a SeedGenerator shared by the "
               "batch), so its draws are not keyed by example; call a stateless transform "
               "from a function fn(x, seed) instead") if callable(augment) else "it is not callable"
        raise ValueError(
            f"Expected `augment` to be a function fn(x, seed) or fn(x) of one example: {why}. "
            f"Received: augment={augment!r}"
        )
    try:
        parameters = list(inspect.signature(augment).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if any(p.kind == p.VAR_POSITIONAL for p in parameters) or (
            len(positional) >= 2 and len(required) <= 2):
        return True
    if len(positional) == 1:
        return False
    raise ValueError(
        "Expected `augment` to take one example and, optionally, a seed: fn(x, seed) or "
        f"fn(x). Received: augment={_name(augment)} with parameters "
        f"{[p.name for p in parameters]}"
    )


def _check_privatize(optimizer):
    from tfdp.optimizers import DPOptimizer

    privatize = getattr(optimizer, "privatize", None)
    if getattr(privatize, "__func__", privatize) is not DPOptimizer.privatize:
        name = type(optimizer).__name__
        raise ValueError(
            f"{name} cannot average augmented copies: it overrides privatize(), so its "
            "step does not clip each example's copies as one unit through DP-SGD's "
            "clipped sum (DPIS and AdaDP clip and analyse per-record gradients of their "
            "own). Train with DPSGD, DPOptimizer, SADPSGD or DPBandMF, or leave augment=None. "
            f"Received: augmentations with optimizer={name}"
        )


_PYTHON_RANDOM = ("random", "numpy.random", "numpy.random.mtrand", "numpy.random._generator")


def _python_random_source(value):
    """The name of Python's or NumPy's randomness that `value` is, or None."""
    if isinstance(value, types.ModuleType):
        return value.__name__ if value.__name__ in ("random", "numpy.random") else None
    if isinstance(value, (np.random.Generator, np.random.RandomState, random.Random)):
        return f"a {type(value).__module__}.{type(value).__name__}"
    module = getattr(value, "__module__", None)
    if callable(value) and module in _PYTHON_RANDOM:
        return f"{module}.{getattr(value, '__name__', '?')}"
    return None


_LOADS = {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF"}


def _python_randomness(augment):
    """Where `augment`'s own code (and the functions defined in it) loads
    Python's or NumPy's random numbers: a global or closure variable that is
    `random`, `numpy.random`, one of their functions or generators, or
    `numpy` followed by `.random`. None if nowhere."""
    function = getattr(augment, "__func__", augment)
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    scope = dict(getattr(function, "__globals__", {}))
    for name, cell in zip(code.co_freevars, getattr(function, "__closure__", None) or ()):
        try:
            scope[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    pending = [code]
    while pending:
        current = pending.pop()
        pending.extend(c for c in current.co_consts if inspect.iscode(c))
        instructions = list(dis.get_instructions(current))
        for index, instruction in enumerate(instructions):
            if instruction.opname not in _LOADS or instruction.argval not in scope:
                continue
            value = scope[instruction.argval]
            found = _python_random_source(value)
            following = instructions[index + 1] if index + 1 < len(instructions) else None
            if found is None and isinstance(value, types.ModuleType) and \
                    value.__name__ == "numpy" and following is not None and \
                    following.opname in ("LOAD_ATTR", "LOAD_METHOD") and \
                    following.argval == "random":
                found = f"{instruction.argval}.random"
            if found is not None:
                return found
    return None


def _constants(traced):
    """The values of a trace's constants, in order."""
    return [op.get_attr("value").SerializeToString() for op in _ops(traced.graph)
            if op.type == "Const"]


def _check_no_python_randomness(augment):
    """Refuses an `augment` that draws Python or NumPy random numbers: it runs
    once, when traced, so its draw is a constant of the graph and every copy
    of every step gets the same "random" augmentation."""
    source = _python_randomness(augment)
    if source is not None:
        raise ValueError(
            "augment must draw its randomness from its seed argument with stateless TF ops "
            "(tf.random.stateless_uniform, tf.image.stateless_random_crop, ...): Python's or "
            "NumPy's random numbers run once, when augment is traced, so every copy of "
            "every example in every step would get the same augmentation. Received: "
            f"augment={_name(augment)} using {source}"
        )


def _check_traced_again(augment, takes_seed, specs, traced):
    """Refuses an `augment` whose second trace holds other constants than its
    first: it draws random numbers (or reads other state) in Python, which the
    trace freezes (every copy identical)."""
    again = _trace(augment, takes_seed, specs)
    if _constants(again) != _constants(traced):
        raise ValueError(
            "augment gave other constants when traced twice: it draws random numbers in "
            "Python (random, numpy.random) or reads changing Python state, which runs once, "
            "when traced, so every copy of every example in every step would get the same "
            "augmentation. Draw randomness from its seed argument with stateless TF ops "
            f"(tf.random.stateless_uniform, ...). Received: augment={_name(augment)}"
        )


def _trace(augment, takes_seed, specs):
    seed = tf.TensorSpec([2], tf.int64)
    if takes_seed:
        return tf.function(lambda x, s: augment(x, s)).get_concrete_function(specs, seed)
    return tf.function(lambda x: augment(x)).get_concrete_function(specs)


def _check_traced(augment, takes_seed, specs):
    """Traces `augment` on one example of `specs`: same structure, shapes and
    dtypes out, and no op that draws from a stateful generator, writes state,
    runs Python or asserts, or whose output shape is not fully static.
    Returns the checked ConcreteFunction."""
    traced = _trace(augment, takes_seed, specs)
    out = traced.structured_outputs
    try:
        tf.nest.assert_same_structure(out, specs)
        same = all(
            isinstance(o, tf.Tensor) and o.dtype == s.dtype and o.shape == s.shape
            for o, s in zip(tf.nest.flatten(out), tf.nest.flatten(specs)))
    except (ValueError, TypeError):
        same = False
    if not same:
        shown = tf.nest.map_structure(
            lambda o: f"{o.dtype.name}{o.shape}" if isinstance(o, tf.Tensor) else repr(o), out)
        wanted = tf.nest.map_structure(lambda s: f"{s.dtype.name}{s.shape}", specs)
        raise ValueError(
            "Expected `augment` to return one example shaped as its input (the model takes "
            f"it in place of the example): {wanted}. Received: augment={_name(augment)} "
            f"returning {shown}"
        )
    seed_inputs = {t.name for t in traced.graph.inputs[len(tf.nest.flatten(specs)):]
                   if takes_seed} if takes_seed else set()
    for op in _ops(traced.graph):
        if op.type == "Assert":
            if not reads_values(op):  # a check of constants and static shapes only
                continue
            raise ValueError(
                "augment must not assert on its input: a check that fails on one record "
                "stops training, and whether training stopped tells that record (a release "
                "no noise covers). Drop the assertion (tf.debugging.assert_*, tf.Assert) or "
                "make the transform valid for every input (clip or replace the value). "
                f"Received: augment={_name(augment)} running op '{op.name}' ({op.type})"
            )
        if op.type in _PYTHON_OPS or op.type in _OUTPUT_OPS or op.type.startswith(
                _OUTPUT_PREFIXES) or (op._is_stateful and op.type not in _HARMLESS_STATEFUL):  # pylint: disable=protected-access
            raise ValueError(
                "augment must draw its randomness from its seed argument with stateless "
                "ops (tf.random.stateless_uniform, tf.image.stateless_random_crop, ...) and "
                "change nothing else: a stateful generator (tf.random.uniform, "
                "tf.image.random_flip_left_right, a Keras RandomFlip layer) draws by batch "
                "position and the run's other draws, and a variable write, Python or a "
                "file write would keep or release training records. Received: "
                f"augment={_name(augment)} running op '{op.name}' ({op.type})"
            )
        # A variant (a TensorList) or resource handle's shape says nothing of what
        # it holds; the tensors read out of it are checked.
        dynamic = [t for t in op.outputs if not t.shape.is_fully_defined()
                   and t.dtype not in (tf.variant, tf.resource)]
        if dynamic:
            raise ValueError(
                "augment must give every tensor a static shape (the example's shape is "
                "static): a shape that depends on the values (tf.boolean_mask, tf.where "
                "with one argument, tf.unique, ...) lets a run-time shape check (tf.reshape, "
                "tf.ensure_shape, broadcasting) fail on some records only, and whether "
                "training stopped tells that record. Compute on the whole tensor "
                "(tf.where(cond, x, y), masks multiplied in) instead. Received: "
                f"augment={_name(augment)} running op '{op.name}' ({op.type}) with output "
                f"shape {dynamic[0].shape}"
            )
        if op.type in _INDEXING and _indexed_by_values(op, seed_inputs):
            raise ValueError(
                "augment must not index by the example's values (a tf.gather, slice or "
                "scatter whose index is computed from the input): an index out of range "
                "fails on that record only, stops training, and the error may print it "
                "(a release no noise covers). Index by the seed or by constants, or clip "
                "the index into range (tf.clip_by_value) first. Received: "
                f"augment={_name(augment)} running op '{op.name}' ({op.type})"
            )
    _check_traced_again(augment, takes_seed, specs, traced)
    return traced


# Ops that fail on an index out of range: their index inputs (all but the first).
_INDEXING = {"GatherV2", "Gather", "GatherNd", "ResourceGather", "ResourceGatherNd",
             "Slice", "StridedSlice", "ScatterNd", "TensorScatterUpdate", "TensorScatterAdd",
             "TensorScatterSub", "TensorScatterMax", "TensorScatterMin"}
_SHAPE_OPS = {"Shape", "ShapeN", "Rank", "Size"}


def _indexed_by_values(op, seed_inputs):
    """Whether an index of `op` may be computed from the example's values:
    reached from a function input other than the seed (a branch's argument
    counts) other than through a fully known shape. An index that is itself
    `tf.clip_by_value`d into range (constant bounds within the indexed
    axis's length, nothing computed after the clip) cannot fail, and is
    accepted."""
    length = _index_range(op)
    pending, seen = [(t, True) for t in op.inputs[1:]], set()
    while pending:
        tensor, direct = pending.pop()
        producer = tensor.op
        if producer.type == "Const" or tensor.name in seed_inputs:
            continue
        if (producer.name, direct) in seen:
            continue
        seen.add((producer.name, direct))
        if direct and _clipped(producer, length):
            continue
        if producer.type in _SHAPE_OPS and all(
                t.shape.is_fully_defined() for t in producer.inputs):
            continue
        if producer.type == "Placeholder":
            return True
        passes_on = direct and producer.type in ("Identity", "Cast")
        pending.extend((t, passes_on) for t in producer.inputs)
    return False


def _index_range(op):
    """The length of the axis `op` indexes, when static (a gather's axis),
    else the shortest static dimension of what it indexes; None if unknown."""
    params = op.inputs[0]
    if not params.shape.is_fully_defined() or params.shape.rank == 0:
        return None
    dims = params.shape.as_list()
    if op.type == "GatherV2":
        axis = tf.get_static_value(op.inputs[2])
        if axis is None:
            return None
        return dims[int(axis)]
    return min(dims)


def _clipped(op, length):
    """Whether `op` bounds its value into [0, length - 1] with constants
    (`tf.clip_by_value`: a maximum of a minimum, or the other way round, each
    with a constant)."""
    if length is None:
        return False
    if op.type == "ClipByValue":
        bounds = (tf.get_static_value(op.inputs[1]), tf.get_static_value(op.inputs[2]))
    elif op.type in ("Maximum", "Minimum"):
        inner = {"Maximum": "Minimum", "Minimum": "Maximum"}[op.type]
        outer = next((tf.get_static_value(t) for t in op.inputs if t.op.type == "Const"), None)
        nested = next((t.op for t in op.inputs if t.op.type == inner), None)
        other = None if nested is None else next(
            (tf.get_static_value(t) for t in nested.inputs if t.op.type == "Const"), None)
        if outer is None or other is None:
            return False
        bounds = (outer, other) if op.type == "Maximum" else (other, outer)
    else:
        return False
    if any(b is None for b in bounds):
        return False
    low, high = (int(b) if getattr(b, "ndim", 0) == 0 else None for b in bounds)
    return low is not None and high is not None and 0 <= low and high <= length - 1


def _ops(graph, seen=None):
    """Every op of `graph` and of the functions its ops call."""
    seen = set() if seen is None else seen
    for op in graph.get_operations():
        yield op
        for _, nested in function_graphs(op, graph):
            if nested is not None and id(nested) not in seen:
                seen.add(id(nested))
                yield from _ops(nested, seen)
