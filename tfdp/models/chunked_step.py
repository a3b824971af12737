"""Physical batches: one logical Poisson batch's per-example work in chunks.

DP needs large logical batches (the accounting sees `batch_size`), while
per-example gradients must fit in memory. With `physical_batch_size=k` the
train step walks the padded logical batch in chunks of k rows
(`tf.while_loop`): each chunk's per-example gradients are computed, clipped
and summed (`DPOptimizer.clipped_sum`), and only the running sum survives
the chunk. Every example's clipping factor depends on its own gradient only,
so the total equals the unsplit clipped sum; noise is then added once for
the logical step (`DPOptimizer.noisy_gradients`, same noise key), and the
ledger charges one Poisson step as before. Chunks holding only padding
(those after the last drawn row) are skipped, and without XLA the last
chunk ends at the last drawn row (a draw of 9 in chunks of 8 runs 8 + 1
rows, not 16); under XLA every chunk has k rows (a static shape).

Memory: the per-example work (activations, per-example gradients or their
factors) and the predictions scale with k: compiled metrics are updated
chunk by chunk, so a language model's [k, S, vocabulary] logits are dropped
with their chunk. The logical batch's inputs, labels and losses ([B] rows
each) are held whole.

Example:

>>> import keras, numpy as np, tfdp
>>> model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
>>> model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, seed=0),
...               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
>>> x, y = np.ones((64, 4), "float32"), np.zeros(64, "int64")
>>> _ = model.fit(x, y, batch_size=32, physical_batch_size=8, verbose=0)
"""

import numpy as np
import tensorflow as tf

from tfdp.data.poisson import DEFAULT_OVERFLOW_PROBABILITY, padded_batch_size
from tfdp.models.state_writes import checked_per_example_pass, seed_generators
from tfdp.models.user_level import per_user_gradients
from tfdp.per_example import compute_per_example_gradients, step_keys


def unsplittable_reason(optimizer):
    """Why `optimizer`'s step cannot be split into physical batches, or None.

    A mechanism says so itself (`physical_batches_unsupported`); a subclass
    (or an instance) that overrides `privatize()` cannot either: the chunked
    step sums `clipped_sum` over chunks and calls `noisy_gradients`, so an
    override would be bypassed.
    """
    from tfdp.optimizers import DPOptimizer

    reason = getattr(optimizer, "physical_batches_unsupported", None)
    privatize = getattr(optimizer, "privatize", None)
    if reason is None and getattr(privatize, "__func__", privatize) is not DPOptimizer.privatize:
        reason = "it overrides privatize(), so its step is not a sum of clipped chunks."
    return reason


def check_splittable(optimizer, physical_batch_size):
    """Raises ValueError if `optimizer`'s step cannot run in physical batches.

    `fit` checks it with the other arguments, and `DPModel.train_step` again
    before it charges the step (an optimizer compiled after a chunked fit,
    its train step driven by hand): a refused step is not charged.

    Example:

    >>> import tfdp
    >>> check_splittable(tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0), 8)
    >>> check_splittable(tfdp.optimizers.AdaDP(0.01, noise_multiplier=1.0), 8)
    Traceback (most recent call last):
    ...
    ValueError: AdaDP cannot split a logical batch into physical batches: ...
    """
    reason = unsplittable_reason(optimizer)
    if reason:
        name = type(optimizer).__name__
        raise ValueError(
            f"{name} cannot split a logical batch into physical batches: {reason} "
            "Leave physical_batch_size=None (the whole logical batch at once) and "
            "lower batch_size if memory is short, or train with DPSGD, "
            f"DPOptimizer or SADPSGD. Received: physical_batch_size={physical_batch_size} "
            f"with optimizer={name}"
        )


