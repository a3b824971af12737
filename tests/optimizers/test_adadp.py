"""AdaDP: equals DP-SGD in warm-up, statistics read released gradients only,
the RMSprop step, logs, ledger, saving, the paper report, and the Beale run."""

import importlib.util
import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import accounting
from tfdp.models.per_example import MaterializedGrads, PerExampleGradients

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class NoiselessAdaDP(tfdp.optimizers.AdaDP):
    """Test double: AdaDP with its noise removed in both phases."""

    def noise_stddev(self):
        return 0.0

    def whitened_noise_multiplier(self):
        return 0.0


def variables(seed=0):
    rng = np.random.default_rng(seed)
    return [
        tf.Variable(rng.normal(size=(4, 3)).astype(np.float32), name="kernel"),
        tf.Variable(rng.normal(size=(3,)).astype(np.float32), name="bias"),
    ]


def per_example(vars_, grads):
    return PerExampleGradients(vars_, [MaterializedGrads(vars_, [tf.constant(g) for g in grads])])


def random_grads(rng, batch=6, scale=1.0):
    return [
        (rng.normal(size=(batch, 4, 3)) * scale).astype(np.float32),
        (rng.normal(size=(batch, 3)) * scale).astype(np.float32),
    ]


INFO = {"mask": tf.ones([6]), "expected_batch_size": tf.constant(6.0)}


def step(opt, vars_, grads, info=INFO):
    released, _ = opt.privatize(per_example(vars_, grads), info)
    logs = opt.apply_private_gradients(released, vars_)
    return [g.numpy() for g in released], {k: float(v) for k, v in logs.items()}


def test_warm_up_and_adal_release_exactly_dpsgds_noisy_gradient():
    rng = np.random.default_rng(0)
    settings = dict(l2_norm_clip=0.7, noise_multiplier=1.3, seed=11)
    ada_vars, ada_l_vars, sgd_vars = variables(), variables(), variables()
    adadp = tfdp.optimizers.AdaDP(learning_rate=0.01, **settings)
    adal = tfdp.optimizers.AdaDP(learning_rate=0.01, adaptive_noise=False, **settings)
    dpsgd = tfdp.optimizers.DPSGD(learning_rate=0.01, **settings)
    for opt, vs in ((adadp, ada_vars), (adal, ada_l_vars), (dpsgd, sgd_vars)):
        opt.build(vs)
    for t in range(4):
        grads = random_grads(rng, scale=3.0)
        want, _ = step(dpsgd, sgd_vars, grads)
        got_l, _ = step(adal, ada_l_vars, grads)
        for a, b in zip(got_l, want):  # ADAL: DP-SGD's noisy gradient every step
            np.testing.assert_array_equal(a, b)
        got, logs = step(adadp, ada_vars, grads)
        if t == 0:  # s = 0: warm-up, DP-SGD's release for the same seed
            assert logs["adadp_phase"] == 0.0
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
            assert logs["adadp_noise_std_mean"] == pytest.approx(0.7 * 1.3)
            assert logs["adadp_noise_std_spread"] == 0.0
    # Negative control: once adaptive, AdaDP's release differs from DP-SGD's.
    assert logs["adadp_phase"] == 1.0
    assert not np.allclose(got[0], want[0])


