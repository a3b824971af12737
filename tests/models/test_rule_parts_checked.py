"""A registered rule's own gradient part runs the rule author's code after
the per-example pass (its norms, its clipped sum, `grouped`, `dots`): a write
to a layer's variable there is refused before the first step, as one in the
layer's `call()` is (reviews 20 and 21), and so is one in a method replaced
on an instance of tfdp's own part.

The step runs that code outside `checked_per_example_pass`, where writes to
model variables pass for the optimizer's update (and DPIS runs its norms in
a pass of its own), so fit's early check scans it under the pass's rules.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.per_example import declare_per_example, register_rule
from tfdp.per_example.grads import Part
from tfdp.per_example.rules.dense import DenseRule


class _MemoDense(keras.layers.Dense):
    """A Dense with a memory its rule's part writes (the rule author's code)."""

    def build(self, shape):
        super().build(shape)
        self.memory = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False,
                                      name="memory")

    def remember(self, x):
        self.memory.assign(x[0])


class _WritingPart(Part):
    """`LinearGrads` as the Dense rule makes it, writing the layer's memory in
    the method named `writes_in` (None: nowhere, the control)."""

    def __init__(self, layer, part, writes_in):
        self.layer, self.part, self.writes_in = layer, part, writes_in

    @property
    def variables(self):  # read by each PerExampleGradients holding the part
        if self.writes_in == "variables" and _Began.began:
            self.layer.remember(self.part.x[:, 0, :])
        return self.part.variables

    def _maybe_write(self, method):
        if method == self.writes_in:
            self.layer.remember(self.part.x[:, 0, :])  # a record's raw row

    def sq_norm_bounds(self):
        self._maybe_write("sq_norm_bounds")
        return self.part.sq_norm_bounds()

    def summation_errors(self):
        return self.part.summation_errors()

    def absolute_errors(self):
        return self.part.absolute_errors()

    def dots(self, vectors):
        self._maybe_write("dots")
        return self.part.dots(vectors)

    def dot_errors(self, vectors):
        return self.part.dot_errors(vectors)

    def weighted_sum(self, weights, accumulate=tf.float32):
        self._maybe_write("weighted_sum")
        if self.writes_in == "weighted_sum once training" and _Began.began:
            self.layer.remember(self.part.x[:, 0, :])  # a flag set after fit's check
        sums = self.part.weighted_sum(weights, accumulate)
        if self.writes_in == "conversion once training":
            return [_Converted(self, total) for total in sums]
        return sums

    def grouped(self, k):
        self._maybe_write("grouped")
        if k == 1:  # a shortcut: code only k > 1 runs
            return self
        joined = {"grouped k > 1": "weighted_sum", "variables of a joined part": "variables"}
        return _WritingPart(self.layer, self.part.grouped(k), joined.get(self.writes_in))

    def materialize(self):
        self._maybe_write("materialize")
        return self.part.materialize()


def _patched(layer, part, writes_in):
    """tfdp's own `LinearGrads`, one method replaced on the instance by one
    that writes the layer's memory first; the part also holds itself."""
    method = getattr(part, writes_in)

    def writing(*args, **kwargs):
        layer.remember(part.x[:, 0, :])
        return method(*args, **kwargs)

    setattr(part, writes_in, writing)
    part.me = part  # a cycle the check's walk must survive
    return part


class _Converted:
    """A sum TensorFlow converts when it is used (`__tf_tensor__`), writing
    the layer's memory then, once training."""

    def __init__(self, part, total):
        self.part, self.total = part, total
        self.shape, self.dtype = total.shape, total.dtype

    def __tf_tensor__(self, dtype=None, name=None):
        if _Began.began:
            self.part.layer.remember(self.part.part.x[:, 0, :])
        return tf.convert_to_tensor(self.total, dtype=dtype, name=name)


