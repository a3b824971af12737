"""Rules for LSTM, GRU and SimpleRNN (and `keras.layers.RNN` of their cells).

A recurrent layer applies the same two linear maps at every time step: the
input projection P_t = x_t W + b and the recurrent one R_t = h_{t-1} U. Both
are `LinearGrads` with the time steps as positions: example i's kernel
gradient is sum_t x_t^T dz_t, its recurrent kernel gradient
sum_t h_{t-1}^T dz_t, where dz_t is the loss gradient at the gates'
pre-activation.

The rule runs the recurrence itself (Keras's own `backend.rnn` loop, so
masking, `go_backwards` and `unroll` behave as Keras's): it projects all
time steps at once, adds a probe to P (its gradient is dz_t for every t) and
feeds the probed P to the loop, whose step only adds R_t and applies the
gates. Each step also outputs (joined to h) the rows it multiplied by U, so h_{t-1} (after
recurrent dropout) is recorded for every t. GRU with `reset_after=True`
(its default) multiplies the recurrent candidate term by the reset gate, so
its recurrent pre-activation gets a probe of its own, fed as a second input
sequence. Dropout masks are the cell's own (drawn once a call by
`RNN.call`), so the recorded rows are the ones the forward pass used.

Where gate blocks see different rows (per-gate dropout masks with
`implementation=1`, GRU's `r * h` candidate rows with `reset_after=False`),
each distinct row tensor becomes its own set of positions, its gradient
zeroed outside its blocks' columns: the sum over positions is still exactly
the kernel gradient.

Example:

>>> import keras
>>> layer = keras.layers.LSTM(3)
>>> layer.build((None, 5, 2))
>>> RecurrentRule().supports(layer)
True
>>> layer = keras.layers.LSTM(3, stateful=True)
>>> layer.build((4, 5, 2))
>>> RecurrentRule().supports(layer)
False
"""

import functools

import keras
import numpy as np
import tensorflow as tf
from keras.src import backend, tree

from tfdp.per_example.grads import LinearGrads, MaterializedGrads
from tfdp.per_example.registry import register_rule
from tfdp.per_example.rules.common import concat_positions, is_float32, sum_per_example

_L = keras.layers
_BLOCKS = {_L.LSTMCell: 4, _L.GRUCell: 3, _L.SimpleRNNCell: 1}


def _matmul(x, w):
    """x [..., K] @ w [K, O] as one 2-D matmul."""
    if x.shape.rank == 2:
        return tf.matmul(x, w)
    flat = tf.matmul(tf.reshape(x, [-1, x.shape[-1]]), w)
    return tf.reshape(flat, tf.concat([tf.shape(x)[:-1], [w.shape[-1]]], 0))


def _rows(x, masks, blocks):
    """(distinct row tensors, the gate blocks each feeds) for inputs `x`.

    `masks` is None (no dropout), one mask shared by every block, or a list
    with one mask per block; a mask [B, C] broadcasts over time for x
    [B, T, C].
    """

    def apply(mask):
        return x * (mask[:, None, :] if x.shape.rank == 3 else mask)

    if masks is None:
        return [x], [list(range(blocks))]
    if isinstance(masks, (list, tuple)):
        return [apply(m) for m in masks], [[k] for k in range(blocks)]
    return [apply(masks)], [list(range(blocks))]


def _project(rows, groups, kernel, blocks):
    """The pre-activation of every block, [..., blocks * units]."""
    if len(groups) == 1:
        return _matmul(rows[0], kernel)
    units = kernel.shape[-1] // blocks
    return tf.concat(
        [_matmul(r, kernel[:, g[0] * units:(g[0] + 1) * units]) for r, g in zip(rows, groups)],
        axis=-1,
    )


def _positions(rows, groups, g, blocks):
    """Rows and gradients as `LinearGrads` positions: each distinct row tensor
    is its own set of positions, its gradient zeroed outside its blocks."""
    if len(groups) == 1:
        return rows[0], g
    units = g.shape[-1] // blocks
    gs = []
    for group in groups:
        columns = np.repeat([1.0 if k in group else 0.0 for k in range(blocks)], units)
        gs.append(g * tf.constant(columns, g.dtype))
    return tf.concat(rows, axis=1), tf.concat(gs, axis=1)


def _dropout_masks(cell, first_step, first_state, training):
    """(input masks, recurrent masks) exactly as the cell's `call` applies them.

    Each is None, one mask, or a list of one mask per gate block. The masks
    are the cell's cached ones (`RNN.call` draws them once a call).
    """
    if isinstance(cell, _L.SimpleRNNCell):
        masks = cell.get_dropout_mask(first_step), cell.get_recurrent_dropout_mask(first_state)
        return tuple(m if training else None for m in masks)
    inputs = recurrent = None
    if training and 0.0 < cell.dropout < 1.0:
        inputs = cell.get_dropout_mask(first_step)
    # Keras's fused implementation (2) has no recurrent dropout; setting
    # recurrent_dropout switches the cell to implementation 1.
    if training and cell.implementation == 1 and 0.0 < cell.recurrent_dropout < 1.0:
        recurrent = cell.get_recurrent_dropout_mask(first_state)
    return inputs, recurrent


