"""The Keras layers and graph models a declared layer holds are read like a
graph's, at the ranks its call feeds them (`tfdp.per_example.declared`)."""
import keras
import numpy as np
import pytest

import tfdp
from tfdp.auditing.neighbour_step import NeighbourStep
from tfdp.per_example.plan import plan_for

L = keras.layers


def _scalar_weighting(make_norm):
    @tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
    class ScalarWeighting(L.Layer):
        """Declared, wrongly: a weightless Keras layer normalizing over the
        last axis of a [B] tensor, which is the batch."""
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.score = L.Dense(1)
            self.norm = make_norm()
        def call(self, x):
            return x * self.norm(self.score(x)[:, 0])[:, None]
    return ScalarWeighting()


NORMS = {"softmax": L.Softmax, "activation": lambda: L.Activation("softmax"),
         "unit": L.UnitNormalization}


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_a_held_layer_over_a_rank_1_batch_is_refused(norm):
    model = keras.Sequential([keras.Input((8,)), _scalar_weighting(NORMS[norm]), L.Dense(1)])
    plan = plan_for(model)
    assert plan.path == "vectorized" and "batch axis" in plan.reason


def test_the_batched_step_of_such_a_block_keeps_its_bound():
    model = tfdp.DPSequential([keras.Input((8,)), _scalar_weighting(L.UnitNormalization), L.Dense(1)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0), loss="mse")
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(8, 8)).astype("float32"), rng.normal(size=(8, 1)).astype("float32"))
    with NeighbourStep(model, data, records=7, batch_size=8, physical_batch_size=None) as step:
        ratio = max(step.ratio((np.full(8, s, "float32"), np.array([s], "float32")), rel)
                    for s in (1.0, 100.0, -100.0) for rel in ("add", "replace"))
    assert ratio <= 1 + 1e-5


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _AttentionPooling(L.Layer):
    """Legitimate: a softmax over the time axis (-2) of [B, T, 1]."""
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.score = L.Dense(1)
        self.softmax = L.Softmax(axis=-2)
    def call(self, x):
        return keras.ops.sum(self.softmax(self.score(x)) * x, axis=1)


def test_a_negative_feature_axis_of_a_weightless_held_layer_keeps_the_batched_path():
    model = keras.Sequential([keras.Input((6, 8)), _AttentionPooling(), L.Dense(1)])
    assert plan_for(model).path == "batched", plan_for(model).reason


@tfdp.per_example.declare_per_example(sublayers_on_the_batch=True)
class _HoldsCentering(L.Layer):
    """Declared, wrongly: holds a Functional model with a batch-mean node."""
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        inputs = keras.Input((8,))
        self.inner = keras.Model(inputs, L.Dense(8)(inputs) - keras.ops.mean(inputs, axis=0))
    def call(self, x):
        return self.inner(x)


def test_a_graph_model_held_by_a_declared_layer_is_read_like_the_graph():
    model = keras.Sequential([keras.Input((8,)), _HoldsCentering(), L.Dense(1)])
    assert plan_for(model).path == "vectorized"