def test_statistics_follow_the_released_gradient_never_the_raw_one():
    """Noise 0: two raw gradient streams that release the same clipped
    gradients must leave identical v and s, equal to EMAs of the release."""
    rng = np.random.default_rng(1)
    # Coordinates of magnitude >= 0.5 * scale, far above any clip bound (<= C).
    directions = [
        [np.sign(g) * (0.5 + np.abs(g) % 1.0) for g in random_grads(rng, batch=1)]
        for _ in range(8)
    ]
    runs = {}
    for name, scale in (("small", 1e3), ("large", 1e5)):
        vs = variables()
        opt = NoiselessAdaDP(learning_rate=0.01, l2_norm_clip=1.0, noise_multiplier=1.0)
        opt.build(vs)
        released, phases = [], []
        for u in directions:  # the gradient changes every step
            grads = [np.repeat(g, 6, 0) * scale for g in u]
            r, logs = step(opt, vs, grads)
            released.append(r)
            phases.append(logs["adadp_phase"])
        runs[name] = (opt, vs, released, phases, scale)
    opt_a, vs_a, rel_a, phases, _ = runs["small"]
    opt_b, vs_b, rel_b, _, _ = runs["large"]
    assert phases[0] == 0.0 and phases[-1] == 1.0  # both phases were exercised
    for a, b in zip(rel_a, rel_b):  # clipping made the releases equal
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=1e-6)
    for get in ("second_moments", "velocities"):
        for x, y in zip(getattr(opt_a, get)(vs_a), getattr(opt_b, get)(vs_b)):
            np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-6)
    # Both statistics are the EMAs of the released gradients...
    s = [np.zeros_like(g) for g in rel_a[0]]
    v = [np.zeros_like(g) for g in rel_a[0]]
    for r in rel_a:
        s = [0.9 * a + 0.1 * g**2 for a, g in zip(s, r)]
        v = [0.9 * a + 0.1 * g**2 for a, g in zip(v, r)]
    for want, got in zip(s, opt_a.second_moments(vs_a)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-12)
    for want, got in zip(v, opt_a.velocities(vs_a)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-12)
    # ... and not of the raw gradients (negative control: the check can fail).
    raw = [0.0 * g for g in directions[0]]
    for u in directions:
        raw = [0.9 * a + 0.1 * (1e3 * g[0]) ** 2 for a, g in zip(raw, u)]
    assert not np.allclose(raw[0], opt_a.second_moments(vs_a)[0].numpy(), rtol=0.5)


def test_rmsprop_step_and_adan_step_concrete_numbers():
    vs = [tf.Variable([1.0, -2.0])]
    opt = NoiselessAdaDP(learning_rate=0.1, l2_norm_clip=100.0, noise_multiplier=1.0,
                         local_clip_threshold=1e9, epsilon=1e-7)
    opt.build(vs)
    info = {"mask": tf.ones([1]), "expected_batch_size": tf.constant(1.0)}
    theta, v = np.array([1.0, -2.0]), np.zeros(2)
    for g in ([0.5, -1.0], [2.0, 0.25]):
        step(opt, vs, [np.array([g], np.float32)], info)
        g = np.array(g)
        v = 0.9 * v + 0.1 * g**2
        theta = theta - 0.1 * g / np.sqrt(v + 1e-7)
        np.testing.assert_allclose(vs[0].numpy(), theta, rtol=1e-5)
    vs = [tf.Variable([1.0, -2.0])]
    adan = NoiselessAdaDP(learning_rate=0.1, l2_norm_clip=100.0, noise_multiplier=1.0,
                          local_clip_threshold=1e9, adaptive_learning_rate=False)
    adan.build(vs)
    step(adan, vs, [np.array([[0.5, -1.0]], np.float32)], info)
    np.testing.assert_allclose(vs[0].numpy(), [0.95, -1.9], rtol=1e-6)
    with pytest.raises(ValueError, match="adaptive_learning_rate=False"):
        adan.velocities(vs)


def test_adaptive_phase_clips_locally_and_noises_per_coordinate():
    vs = [tf.Variable(tf.zeros([4]))]
    opt = NoiselessAdaDP(learning_rate=0.1, l2_norm_clip=10.0, noise_multiplier=1.0,
                         local_clip_factor=1.0)
    opt.build(vs)
    opt.second_moments(vs)[0].assign([4.0, 1.0, 0.25, 0.0])
    grads = np.array([[5.0, -5.0, 0.1, 3.0], [1.0, 0.5, -5.0, 0.0]], np.float32)
    info = {"mask": tf.constant([1.0, 1.0]), "expected_batch_size": tf.constant(2.0)}
    (released,), logs = step(opt, vs, [grads], info)
    floor = math.sqrt(1e-6 * 5.25 / 4)
    clipped = np.clip(grads, -np.array([2, 1, 0.5, floor]), [2, 1, 0.5, floor])
    np.testing.assert_allclose(released, clipped.sum(0) / 2.0, rtol=1e-5)
    assert logs["adadp_phase"] == 1.0
    # Real noise: sigma_j = sigma* sqrt(d) c_j.
    real = tfdp.optimizers.AdaDP(learning_rate=0.1, l2_norm_clip=10.0, noise_multiplier=1.0,
                                 local_clip_factor=1.0, seed=3)
    real.build(vs)
    real.second_moments(vs)[0].assign([4.0, 1.0, 0.25, 0.0])
    _, logs = step(real, vs, [grads], info)
    stds = 2.0 * np.array([2, 1, 0.5, floor])
    assert logs["adadp_noise_std_mean"] == pytest.approx(stds.mean(), rel=1e-5)
    assert logs["adadp_noise_std_spread"] == pytest.approx(stds.std(), rel=1e-5)