def _activate(activation, x):
    return x if activation is None else activation(x)


def _lstm_step(cell, rec_masks):
    def step(p, states):
        h, c = states
        rows, groups = _rows(h, rec_masks, 4)
        z = p + _project(rows, groups, cell.recurrent_kernel, 4)
        z0, z1, z2, z3 = tf.split(z, 4, axis=-1)
        i = cell.recurrent_activation(z0)
        f = cell.recurrent_activation(z1)
        c = f * c + i * cell.activation(z2)
        h = cell.recurrent_activation(z3) * cell.activation(c)
        return tf.concat([h] + rows, -1), [h, c]

    return step, _rows_groups(rec_masks, 4)


def _simple_rnn_step(cell, rec_masks):
    def step(p, states):
        rows, _ = _rows(states[0], rec_masks, 1)
        h = _activate(cell.activation, p + _matmul(rows[0], cell.recurrent_kernel))
        return tf.concat([h] + rows, -1), [h]

    return step, _rows_groups(rec_masks, 1)


def _gru_step(cell, rec_masks):
    units = cell.units
    kernel = cell.recurrent_kernel

    def step(inputs, states):
        h = states[0]
        if cell.reset_after:
            p, q = tf.split(inputs, 2, axis=-1)
            rows, groups = _rows(h, rec_masks, 3)
            recurrent = _project(rows, groups, kernel, 3) + q
            if cell.use_bias:
                recurrent += cell.bias[1]
            x_z, x_r, x_h = tf.split(p, 3, axis=-1)
            r_z, r_r, r_h = tf.split(recurrent, 3, axis=-1)
            z = cell.recurrent_activation(x_z + r_z)
            r = cell.recurrent_activation(x_r + r_r)
            candidate = cell.activation(x_h + r * r_h)
        else:
            x_z, x_r, x_h = tf.split(inputs, 3, axis=-1)
            rows, groups = _rows(h, rec_masks, 3)
            if len(groups) == 1:
                gates = _matmul(rows[0], kernel[:, : 2 * units])
                h_candidate = rows[0]
            else:
                gates = _project(rows[:2], groups[:2], kernel[:, : 2 * units], 2)
                h_candidate = rows[2]
            z = cell.recurrent_activation(x_z + gates[:, :units])
            r = cell.recurrent_activation(x_r + gates[:, units:])
            reset_rows = r * h_candidate
            candidate = cell.activation(x_h + _matmul(reset_rows, kernel[:, 2 * units:]))
            rows = rows[:2] + [reset_rows] if len(groups) == 3 else [rows[0], reset_rows]
        h = z * h + (1 - z) * candidate
        return tf.concat([h] + rows, -1), [h]

    groups = _rows_groups(rec_masks, 3)
    if not cell.reset_after:
        groups = [[0], [1], [2]] if len(groups) == 3 else [[0, 1], [2]]
    return step, groups


def _rows_groups(masks, blocks):
    if isinstance(masks, (list, tuple)):
        return [[k] for k in range(blocks)]
    return [list(range(blocks))]


_STEPS = {_L.LSTMCell: _lstm_step, _L.GRUCell: _gru_step, _L.SimpleRNNCell: _simple_rnn_step}


def _input_bias(cell):
    if not cell.use_bias:
        return None
    if isinstance(cell, _L.GRUCell) and cell.reset_after:
        return cell.bias[0]
    return cell.bias


