"""A clip norm below 2^-63 still clips (review of issue 47 item 2, CRITICAL).

A gradient norm n below ~2^-63 has a float32 squared-norm bound of 0
(n^2 underflows, or is a subnormal that the CPU flushes); clipping read it
as norm 0, gave factor 1 and summed the record at its full norm n, up to
1e10 x C when C = 1e-30 (a fixed l2_norm_clip, or adaptive clipping's C_t
at its floor).
"""

import keras
import numpy as np
import pytest

import tfdp
from tfdp.auditing.neighbour_step import NeighbourStep

CLIP = 1e-30


def model_at_tiny_clip(adaptive):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
    if adaptive:  # C_t driven to its floor, as the linear update does in a few steps
        optimizer = tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=1,
                                          target_unclipped_quantile=0.5)
    else:
        optimizer = tfdp.optimizers.DPSGD(0.1, l2_norm_clip=CLIP, noise_multiplier=1.0)
    model.compile(optimizer=optimizer, loss="mse")
    model.optimizer.build(model.trainable_variables)
    if adaptive:
        model.optimizer.clip_norm().assign(CLIP)
    return model


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_a_record_whose_squared_norm_underflows_is_clipped(adaptive):
    model = model_at_tiny_clip(adaptive)
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 1)).astype("float32"))
    weights = model.trainable_variables[0].numpy().astype(np.float64)
    with NeighbourStep(model, data, records=4, batch_size=5.0, physical_batch_size=None) as step:
        assert step.bound == pytest.approx(step.lr * CLIP / 5.0, rel=1e-6)
        # 1e-9: squared norm ~1e-36, a normal float32 (the control, clipped
        # before the fix too); 1e-10 and 1e-13: it underflows.
        for scale in (1e-9, 1e-10, 1e-13):
            x = np.full(3, scale)
            gradient = 2.0 * float(x @ weights[:, 0]) * x  # MSE at y = 0
            assert np.linalg.norm(gradient) > 1e3 * CLIP  # unclipped, it would fail
            record = (x.astype("float32"), np.zeros(1, "float32"))
            for relation in ("add", "replace"):
                assert step.ratio(record, relation) <= 1.0 + 1e-5, (scale, relation)