class HalfNoiseAdaDP(tfdp.optimizers.AdaDP):
    """Negative control: adds half the whitened noise it claims."""

    def whitened_noise_multiplier(self):
        return 0.5 * super().whitened_noise_multiplier()


@pytest.mark.parametrize("optimizer_class, caught", [(tfdp.optimizers.AdaDP, False),
                                                    (HalfNoiseAdaDP, True)])
def test_optimizer_adds_whitened_noise_of_std_sigma_star(optimizer_class, caught):
    """Through the optimizer's adaptive phase, not the helper: with zero
    gradients the release is noise/b; whitened by b / (beta sqrt(d s_j)) it
    must be N(0, sigma*^2) on every coordinate group (4 x 1024 coordinates,
    a sample std's own std is about 2%)."""
    d, sigma, batch = 4096, 1.3, 2
    shape = np.repeat(np.array([4.0, 1.0, 0.25, 0.01], np.float32), d // 4)
    vs = [tf.Variable(tf.zeros([d]))]
    opt = optimizer_class(learning_rate=0.1, l2_norm_clip=100.0, noise_multiplier=sigma,
                          local_clip_factor=1.0, seed=5)
    opt.build(vs)
    opt.second_moments(vs)[0].assign(shape)
    info = {"mask": tf.ones([batch]), "expected_batch_size": tf.constant(float(batch))}
    (released,), logs = step(opt, vs, [np.zeros((batch, d), np.float32)], info)
    assert logs["adadp_phase"] == 1.0
    whitened = released * batch / (np.sqrt(d) * np.sqrt(shape))
    group_stds = whitened.reshape(4, -1).std(axis=1)
    within = np.all(np.abs(group_stds / sigma - 1.0) < 0.08) and abs(whitened.mean()) < 0.1
    assert within != caught, group_stds


def small_model():
    return tfdp.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)]
    )


def small_data(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, size=n)