def _inner_loop(layer, record, sequences, initial_state, mask, training=False):
    """`RNN.inner_loop` with probes: returns (last h, all h, final states)."""
    cell = layer.cell
    blocks = _BLOCKS[type(cell)]
    if tree.is_nested(mask):
        mask = mask[0]
    states = list(initial_state) if tree.is_nested(initial_state) else [initial_state]
    in_masks, rec_masks = _dropout_masks(cell, sequences[:, 0, :], states[0], training)
    sequences = tf.convert_to_tensor(sequences)
    x_rows, x_groups = _rows(sequences, in_masks, blocks)
    projection = _project(x_rows, x_groups, cell.kernel, blocks)
    bias = _input_bias(cell)
    if bias is not None:
        projection += bias
    inputs = record.probe("p", projection)
    reset_after = isinstance(cell, _L.GRUCell) and cell.reset_after
    if reset_after:
        inputs = tf.concat([inputs, record.probe("q", tf.zeros_like(projection))], axis=-1)
    step, h_groups = _STEPS[type(cell)](cell, rec_masks)
    last, outputs, new_states = backend.rnn(
        step,
        inputs,
        states,
        go_backwards=layer.go_backwards,
        mask=mask,
        unroll=layer.unroll,
        input_length=sequences.shape[1],
        zero_output_for_mask=layer.zero_output_for_mask,
        return_all_outputs=True,
    )
    # One output tensor (the unrolled loop stacks no nested outputs): h,
    # then the rows each step multiplied by the recurrent kernel.
    units = cell.units
    h_rows = tf.split(outputs, outputs.shape[-1] // units, axis=-1)[1:]
    if layer.go_backwards:  # the loop's outputs run in processing order
        h_rows = [tf.reverse(r, [1]) for r in h_rows]
    record.values.update(x_rows=x_rows, x_groups=x_groups, h_rows=h_rows, h_groups=h_groups)
    return last[:, :units], outputs[:, :, :units], new_states


@register_rule(_L.LSTM, _L.GRU, _L.SimpleRNN, _L.RNN)
class RecurrentRule:
    """LSTM, GRU, SimpleRNN, or RNN of one LSTMCell, GRUCell or SimpleRNNCell.

    Stateful layers are not supported (their state carries one batch's
    examples into the next); they take the per-layer fallback.
    """

    def supports(self, layer):
        cell = getattr(layer, "cell", None)
        return (
            type(cell) in _BLOCKS
            and not layer.stateful
            and is_float32(layer)
            and is_float32(cell)
        )

    def call(self, layer, recorder, call, *args, **kwargs):
        record = recorder.record(layer)
        object.__setattr__(layer, "inner_loop", functools.partial(_inner_loop, layer, record))
        try:
            return call(*args, **kwargs)
        finally:
            object.__delattr__(layer, "inner_loop")

    def parts(self, layer, records):
        cell = layer.cell
        blocks = _BLOCKS[type(cell)]
        reset_after = isinstance(cell, _L.GRUCell) and cell.reset_after
        kernel_x, kernel_g, recurrent_x, recurrent_g = [], [], [], []
        for r in records:
            x, g = _positions(r.x_rows, r.x_groups, r.grads["p"], blocks)
            kernel_x.append(x)
            kernel_g.append(g)
            at_recurrent = r.grads["q"] if reset_after else r.grads["p"]
            x, g = _positions(r.h_rows, r.h_groups, at_recurrent, blocks)
            recurrent_x.append(x)
            recurrent_g.append(g)
        bias = cell.bias if cell.use_bias and not reset_after else None
        parts = [
            LinearGrads(concat_positions(kernel_x), concat_positions(kernel_g), cell.kernel, bias),
            LinearGrads(
                concat_positions(recurrent_x), concat_positions(recurrent_g), cell.recurrent_kernel
            ),
        ]
        if cell.use_bias and reset_after:
            biases = [
                tf.stack([tf.reduce_sum(r.grads["p"], 1), tf.reduce_sum(r.grads["q"], 1)], 1)
                for r in records
            ]
            parts.append(MaterializedGrads([cell.bias], [sum_per_example(biases)]))
        return parts


@register_rule(_L.Bidirectional)
class BidirectionalRule:
    """Bidirectional of two layers the recurrent rule supports.

    Keras's Bidirectional may run both directions as one fused cuDNN call
    (on a GPU, without a mask) that never calls its two layers; this rule
    turns that dispatch off for the batched pass and runs each direction
    through `RecurrentRule`.
    """

    _DIRECTION = RecurrentRule()

    def supports(self, layer):
        return all(
            self._DIRECTION.supports(sub) and type(sub) in (_L.LSTM, _L.GRU, _L.SimpleRNN, _L.RNN)
            for sub in (layer.forward_layer, layer.backward_layer)
        )

    def call(self, layer, recorder, call, *args, **kwargs):
        recorder.record(layer, recorder=recorder)
        no_fusion = lambda *a, **k: False  # noqa: E731
        names = ("_can_attempt_fused_lstm", "_can_attempt_fused_gru")
        for name in names:
            object.__setattr__(layer, name, no_fusion)
        directions = [(layer.forward_layer, self._DIRECTION), (layer.backward_layer, self._DIRECTION)]
        try:
            with recorder.hooked(directions):
                return call(*args, **kwargs)
        finally:
            for name in names:
                object.__delattr__(layer, name)

    def parts(self, layer, records):
        recorder = records[0].recorder
        return [
            part
            for sub in (layer.forward_layer, layer.backward_layer)
            for part in self._DIRECTION.parts(sub, recorder.records_of(sub))
        ]
