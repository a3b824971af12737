"""Adaptive (quantile) clipping on DPSGD / DPOptimizer (issue 47, item 2)."""

import keras
import numpy as np
import pytest

import tfdp
from tfdp.accounting import compute_epsilon

N, BATCH = 96, 24
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


def build(optimizer):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


def adaptive(quantile=0.5, **kwargs):
    kwargs.setdefault("noise_multiplier", 1.0)
    return tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, seed=1,
                                 target_unclipped_quantile=quantile, **kwargs)


def test_arguments_are_checked_and_fixed():
    with pytest.raises(ValueError, match=r"Received: target_unclipped_quantile=1.5"):
        adaptive(1.5)
    with pytest.raises(ValueError, match=r"clip_learning_rate=0.1 with target_unclipped_quantile=None"):
        tfdp.optimizers.DPSGD(0.5, noise_multiplier=1.0, clip_learning_rate=0.1)
    with pytest.raises(ValueError, match=r"2 sigma_b = 0.8 and z = 1.*clipped_count_stddev=0.4"):
        adaptive(clipped_count_stddev=0.4)
    with pytest.raises(ValueError, match="SADPSGD cannot clip adaptively"):
        tfdp.optimizers.SADPSGD(0.1, noise_multiplier=1.0, target_unclipped_quantile=0.5,
                                public_energy_data=data())
    opt = adaptive()
    with pytest.raises(AttributeError, match="is fixed"):
        opt.target_unclipped_quantile = 0.9
    # The default sigma_b = batch / 20 = 0.4 at batch 8 cannot pay for z = 1.
    x, y = data()
    with pytest.raises(ValueError, match=r"batch_size / 20 = 0.4.*batch_size=8"):
        build(adaptive()).fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_clip_norm_follows_the_target_quantile_and_costs_plain_dpsgd():
    x, y = data()
    finals, fractions = {}, {}
    for quantile in (0.1, 0.9):
        model = build(adaptive(quantile, clip_learning_rate=1.0))
        history = model.fit(x, y, batch_size=BATCH, epochs=6, verbose=0)
        finals[quantile] = history.history["clip_norm"][-1]
        fractions[quantile] = history.history["unclipped_fraction"][-1]
        assert finals[quantile] == pytest.approx(float(model.optimizer.clip_norm()))
        epsilon = model.privacy.epsilon(1e-5)
    # Record level, at the moved C_t: the sum moves by at most C_t, the count by 1/2.
    result = tfdp.auditing.sensitivity_search(model, x[:8], y[:8], records=5, search_steps=0)
    result.check()
    assert result.count_ratio == pytest.approx(1.0, abs=1e-5)
    assert finals[0.9] > 1.0 > finals[0.1]  # negative control: 0.9 ends above 0.1
    assert abs(fractions[0.1] - 0.1) < 0.3 and abs(fractions[0.9] - 0.9) < 0.3
    plain = build(tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.0, seed=1))
    plain.fit(x, y, batch_size=BATCH, epochs=6, verbose=0)
    steps = model.privacy.steps
    assert steps == plain.privacy.steps == 24
    assert epsilon == plain.privacy.epsilon(1e-5)
    assert epsilon == pytest.approx(compute_epsilon(1.0, BATCH / N, steps, 1e-5), rel=1e-9)


def test_gradient_noise_is_split_off_the_count():
    model = build(adaptive(clipped_count_stddev=2.0))
    model.optimizer.build(model.trainable_variables)
    sigma_grad = (1.0 - (2 * 2.0) ** -2) ** -0.5
    assert float(model.optimizer.noise_stddev(16.0)) == pytest.approx(sigma_grad, rel=1e-6)
    model.optimizer.clip_norm().assign(3.0)
    assert float(model.optimizer.noise_stddev(16.0)) == pytest.approx(3.0 * sigma_grad, rel=1e-6)


