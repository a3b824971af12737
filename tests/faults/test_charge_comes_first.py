"""The private step is charged before anything else it writes, and a step
refused before it runs is not charged (issue 44 item 6, review findings).

Before: the charge `self._dp_steps.assign_add(1)` (a Keras variable) returned
the value written, not the write, so the step's other writes (the inner
optimizer's iterations, metrics, DP-BandMF's stream step, the weights) were
ordered after the addition only, not after the counter's write; and a step
refused by a Python check inside the step (a layer made stateful after
compile) was charged when run eagerly.

The graph check traces the step once per case (no training) and walks the
graph forward from the counter's write: every other variable write, and
every call op whose body writes, must be reached from it.
"""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp

N, D, B = 32, 4, 8
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


def is_write(op_type):
    return op_type in WRITES or op_type.startswith(("ResourceApply", "ResourceScatter"))


def model_with(optimizer):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((D,)), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
    return model


def traced_step(model, **fit_kwargs):
    """The graph of the model's private step, traced by one fit step."""
    graphs = []
    step = model.train_step

    def spy(data):
        graphs.append(tf.compat.v1.get_default_graph())
        return step(data)

    model.train_step = spy
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, D)).astype("float32")
    model.fit(x, rng.integers(0, 3, N), batch_size=B, epochs=1, steps_per_epoch=1, verbose=0,
              **fit_kwargs)
    return graphs[-1]


def writes_in(library, name, seen):
    if name in seen or name not in library:
        return []
    seen.add(name)
    found = []
    for node in library[name].node_def:
        if is_write(node.op):
            found.append(node.op)
        for attr in node.attr.values():
            if attr.HasField("func"):
                found += writes_in(library, attr.func.name, seen)
    return found


def unordered_writes(model, graph):
    """Writes (or calls whose bodies write) that the counter's write does not precede."""
    handle = model._dp_steps.value.handle
    inside = {internal.name for external, internal in graph.captures if external is handle}
    ops = graph.get_operations()
    charges = [op for op in ops if is_write(op.type) and op.inputs[0].name in inside]
    assert len(charges) == 1, charges
    after = collections.defaultdict(list)
    for op in ops:
        for tensor in op.inputs:
            after[tensor.op.name].append(op.name)
        for control in op.control_inputs:
            after[control.name].append(op.name)
    reached, todo = {charges[0].name}, [charges[0].name]
    while todo:
        for name in after[todo.pop()]:
            if name not in reached:
                reached.add(name)
                todo.append(name)
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    unordered = []
    for op in ops:
        if op.name in reached:
            continue
        calls = [a.func.name for a in op.node_def.attr.values() if a.HasField("func")]
        if is_write(op.type) or any(writes_in(library, name, set()) for name in calls):
            unordered.append((op.type, op.name))
    return unordered


CASES = {
    "dpsgd": (lambda: tfdp.optimizers.DPSGD(0.1, 1.0, 1.0, seed=1), {}),
    "chunked": (lambda: tfdp.optimizers.DPSGD(0.1, 1.0, 1.0, seed=1), {"physical_batch_size": 4}),
    "bandmf": (lambda: tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.1), 1.0, 1.0, bands=2,
                                               seed=1), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_write_of_the_step_follows_the_charge(case):
    make, fit_kwargs = CASES[case]
    model = model_with(make())
    graph = traced_step(model, **fit_kwargs)
    assert unordered_writes(model, graph) == []


def test_the_graph_check_finds_a_write_made_before_the_charge():
    """Negative control: a step that writes a variable outside the charge's
    reach is found."""
    model = model_with(tfdp.optimizers.DPSGD(0.1, 1.0, 1.0, seed=1))
    stray = tf.Variable(0, dtype=tf.int64)
    step = model.train_step

    def early_write(data):
        stray.assign_add(1)
        return step(data)

    model.train_step = early_write
    graph = traced_step(model)
    assert [kind for kind, _ in unordered_writes(model, graph)] == ["AssignAddVariableOp"]


def test_a_step_refused_when_run_eagerly_is_not_charged():
    """A layer made stateful after compile is refused by the step itself
    (fit's own check ran before): the refusal comes before the charge."""
    model = model_with(tfdp.optimizers.DPSGD(0.1, 1.0, 1.0, seed=1))
    model.fit(np.ones((N, D), "float32"), np.zeros(N, "int64"), batch_size=B, epochs=1,
              steps_per_epoch=1, verbose=0)
    steps = model.privacy.steps
    model.layers[0].stateful = True
    step_info = {"mask": tf.ones([B]), "expected_batch_size": tf.constant(float(B))}
    with pytest.raises(ValueError, match="is stateful"):
        model.train_step(((tf.ones([B, D]), tf.zeros([B], tf.int64)), step_info))
    assert model.privacy.steps == steps