@register_rule(_MemoDense)
class _WritingRule(DenseRule):
    writes_in, patch = None, False

    def parts(self, layer, records):
        if self.patch:
            return [_patched(layer, part, self.writes_in) for part in super().parts(layer, records)]
        return [_WritingPart(layer, part, self.writes_in) for part in super().parts(layer, records)]


declare_per_example(_MemoDense)


class _Began(keras.callbacks.Callback):
    began = False  # set on the class: the parts read it as the step is traced

    def on_train_begin(self, logs=None):
        type(self).began = True


def _fit(writes_in, monkeypatch, patch=False, optimizer=None, **fit_kwargs):
    monkeypatch.setattr(_WritingRule, "writes_in", writes_in)
    monkeypatch.setattr(_WritingRule, "patch", patch)
    monkeypatch.setattr(_Began, "began", False)
    keras.utils.set_random_seed(0)
    layer = _MemoDense(3, name="memo")
    model = tfdp.DPSequential([keras.Input((4,)), layer])
    model.compile(optimizer=optimizer or tfdp.optimizers.DPSGD(
                      0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.full((32, 4), 0.5, np.float32)
    x[0] = [1e3, -2e3, 3e3, 7.0]  # the crafted record
    began = _Began()
    fit = lambda: model.fit(x, np.zeros(32, np.int64), batch_size=8, epochs=1,  # noqa: E731
                            verbose=0, callbacks=[began], **fit_kwargs)
    return model, layer, began, fit


@pytest.mark.parametrize("writes_in", ["sq_norm_bounds", "weighted_sum", "grouped", "dots"])
def test_a_rule_part_writing_a_layer_variable_is_refused_before_the_first_step(
        writes_in, monkeypatch):
    model, layer, began, fit = _fit(writes_in, monkeypatch)
    with pytest.raises(ValueError, match="'memory'"):
        fit()
    assert not began.began  # refused before the callbacks start
    assert model.privacy.steps == 0
    np.testing.assert_array_equal(layer.memory.numpy(), np.zeros(4))


@pytest.mark.parametrize("writes_in", ["sq_norm_bounds", "weighted_sum"])
def test_a_method_replaced_on_a_tfdp_part_is_refused_before_the_first_step(
        writes_in, monkeypatch):
    model, layer, began, fit = _fit(writes_in, monkeypatch, patch=True)
    with pytest.raises(ValueError, match="'memory'"):
        fit()
    assert not began.began
    assert model.privacy.steps == 0
    np.testing.assert_array_equal(layer.memory.numpy(), np.zeros(4))


_AFTER_THE_CHECK = {  # what fit's early check cannot see, and the step's scan does
    "grouped k > 1": dict(user_ids=np.arange(32) // 2, examples_per_user=2),
    "materialize": dict(optimizer=lambda: tfdp.optimizers.AdaDP(  # its adaptive phase
        0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=1)),
    "weighted_sum once training": {},
    "conversion once training": {},
    "variables of a joined part": dict(user_ids=np.arange(32) // 2, examples_per_user=2),
}


@pytest.mark.parametrize("writes_in", sorted(_AFTER_THE_CHECK))
def test_a_rule_part_writing_only_in_the_step_is_refused_before_any_step_runs(
        writes_in, monkeypatch):
    kwargs = dict(_AFTER_THE_CHECK[writes_in])
    optimizer = kwargs.pop("optimizer", lambda: None)()
    model, layer, _, fit = _fit(writes_in, monkeypatch, optimizer=optimizer, **kwargs)
    with pytest.raises(ValueError, match="'memory'"):
        fit()
    assert model.privacy.steps == 0
    np.testing.assert_array_equal(layer.memory.numpy(), np.zeros(4))


def test_control_the_same_rule_writing_nothing_trains(monkeypatch):
    model, layer, began, fit = _fit(None, monkeypatch)
    fit()
    assert began.began and model.privacy.steps == 4
    np.testing.assert_array_equal(layer.memory.numpy(), np.zeros(4))