def test_physical_batches_give_the_unsplit_clip_norm():
    x, y = data()
    ends = []
    for physical in (None, 5):
        model = build(adaptive())
        model.fit(x, y, batch_size=BATCH, epochs=1, physical_batch_size=physical, verbose=0)
        ends.append(float(model.optimizer.clip_norm()))
    assert ends[0] == pytest.approx(ends[1], rel=1e-6) and ends[0] != 1.0


def test_save_load_and_backup_keep_the_clip_norm(tmp_path):
    x, y = data()
    model = build(adaptive(0.9))
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    moved = float(model.optimizer.clip_norm())
    assert moved != 1.0
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert float(loaded.optimizer.clip_norm()) == moved
    assert loaded.optimizer.target_unclipped_quantile == 0.9

    seen = []

    class Crash(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(float(self.model.optimizer.clip_norm()))
            raise RuntimeError("killed")

    folder = str(tmp_path / "backup")
    backup = keras.callbacks.BackupAndRestore(folder, delete_checkpoint=False)
    with pytest.raises(RuntimeError, match="killed"):
        build(adaptive(0.9)).fit(x, y, batch_size=BATCH, epochs=3, verbose=0,
                                 callbacks=[backup, Crash()])

    class Look(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(float(self.model.optimizer.clip_norm()))

    resumed = build(adaptive(0.9))
    resumed.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(folder), Look()])
    assert seen[1] == seen[0] != 1.0


def test_user_level_and_sensitivity_search():
    x, y = data()
    model = build(adaptive())
    owners = np.arange(N) // 3  # 32 people, 3 records each
    history = model.fit(x, y, user_ids=owners, examples_per_user=2, batch_size=12, epochs=1,
                        verbose=0)
    assert model.privacy.relation == "add_or_remove_user"
    clip = history.history["clip_norm"][-1]
    assert clip != 1.0
    result = tfdp.auditing.sensitivity_search(model, x[:8], y[:8], records=5, search_steps=6)
    result.check()
    assert 0.5 < result.worst_ratio and result.count_ratio == pytest.approx(1.0, abs=1e-5)
    assert f"C_t={clip:g}" in result.settings


class DoubleCount(tfdp.optimizers.DPSGD):
    """Negative control: each unit adds twice to the count (sensitivity 1)."""

    def clipped_sum(self, per_example, step_info):
        sums, counts = super().clipped_sum(per_example, step_info)
        return sums, dict(counts, unclipped_count=2.0 * counts["unclipped_count"])


# At C_0 = 100 every unit is unclipped, and with b = 3 below the 6 rows both
# released fractions are clamped to 1: the unclamped count must be compared.
@pytest.mark.parametrize("clip, batch_size", [(1.0, None), (100.0, 3.0)])
def test_sensitivity_search_catches_a_count_beyond_its_bound(clip, batch_size):
    x, y = data()
    model = build(DoubleCount(0.5, l2_norm_clip=clip, noise_multiplier=1.0, seed=1,
                              target_unclipped_quantile=0.5))
    model.optimizer.build(model.trainable_variables)
    result = tfdp.auditing.sensitivity_search(model, x[:8], y[:8], records=5, search_steps=0,
                                              batch_size=batch_size)
    assert result.count_ratio == pytest.approx(2.0, abs=1e-5)
    with pytest.raises(tfdp.auditing.SensitivityExceeded, match="count of unclipped units"):
        result.check()


def test_a_clamped_fraction_still_gives_the_count_its_bound():
    # The mechanism itself, where DoubleCount was missed (all unclipped, b = 3).
    x, y = data()
    model = build(adaptive())
    model.optimizer.build(model.trainable_variables)
    model.optimizer.clip_norm().assign(100.0)
    result = tfdp.auditing.sensitivity_search(model, x[:8], y[:8], records=5, search_steps=0,
                                              batch_size=3.0)
    result.check()
    assert result.count_ratio == pytest.approx(1.0, abs=1e-5)