def check_physical_batch_size(optimizer, physical_batch_size, num_examples, batch_size):
    """Validates `fit`'s `physical_batch_size` against `optimizer` and the data.

    A chunk never needs more rows than a padded logical batch has (a larger
    value would only compute padding, and past 2^31 - 1 it overflows the
    step's int32 row arithmetic), so values above the padded batch length
    (`PoissonSampler(num_examples, batch_size).padded_size`) are refused
    with the largest useful value.

    Args:
        optimizer: the model's tfdp optimizer.
        physical_batch_size: None (the whole logical batch at once) or an
            int >= 1.
        num_examples: the number of training records N.
        batch_size: the expected logical batch size b.

    Returns:
        The value as a Python int, or None.

    Raises:
        ValueError: for a value that is not an int in [1, padded batch
            length], or a mechanism that cannot split its step (it says why
            and what to do instead).

    Example:

    >>> import tfdp
    >>> optimizer = tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    >>> check_physical_batch_size(optimizer, 64, num_examples=60000, batch_size=256)
    64
    >>> check_physical_batch_size(optimizer, 2**31, num_examples=60000, batch_size=256)
    Traceback (most recent call last):
    ...
    ValueError: Expected `physical_batch_size` <= 336, ...
    """
    if physical_batch_size is None:
        return None
    if isinstance(physical_batch_size, bool) or not isinstance(
        physical_batch_size, (int, np.integer)
    ) or physical_batch_size < 1:
        raise ValueError(
            "Expected `physical_batch_size` to be an int >= 1 or None. "
            f"Received: physical_batch_size={physical_batch_size!r}"
        )
    check_splittable(optimizer, physical_batch_size)
    rows = padded_batch_size(num_examples, batch_size / num_examples,
                             overflow_probability=DEFAULT_OVERFLOW_PROBABILITY)
    if physical_batch_size > rows:
        raise ValueError(
            f"Expected `physical_batch_size` <= {rows}, the padded length of a logical "
            f"batch (batch_size={batch_size} of {num_examples} examples): a chunk of "
            f"more rows would only compute padding. Pass physical_batch_size={rows} or "
            f"less, or None for the whole batch at once. Received: "
            f"physical_batch_size={physical_batch_size}"
        )
    return int(physical_batch_size)