def test_fit_logs_ledger_save_and_restore(tmp_path):
    x, y = small_data()
    keras.utils.set_random_seed(0)
    model = small_model()
    opt = tfdp.optimizers.AdaDP(learning_rate=0.01, l2_norm_clip=1.0, noise_multiplier=1.1,
                                local_clip_threshold=0.0, local_clipping="whitened_l2", seed=4)
    model.compile(optimizer=opt, loss=LOSS, metrics=["accuracy"])
    history = model.fit(x, y, batch_size=10, epochs=2, steps_per_epoch=3, verbose=0)
    logs = history.history
    assert {"adadp_phase", "adadp_noise_std_mean", "adadp_noise_std_spread"} <= set(logs)
    assert logs["adadp_phase"][-1] == 1.0 and logs["adadp_noise_std_spread"][-1] > 0
    # The ledger charges DP-SGD's event with sigma* for every step.
    want = accounting.compute_epsilon(1.1, 10 / 60, 6, 1e-5)
    assert model.privacy.epsilon(1e-5) == pytest.approx(want, rel=1e-9)
    path = str(tmp_path / "adadp.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, tfdp.optimizers.AdaDP)
    assert loaded.optimizer.get_config() == opt.get_config()
    for get in ("second_moments", "velocities"):
        before = getattr(opt, get)(model.trainable_variables)
        after = getattr(loaded.optimizer, get)(loaded.trainable_variables)
        assert any(float(tf.reduce_max(tf.abs(b))) > 0 for b in before)
        for b, a in zip(before, after):
            np.testing.assert_array_equal(b.numpy(), a.numpy())
    assert int(loaded.optimizer.iterations.numpy()) == 6
    loaded.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=1, verbose=0)
    assert loaded.privacy.steps == 7


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gamma=0.0), "Received: gamma=0.0"),
        (dict(gamma_prime=1.0), "Received: gamma_prime=1.0"),
        (dict(local_clip_threshold=-1.0), "Received: local_clip_threshold=-1.0"),
        (dict(local_clip_factor=0.0), "Received: local_clip_factor=0.0"),
        (dict(epsilon=-1e-7), "Received: epsilon=-1e-07"),
        (dict(local_clipping="l1"), "Received: local_clipping='l1'"),
        (dict(adaptive_noise="yes"), "Received: adaptive_noise='yes'"),
        (dict(noise_multiplier=0.0), "Received: noise_multiplier=0.0"),
    ],
)
def test_bad_settings_name_the_argument(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        tfdp.optimizers.AdaDP(**kwargs)


def test_config_round_trip_of_every_option():
    opt = tfdp.optimizers.AdaDP(
        learning_rate=keras.optimizers.schedules.ExponentialDecay(0.01, 100, 0.9),
        l2_norm_clip=2.0, noise_multiplier=3.0, gamma=0.2, gamma_prime=0.8,
        local_clip_threshold=1e-8, local_clip_factor=1.5, epsilon=1e-6,
        local_clipping="whitened_l2", adaptive_learning_rate=False, adaptive_noise=True,
        weight_decay=0.01, seed=5,
    )
    config = keras.saving.serialize_keras_object(opt)
    again = keras.saving.deserialize_keras_object(config)
    assert again.get_config()["local_clipping"] == "whitened_l2"
    assert keras.saving.serialize_keras_object(again) == config


def test_paper_epsilon_is_the_papers_number_not_the_ledgers():
    opt = tfdp.optimizers.AdaDP(noise_multiplier=0.9)
    assert opt.paper_epsilon(1e-5, 0.01, 1800) == pytest.approx(6.9214, abs=1e-3)
    assert round(opt.paper_epsilon(1e-5, 0.01, 1800, bound="poisson_rdp"), 1) == 4.0
    sound = accounting.compute_epsilon(0.9, 0.01, 1800, 1e-5)
    assert sound < 3.5  # the ledger's tight bound is a different number
    with pytest.raises(ValueError, match="bound='moments'"):
        opt.paper_epsilon(1e-5, 0.01, 10, bound="moments")


def load_beale_example():
    path = os.path.join(ROOT, "examples", "adadp_beale.py")
    spec = importlib.util.spec_from_file_location("adadp_beale", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_beale_trajectories_against_their_non_private_twins():
    """The paper's Fig. 1 comparison: prints D(DP-SGD, twin) and D(AdaDP, twin)."""
    beale = load_beale_example()
    twin = beale.trajectory(beale.NoiselessAdaDP(learning_rate=0.01, l2_norm_clip=1.0,
                                                 noise_multiplier=1.0, local_clip_factor=1.5), 150)
    assert float(beale.beale(tf.constant(twin[-1]))) < 0.05  # the twin reaches the minimum
    low = beale.beale_distances(noise_multiplier=0.05, steps=60, seed=0, dpsgd_learning_rate=0.05)
    high = beale.beale_distances(noise_multiplier=0.5, steps=60, seed=0, dpsgd_learning_rate=0.05)
    print(f"\nBeale, 60 steps, sigma 0.5: D(DP-SGD, twin) = {high['dpsgd']:.3f}, "
          f"D(AdaDP, twin) = {high['adadp']:.3f} (sigma 0.05: {low['dpsgd']:.3f}, {low['adadp']:.3f})")
    for name in ("dpsgd", "adadp"):
        assert 0.0 < low[name] < high[name] < 5.0  # noise moves both, more noise more
