"""DPIS end to end: fit, the ledger, one step's math, save/load, errors."""

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.mechanisms import importance_sampling as isp
from tfdp.models.losses import per_example_loss
from tfdp.per_example import compute_per_example_gradients

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
N, B = 240, 16


def data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 1).astype(np.int64)
    return x, y


def model_with(optimizer, seed=0):
    keras.utils.set_random_seed(seed)
    model = tfdp.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    )
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
    return model


def dpis(**overrides):
    settings = dict(
        learning_rate=0.5, l2_norm_clip=1.0, target_epsilon=4.0, epochs=3,
        sigma_n=5.0, seed=1,
    )
    settings.update(overrides)
    return tfdp.optimizers.DPIS(**settings)


class NoiselessDPIS(tfdp.optimizers.DPIS):
    """Test double: DPIS with the gradient noise removed (accounting unchanged)."""

    def noise_stddev(self):
        return tf.constant(0.0)


def test_fit_spends_at_most_the_target_and_logs_its_schedule():
    x, y = data()
    optimizer = dpis(epoch_divider=1.0, log_sampling_stats=True)
    model = model_with(optimizer)
    budget = tfdp.callbacks.PrivacyBudget(epsilon=4.0, delta=1e-5)
    history = model.fit(x, y, batch_size=B, epochs=3, callbacks=[budget], verbose=0)
    spent = model.privacy.epsilon(1e-5)
    assert 3.9 <= spent <= 4.0
    assert model.privacy.epsilon(1e-5, accountant="pld") <= 4.0 * 1.02
    assert len(history.epoch) == 3  # the budget callback lets every planned step run
    for key in ("sigma_g", "k_tilde", "clip_norm", "batch_size", "stage1_rate", "stage2_rate", "epsilon"):
        assert key in history.history, key
    steps = [e["sigma_g"] for e in optimizer.epoch_history]
    assert len(steps) == 3 and all(b <= a for a, b in zip(steps, steps[1:]))  # a_E = 1: worst case
    assert history.history["sigma_g"] == pytest.approx(steps)
    # The ledger: N~ once, K~ once per epoch, and the open step event of the last epoch.
    releases = model.privacy.composed_event().events
    assert sum(e == isp.count_event(5.0) for e in releases) == 1
    last = optimizer.epoch_history[-1]
    k_event = isp.norm_sum_event(5.0, B / last["n_tilde"])
    assert sum(e == k_event for e in releases) == 3
    assert releases[-1] == dp_accounting.SelfComposedDpEvent(
        isp.step_event(last["sigma_g"], 1.0, last["k_tilde"], last["n_tilde"], B), N // B
    )
    assert optimizer.step_event() == releases[-1].event
    assert model.privacy.steps == 3 * (N // B)


def test_batches_are_drawn_one_step_at_a_time():
    """No prefetching: each draw reads the ghat table the previous step refreshed."""
    x, y = data()
    optimizer = dpis(epochs=2)
    model = model_with(optimizer)
    seen = []

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(optimizer._run.sampler.draw_count)  # pylint: disable=protected-access

    model.fit(x, y, batch_size=B, epochs=2, callbacks=[Watch()], verbose=0)
    assert seen == list(range(1, 2 * (N // B) + 1))


def test_one_step_weights_accepted_gradients_and_refreshes_ghat():
    x, y = data()
    optimizer = NoiselessDPIS(learning_rate=0.5, l2_norm_clip=0.5, target_epsilon=4.0,
                              epochs=3, sigma_n=5.0, seed=3, log_sampling_stats=True)
    model = model_with(optimizer)
    model._build_for((x, y))  # pylint: disable=protected-access
    dataset, steps = optimizer.make_training_data(model, (x, y), B)
    assert steps == N // B
    batch, info = next(iter(dataset))
    before = [v.numpy().copy() for v in model.trainable_variables]
    table = optimizer.ghat_table
    # What the step must do, from the per-example gradients at the old weights.
    per_example, _, _ = compute_per_example_gradients(
        model, batch[0], batch[1], info["mask"], per_example_loss(LOSS)
    )
    grads = [g.numpy() for g in per_example.materialize()]
    norms = np.sqrt(per_example.sq_norms().numpy())
    mask, ghat, uniform = info["mask"].numpy(), info["ghat"].numpy(), info["uniform"].numpy()
    clip, k_tilde, n_tilde = 0.5, optimizer.k_tilde, optimizer.n_tilde
    bound = np.minimum(ghat, clip)
    accept = (mask > 0) & (uniform < np.minimum(norms, bound) / ghat)
    assert 0 < accept.sum() < mask.sum()
    weights = np.where(accept, k_tilde / (n_tilde * np.where(accept, norms, 1.0)), 0.0)
    want = [w - 0.5 * np.tensordot(weights, g, axes=1) / B for w, g in zip(before, grads)]
    # traced only, and as fit traces it: Keras marks its step do_not_convert (no autograph)
    logs = tf.function(model.train_step, autograph=False)((batch, info))
    for got, expected in zip(model.trainable_variables, want):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-6)
    assert float(logs["batch_size"]) == accept.sum()
    # ghat refreshed for every drawn record, untouched elsewhere.
    drawn = info["indices"].numpy()[mask > 0]
    refreshed = np.minimum(5.0 * np.maximum(np.minimum(norms, bound), 0.01 * clip), k_tilde / B)
    after = optimizer.ghat_table
    np.testing.assert_allclose(after[drawn], refreshed[mask > 0], rtol=1e-5)
    others = np.setdiff1d(np.arange(N), drawn)
    np.testing.assert_array_equal(after[others], table[others])


def test_a_step_clips_to_ghat_where_ghat_is_below_the_norm_and_c():
    """Stage 2 clips to min(ghat_i, C): the refreshed ghat reads that norm.

    At an epoch's first step ghat_i >= min(||g_i||, C) for every record, so
    clipping to C alone would look the same there. Later in the epoch a
    record's gradient can outgrow the ghat_i it is drawn with; the step is
    fed such ghat (a twentieth of the drawn ones, all below C) and must
    refresh ghat_i from min(||g_i||, ghat_i, C), accepting every such record
    (p_i = 1), and weight each accepted term to norm K~ / N~.
    """
    x, y = data()
    clip, k = 0.5, 5.0
    optimizer = NoiselessDPIS(learning_rate=0.5, l2_norm_clip=clip, target_epsilon=4.0,
                              epochs=3, sigma_n=5.0, seed=3, log_sampling_stats=True)
    model = model_with(optimizer)
    model._build_for((x, y))  # pylint: disable=protected-access
    dataset, _ = optimizer.make_training_data(model, (x, y), B)
    batch, info = next(iter(dataset))
    mask = info["mask"].numpy()
    info = dict(info, ghat=info["ghat"] / 20.0)
    ghat = info["ghat"].numpy()
    per_example, _, _ = compute_per_example_gradients(
        model, batch[0], batch[1], info["mask"], per_example_loss(LOSS)
    )
    norms = np.sqrt(per_example.sq_norms().numpy())
    drawn = mask > 0
    outgrown = drawn & (ghat < np.minimum(norms, clip))
    assert np.all(ghat[drawn] < clip) and outgrown.sum() >= 3
    clipped = np.minimum(np.minimum(norms, ghat), clip)
    accept = drawn & (info["uniform"].numpy() < clipped / ghat)
    assert np.all(accept[outgrown])
    k_tilde, n_tilde = optimizer.k_tilde, optimizer.n_tilde
    weights = np.where(accept, k_tilde / (n_tilde * np.where(accept, norms, 1.0)), 0.0)
    grads = [g.numpy() for g in per_example.materialize()]
    want = [v.numpy() - 0.5 * np.tensordot(weights, g, axes=1) / B
            for v, g in zip(model.trainable_variables, grads)]
    # traced only, and as fit traces it: Keras marks its step do_not_convert (no autograph)
    logs = tf.function(model.train_step, autograph=False)((batch, info))
    assert float(logs["batch_size"]) == accept.sum()
    for got, expected in zip(model.trainable_variables, want):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-6)
    refreshed = np.minimum(k * np.maximum(clipped, 0.01 * clip), k_tilde / B)
    after = optimizer.ghat_table
    np.testing.assert_allclose(after[info["indices"].numpy()[drawn]], refreshed[drawn], rtol=1e-5)


def test_save_load_resume_keeps_released_state_and_not_the_ghat_table(tmp_path):
    x, y = data()
    model = model_with(dpis(epochs=4))
    model.fit(x, y, batch_size=B, epochs=2, verbose=0)
    opt = model.optimizer
    path = str(tmp_path / "dpis.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    again = restored.optimizer
    assert isinstance(again, tfdp.optimizers.DPIS)
    for name in ("n_tilde", "k_tilde", "clip_norm", "sigma_g", "epochs_begun"):
        assert getattr(again, name) == getattr(opt, name), name
    assert restored.privacy.epsilon(1e-5) == pytest.approx(model.privacy.epsilon(1e-5), rel=1e-12)
    # The ghat table holds raw per-record gradient norms: never in a saved file.
    assert again.ghat_table is None
    assert all(v.shape != (N,) for v in again.variables)
    restored.fit(x, y, batch_size=B, epochs=1, verbose=0)
    assert again.epochs_begun == 3 and again.ghat_table.shape == (N,)
    releases = restored.privacy.composed_event().events
    assert sum(e == isp.count_event(5.0) for e in releases) == 1  # N~ not released again
    assert restored.privacy.steps == 3 * (N // B)
    assert restored.privacy.epsilon(1e-5) <= 4.0


def test_training_stops_after_the_planned_epochs():
    x, y = data()
    model = model_with(dpis(epochs=1, target_epsilon=2.0))
    with pytest.warns(UserWarning, match="ran all its planned epochs"):
        history = model.fit(x, y, batch_size=B, epochs=3, verbose=0)
    assert len(history.epoch) == 1
    assert model.privacy.epsilon(1e-5) <= 2.0
    with pytest.raises(ValueError, match="started all its planned epochs"):
        model.fit(x, y, batch_size=B, epochs=1, verbose=0)


def test_adaptive_clipping_releases_k_star_and_moves_the_clip():
    x, y = data()
    optimizer = dpis(epochs=2, adaptive_clipping=True, l2_norm_clip=0.05)
    model = model_with(optimizer)
    model.fit(x, y, batch_size=B, epochs=2, verbose=0)
    first, second = optimizer.epoch_history
    assert first["clip_norm"] == 0.05
    assert second["clip_norm"] != 0.05 and 0 < second["clip_norm"] <= 4 * 0.05
    k_event = isp.norm_sum_event(5.0, B / first["n_tilde"])
    assert sum(e == k_event for e in model.privacy.composed_event().events) == 3  # K, K*, K
    assert model.privacy.epsilon(1e-5) <= 4.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(k=1.0), "Received: k=1.0"),
        (dict(k=0.5), "Received: k=0.5"),
        (dict(sigma_n=0.0), "Received: sigma_n=0.0"),
        (dict(sigma_n=-3.0), "Received: sigma_n=-3.0"),
        (dict(sigma_n=None), "Received: sigma_n=None"),
        (dict(sigma_k=0.0), "Received: sigma_k=0.0"),
        (dict(target_epsilon=None), "Received: target_epsilon=None"),
        (dict(target_epsilon=-1.0), "Received: target_epsilon=-1.0"),
        (dict(epochs=0), "Received: epochs=0"),
        (dict(epoch_divider=1.5), "Received: epoch_divider=1.5"),
        (dict(gradient_floor=0.0), "Received: gradient_floor=0.0"),
        (dict(accountant="moments"), "Received: accountant='moments'"),
        (dict(inner_optimizer=keras.optimizers.Adam()), "inner_optimizer=Adam"),
    ],
)
def test_bad_settings_name_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        dpis(**overrides)


@pytest.mark.parametrize(
    "overrides, match",
    [
        # DPOptimizer's float32 bound (1e30), with DPIS's own arguments only:
        # its message showed DPIS's placeholder ", noise_multiplier=1".
        (dict(l2_norm_clip=1e31), r"`l2_norm_clip` = 1e\+31 overflows float32.*Received: l2_norm_clip=1e\+31$"),
        (dict(sigma_n=1e31), r"`sigma_n` = 1e\+31 overflows float32.*Received: sigma_n=1e\+31$"),
        (dict(adaptive_clipping=True, external_clip=1e31),
         r"`clip_quantile \* external_clip` = 1e\+31 overflows float32.*external_clip=1e\+31"),
        (dict(adaptive_clipping=True, clip_quantile=1e30),
         r"`clip_quantile \* 4 \* l2_norm_clip` = 4e\+30 overflows float32.*clip_quantile=1e\+30"),
        (dict(sigma_n=float("nan")), r"`sigma_n`.*Received: sigma_n=nan"),
        (dict(sigma_n=float("inf")), r"`sigma_n`.*Received: sigma_n=inf"),
        (dict(sigma_k=float("nan")), r"`sigma_k`.*Received: sigma_k=nan"),
        (dict(sigma_k=float("inf")), r"`sigma_k`.*Received: sigma_k=inf"),
        (dict(l2_norm_clip=float("nan")), r"`l2_norm_clip`.*Received: l2_norm_clip=nan"),
        (dict(external_clip=float("inf")), r"`external_clip`.*Received: external_clip=inf"),
        (dict(clip_quantile=float("nan")), r"`clip_quantile`.*Received: clip_quantile=nan"),
        (dict(momentum=float("nan")), r"`momentum`.*Received: momentum=nan"),
    ],
)
def test_settings_that_overflow_float32_or_are_not_finite_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        dpis(**overrides)


def test_large_but_float32_safe_settings_are_accepted():
    """Control for the refusals above: at the bound itself, and ordinary values."""
    optimizer = dpis(l2_norm_clip=1e6, sigma_n=1e30, sigma_k=1e6, adaptive_clipping=True,
                     external_clip=1e29, clip_quantile=10.0)
    assert (optimizer.sigma_n, optimizer.external_clip, optimizer.clip_quantile) == (1e30, 1e29, 10.0)
    dpis(l2_norm_clip=1e30)
    dpis(adaptive_clipping=True, l2_norm_clip=2.5e29)  # C* = 4 C = 1e30


def test_batch_too_large_for_the_noisy_dataset_size_is_refused():
    x, y = data(40)
    model = model_with(dpis(sigma_n=0.5, seed=0))
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="K~ floor"):
        model.fit(x, y, batch_size=40, epochs=1, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_config_round_trip_and_inner_optimizer():
    optimizer = tfdp.optimizers.DPIS(
        inner_optimizer=keras.optimizers.Adam(1e-3), l2_norm_clip=0.1, target_epsilon=2.0,
        epochs=40, sigma_n=1200.0, k=3.0, epoch_divider=1.0, adaptive_clipping=True,
    )
    config = optimizer.get_config()
    assert "noise_multiplier" not in config and "_noise_key" not in str(config)
    restored = tfdp.optimizers.DPIS.from_config(config)
    assert isinstance(restored.inner_optimizer, keras.optimizers.Adam)
    for key in ("target_epsilon", "epochs", "sigma_n", "k", "epoch_divider", "adaptive_clipping"):
        assert getattr(restored, key) == getattr(optimizer, key), key
    assert restored.noise_multiplier is None
    with pytest.raises(AttributeError, match="cannot be set"):
        restored.noise_multiplier = 1.0