def chunked_private_gradients(model, x, y, weights, step_info, physical_batch_size,
                              loss_fn=None, update_metrics=None, examples_per_user=None):
    """The private part of a train step, over chunks of the logical batch.

    Args:
        model: the compiled `DPModel` / `DPSequential`.
        x, y: the logical batch's inputs and targets (B rows, padding included).
        weights: float [B], sample weight times padding mask.
        step_info: the step's dict ("mask", "expected_batch_size").
        physical_batch_size: k, rows of per-example work at once.
        loss_fn: per-example loss (default: the model's compiled one; a
            language model's per-token weighted loss takes (y, token weights)
            as `y`).
        update_metrics: None, or `update_metrics(x, y, y_pred, weights,
            mask, losses)` called with each chunk's rows, so the chunk's
            predictions (a language model's [k, S, vocabulary] logits) are
            dropped with the chunk instead of being stacked for the batch.
        examples_per_user: None, or k for user-level DP: the batch's rows are
            users' k consecutive records, a chunk holds `physical_batch_size`
            whole users (k times as many rows) and is clipped per user
            (`tfdp.models.user_level`).

    The caller has checked `check_splittable(model.optimizer, ...)` (the
    train step does, before it charges the step): an optimizer that
    overrides `privatize()` would be bypassed here.

    Returns:
        (noisy gradients aligned with `model.trainable_variables`, stats
        dict, per-example losses [B]); rows in skipped all-padding chunks
        have loss 0 (their weight is 0).
    """
    optimizer = model.optimizer
    variables = list(model.trainable_variables)
    mask = tf.cast(step_info["mask"], tf.float32)
    per_user = examples_per_user
    k = int(physical_batch_size) * (per_user or 1)  # rows a chunk: whole users
    rows = tf.shape(mask)[0]
    # Padding rows sit after the drawn ones; chunks past the last drawn row hold none.
    live_rows = tf.reduce_max(tf.where(mask > 0, tf.range(1, rows + 1), 0))
    num_chunks = (live_rows + k - 1) // k
    static_chunks = bool(model.jit_compile)

    def chunk_of(start):
        if static_chunks:  # XLA: k rows every time; the tail repeats the last row, mask 0
            position = start + tf.range(k)
            index = tf.minimum(position, rows - 1)
            inside = tf.cast(position < rows, tf.float32)
        else:  # the last chunk ends at the last drawn row: no work on padding
            index = tf.range(start, tf.minimum(start + k, live_rows))
            inside = 1.0
        take = lambda a: tf.gather(a, index)  # noqa: E731
        return (tf.nest.map_structure(take, x), tf.nest.map_structure(take, y),
                take(weights) * inside, take(mask) * inside)

    # Every chunk draws the step's seeds (`step_keys`), so a random layer
    # (keyed per example or Keras's own) gives each example the same draws
    # whichever chunk holds it: a record drawn before it would otherwise move
    # it to a later chunk, onto a later seed. The state
    # saved with the model would also count the records drawn (the chunks are
    # the draw's): after the chunks it is set one step past where the step
    # began ([seed + 1, counter]: no step's seed comes again), whatever was
    # drawn.
    generators = [(generator, tf.identity(generator.state.value))
                  for generator in seed_generators(model)]

    def body(i, sums, counts, losses):
        step_keys.restart_chunk()
        cx, cy, cweights, cmask = chunk_of(i * k)
        with checked_per_example_pass(model):  # the layers write nothing (state_writes)
            per_example, y_pred, chunk_losses = compute_per_example_gradients(
                model, cx, cy, cweights, loss_fn or model._per_example_loss,
                model.per_example_gradients
            )
        if [id(v) for v in per_example.variables] != [id(v) for v in variables]:
            raise ValueError("Per-example gradients must follow model.trainable_variables.")
        unit_info = dict(step_info, mask=cmask)
        if per_user is not None:
            per_example, unit_info = per_user_gradients(per_example, unit_info, per_user)
        chunk_sums, chunk_counts = optimizer.clipped_sum(per_example, unit_info)
        sums = [s + tf.cast(c, s.dtype) for s, c in zip(sums, chunk_sums)]
        counts = {name: total + chunk_counts[name] for name, total in counts.items()}
        chunk_losses = tf.cast(chunk_losses, tf.float32)
        if update_metrics is not None:
            update_metrics(cx, cy, y_pred, cweights, cmask, chunk_losses)
        return i + 1, sums, counts, losses.write(i, chunk_losses)

    start = (
        tf.constant(0),
        [tf.zeros(v.shape, tf.float32) for v in variables],
        # Counts that add up over chunks (non-finite examples; adaptive
        # clipping's centred count of unclipped units).
        {name: tf.constant(0.0) for name in (
            ("nonfinite_examples", "unclipped_count") if optimizer.clips_adaptively
            else ("nonfinite_examples",))},
        # Under XLA the array's size must be a compile-time constant: sized
        # from the batch's (static) length, not from the draw, it compiles
        # once for every draw; the loop still stops after the last drawn row.
        tf.TensorArray(tf.float32, size=(rows + k - 1) // k if static_chunks else num_chunks,
                       element_shape=[k if static_chunks else None], infer_shape=static_chunks),
    )
    with step_keys.chunk_keys(generators):
        _, sums, counts, losses = tf.while_loop(
            lambda i, *_: i < num_chunks, body, start, parallel_iterations=1
        )
    with tf.control_dependencies(sums):
        for generator, began in generators:
            generator.state.assign(began + tf.constant([1, 0], began.dtype))
    grads = optimizer.noisy_gradients(sums, step_info, variables)
    stats = {"nonfinite_examples": counts["nonfinite_examples"],
             **optimizer.update_clip_norm(counts, step_info)}
    return grads, stats, _rows(losses, rows)


def _rows(arrays, rows):
    """Stacks a TensorArray of chunks into its first `rows` rows,
    zero-filled past the last written chunk."""
    stacked = arrays.concat()
    missing = rows - tf.shape(stacked)[0]
    padding = [[0, tf.maximum(missing, 0)]] + [[0, 0]] * (stacked.shape.rank - 1)
    return tf.pad(stacked, padding)[:rows]
