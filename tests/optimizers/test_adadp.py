"""AdaDP: equals DP-SGD in warm-up, statistics read released gradients only,
the RMSprop step, logs, ledger, saving, the paper report, and the Beale run."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import accounting
from tfdp.per_example import MaterializedGrads, PerExampleGradients
from tests.example_scripts import load_example
from tests.noiseless import NoiselessDPSGD

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


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


def bounds_of(s, beta, clip):
    """The bounds AdaDP must use for s: beta C sqrt(s' / sum s'), numpy."""
    flat = np.concatenate([np.ravel(x) for x in s]).astype(np.float64)
    floor = max(1e-3 * flat.mean(), 1e-35)  # an all-zero s gives uniform bounds
    return [beta * clip * np.sqrt(np.maximum(x, floor) / np.maximum(flat, floor).sum()) for x in s]


@pytest.mark.parametrize("mode", ["coordinate", "whitened_l2"])
def test_adaptive_phase_clips_locally_and_noises_per_coordinate(mode):
    vs = [tf.Variable(tf.zeros([4]))]
    s = np.array([4.0, 1.0, 0.25, 0.0], np.float32)
    opt = NoiselessAdaDP(learning_rate=0.1, l2_norm_clip=3.0, noise_multiplier=1.0,
                         local_clip_factor=1.0, local_clipping=mode)
    opt.build(vs)
    opt.second_moments(vs)[0].assign(s)
    grads = np.array([[5.0, -5.0, 0.1, 3.0], [0.1, 0.05, -0.02, 0.0]], np.float32)
    info = {"mask": tf.constant([1.0, 1.0]), "expected_batch_size": tf.constant(2.0)}
    (released,), logs = step(opt, vs, [grads], info)
    (c,) = bounds_of([s], 1.0, 3.0)
    assert np.sum(c**2) == pytest.approx(9.0)
    if mode == "coordinate":
        clipped = np.clip(grads, -c, c)
    else:  # the ellipsoid sum_j g_j^2 / (d c_j^2) <= 1
        norms = np.linalg.norm(grads / (2.0 * c), axis=1)
        clipped = grads * np.minimum(1.0, 1.0 / norms)[:, None]
        assert norms[0] > 1 > norms[1]  # one example clipped, one kept
    np.testing.assert_allclose(released, clipped.sum(0) / 2.0, rtol=1e-5)
    assert logs["adadp_phase"] == 1.0
    # Real noise: sigma_j = sigma* sqrt(d) c_j.
    real = tfdp.optimizers.AdaDP(learning_rate=0.1, l2_norm_clip=3.0, noise_multiplier=1.0,
                                 local_clip_factor=1.0, local_clipping=mode, seed=3)
    real.build(vs)
    real.second_moments(vs)[0].assign(s)
    _, logs = step(real, vs, [grads], info)
    stds = 2.0 * c
    assert logs["adadp_noise_std_mean"] == pytest.approx(stds.mean(), rel=1e-5)
    assert logs["adadp_noise_std_spread"] == pytest.approx(stds.std(), rel=1e-5)


class AlwaysAdaptiveAdaDP(tfdp.optimizers.AdaDP):
    """Test double: the adaptive phase on every step, even with a uniform s."""

    def in_adaptive_phase(self, moments):
        return tf.constant(True)


class NoiselessAlwaysAdaptiveAdaDP(AlwaysAdaptiveAdaDP, NoiselessAdaDP):
    pass


@pytest.mark.parametrize("noise", ["off", "seeded"])
def test_whitened_l2_with_uniform_s_is_dpsgd_with_clip_beta_c(noise):
    """Adaptive phase, s uniform: c_j = beta C / sqrt(d), the ellipsoid is
    DP-SGD's ball of radius beta C and the noise sigma* beta C, so ADAN's
    releases and weights equal DP-SGD's (clip beta C, SGD with momentum 0.9)
    step by step."""
    rng = np.random.default_rng(7)
    beta, clip, sigma = 1.2, 0.5, 1.3
    ada_class, sgd_class = (
        (NoiselessAlwaysAdaptiveAdaDP, NoiselessDPSGD) if noise == "off"
        else (AlwaysAdaptiveAdaDP, tfdp.optimizers.DPSGD)
    )
    runs = {}
    for name, make in (
        ("adadp", lambda: ada_class(learning_rate=0.05, l2_norm_clip=clip, noise_multiplier=sigma,
                                    local_clip_factor=beta, adaptive_learning_rate=False,
                                    momentum=0.9, gamma_prime=0.0, seed=9)),
        ("dpsgd", lambda: sgd_class(learning_rate=0.05, l2_norm_clip=beta * clip,
                                    noise_multiplier=sigma, momentum=0.9, seed=9)),
        ("box", lambda: ada_class(learning_rate=0.05, l2_norm_clip=clip, noise_multiplier=sigma,
                                  local_clip_factor=beta, adaptive_learning_rate=False,
                                  gamma_prime=0.0, local_clipping="coordinate", seed=9)),
    ):
        vs, opt = variables(), make()
        opt.build(vs)
        runs[name] = (vs, opt, [])
    for t in range(4):
        grads = random_grads(rng, scale=[0.02, 0.3, 3.0, 0.3][t])  # inside and outside the ball
        for name, (vs, opt, released) in runs.items():
            if name != "dpsgd":  # uniform s on every step, at a different level each time
                for slot in opt.second_moments(vs):
                    slot.assign(tf.fill(slot.shape, 10.0 ** (t - 2)))
            released.append(step(opt, vs, grads)[0])
    for got, want in zip(runs["adadp"][2], runs["dpsgd"][2]):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(runs["adadp"][0], runs["dpsgd"][0]):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)
    # Negative control: the paper's box (inscribed in the ball) is not DP-SGD.
    assert not np.allclose(runs["box"][2][2][0], runs["dpsgd"][2][2][0], rtol=1e-3)


def test_bounds_square_sum_is_beta_c_squared_on_every_step():
    """s (fed by the optimizer's own released gradients, gamma' = 0) shrinks
    by 100x a step for 4 steps, then grows back: the bounds every step uses
    have sum_j c_j^2 = beta^2 C^2 and the logged noise is sigma* sqrt(d) c_j."""
    rng = np.random.default_rng(3)
    vs = variables()
    beta, clip, sigma, d = 1.2, 0.5, 1e-6, 15
    opt = tfdp.optimizers.AdaDP(learning_rate=0.01, l2_norm_clip=clip, noise_multiplier=sigma,
                                local_clip_factor=beta, local_clip_threshold=0.0,
                                gamma_prime=0.0, seed=2)
    opt.build(vs)
    totals = []
    for scale in [1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]:
        s = [m.numpy() for m in opt.second_moments(vs)]
        totals.append(sum(float(np.sum(x)) for x in s))
        bounds = [b.numpy().astype(np.float64) for b in opt.clip_bounds([tf.constant(x) for x in s])]
        assert sum(float(np.sum(b**2)) for b in bounds) == pytest.approx((beta * clip) ** 2, rel=1e-5)
        for b, want in zip(bounds, bounds_of(s, beta, clip)):
            np.testing.assert_allclose(b, want, rtol=1e-5)
        _, logs = step(opt, vs, random_grads(rng, scale=scale))
        if totals[-1] > 0:  # after the first (warm-up) step
            assert logs["adadp_phase"] == 1.0
            stds = sigma * math.sqrt(d) * np.concatenate([b.ravel() for b in bounds])
            assert logs["adadp_noise_std_mean"] == pytest.approx(stds.mean(), rel=1e-4)
    # s really shrank (by > 1e6) and grew back (by > 1e6).
    low = min(totals[1:])
    assert totals[1] / low > 1e6 and totals[-1] / low > 1e6, totals


class HalfNoiseAdaDP(tfdp.optimizers.AdaDP):
    """Negative control: adds half the whitened noise it claims."""

    def whitened_noise_multiplier(self):
        return 0.5 * super().whitened_noise_multiplier()


@pytest.mark.parametrize("optimizer_class, caught", [(tfdp.optimizers.AdaDP, False),
                                                    (HalfNoiseAdaDP, True)])
@pytest.mark.parametrize("mode", ["whitened_l2", "coordinate"])
def test_optimizer_adds_whitened_noise_of_std_sigma_star(optimizer_class, caught, mode):
    """Through the optimizer's adaptive phase, not the helper: with zero
    gradients the release is noise/b; whitened by b / (sqrt(d) c_j),
    c_j = beta C sqrt(s_j / sum s), it must be N(0, sigma*^2) on every
    coordinate group (4 x 1024 coordinates, a sample std's own std is
    about 2%)."""
    d, sigma, batch, beta, clip = 4096, 1.3, 2, 1.2, 0.7
    shape = np.repeat(np.array([4.0, 1.0, 0.25, 0.01], np.float32), d // 4)
    vs = [tf.Variable(tf.zeros([d]))]
    opt = optimizer_class(learning_rate=0.1, l2_norm_clip=clip, noise_multiplier=sigma,
                          local_clip_factor=beta, local_clipping=mode, seed=5)
    opt.build(vs)
    opt.second_moments(vs)[0].assign(shape)
    info = {"mask": tf.ones([batch]), "expected_batch_size": tf.constant(float(batch))}
    (released,), logs = step(opt, vs, [np.zeros((batch, d), np.float32)], info)
    assert logs["adadp_phase"] == 1.0
    c = beta * clip * np.sqrt(shape / shape.sum())
    whitened = released * batch / (np.sqrt(d) * c)
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


def independent_public_statistic(model, x, y):
    """Mean over (x, y) of squared per-example gradients, one tape per example."""
    total = [np.zeros(v.shape) for v in model.trainable_variables]
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = LOSS(y[i : i + 1], model(x[i : i + 1], training=False))
        grads = tape.gradient(loss, model.trainable_variables)
        total = [t + g.numpy() ** 2 for t, g in zip(total, grads)]
    return [t / len(x) for t in total]


def fit_shape(noise_shape, x, y, public, steps=3, learning_rate=0.0, **kwargs):
    keras.utils.set_random_seed(0)
    model = small_model()
    extra = dict(public_data=public) if noise_shape == "public" else {}
    opt = tfdp.optimizers.AdaDP(learning_rate=learning_rate, l2_norm_clip=1.0,
                                noise_multiplier=1.1, local_clip_threshold=0.0,
                                noise_shape=noise_shape, seed=4, **extra, **kwargs)
    model.compile(optimizer=opt, loss=LOSS)
    return model, fit_moments(model, x, y, steps)


def fit_moments(model, x, y, steps=3):
    """Fits `model` (compiled with AdaDP) for `steps` steps; its second moments s."""
    model.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=steps, verbose=0)
    return [m.numpy() for m in model.optimizer.second_moments(model.trainable_variables)]


def test_public_shape_never_reads_training_data():
    """Learning rate 0 (the weights stay put): trained on two different
    training sets, the public s is identical, and equals the mean squared
    per-example gradient on the public set computed independently. The
    released shape (negative control) differs between the two sets.

    The public runs share one compiled model (its weights cannot move):
    the second fit, on the other set, refreshes s at every step as a new
    model's would, and any trace of either set in s would differ between them."""
    public = small_data(20, seed=1)
    train_a, train_b = small_data(60, seed=2), small_data(60, seed=3)
    train_b = (train_b[0] * 5.0, train_b[1])
    model, s_a = fit_shape("public", *train_a, public, public_refresh_steps=1)
    # The ledger holds DP-SGD's event for every step, as for the released shape.
    want = accounting.compute_epsilon(1.1, 10 / 60, 3, 1e-5)
    assert model.privacy.epsilon(1e-5) == pytest.approx(want, rel=1e-9)
    weights = [w.numpy() for w in model.trainable_variables]
    s_b = fit_moments(model, *train_b)
    for before, after in zip(weights, model.trainable_variables):
        np.testing.assert_array_equal(before, after.numpy())
    for a, b, want in zip(s_a, s_b, independent_public_statistic(model, *public)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, want, rtol=1e-4, atol=1e-9)
    _, r_a = fit_shape("released", *train_a, None)
    _, r_b = fit_shape("released", *train_b, None)
    assert not np.allclose(r_a[0], r_b[0], rtol=0.1)


class CountingAdaDP(tfdp.optimizers.AdaDP):
    """Counts public refreshes and the step each happened before."""

    def public_second_moments(self, model):
        self.refreshed_at = getattr(self, "refreshed_at", []) + [int(self.iterations.numpy())]
        return super().public_second_moments(model)


def test_public_shape_refresh_schedule_and_refusals(tmp_path):
    x, y = small_data(60, seed=2)
    public = small_data(20, seed=1)
    keras.utils.set_random_seed(0)
    model = small_model()
    opt = CountingAdaDP(learning_rate=0.01, l2_norm_clip=1.0, noise_multiplier=1.1,
                        noise_shape="public", public_data=public, public_refresh_steps=3, seed=4)
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=7, verbose=0)
    assert opt.refreshed_at == [0, 3, 6]
    model.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=2, verbose=0)
    assert opt.refreshed_at == [0, 3, 6, 7]  # every fit starts with a fresh s
    # s holds the statistic of the last refresh (weights of step 7 -> 8 moved since).
    assert all(float(np.sum(m.numpy())) > 0 for m in opt.second_moments(model.trainable_variables))
    # Training data in the public set is refused before any step.
    leaky = (np.concatenate([public[0], x[:5]]), np.concatenate([public[1], y[:5]]))
    opt.set_public_data(leaky)
    steps = model.privacy.steps
    with pytest.raises(ValueError, match="5 of the 25 examples of `public_data`"):
        model.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=1, verbose=0)
    assert model.privacy.steps == steps
    # A loaded model has no public arrays until they are set again.
    opt.set_public_data(public)
    path = str(tmp_path / "public.keras")
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"CountingAdaDP": CountingAdaDP})
    assert loaded.optimizer.noise_shape == "public"
    with pytest.raises(ValueError, match="set_public_data"):
        loaded.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=1, verbose=0)
    loaded.optimizer.set_public_data(public)
    loaded.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=1, verbose=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gamma=0.0), "Received: gamma=0.0"),
        (dict(gamma_prime=1.0), "Received: gamma_prime=1.0"),
        (dict(local_clip_threshold=-1.0), "Received: local_clip_threshold=-1.0"),
        (dict(local_clip_factor=0.0), "Received: local_clip_factor=0.0"),
        (dict(epsilon=-1e-7), "Received: epsilon=-1e-07"),
        (dict(local_clipping="l1"), "Received: local_clipping='l1'"),
        (dict(noise_shape="raw"), "Received: noise_shape='raw'"),
        (dict(momentum=0.9), "momentum=0.9 and adaptive_learning_rate=True"),
        (dict(momentum=1.0, adaptive_learning_rate=False), "Received: momentum=1.0"),
        (dict(public_refresh_steps=0), "Received: public_refresh_steps=0"),
        (dict(public_data=(np.zeros((2, 4)), np.zeros(2))), "noise_shape='released' and public_data"),
        (dict(noise_shape="public", adaptive_noise=False), "adaptive_noise=False"),
        (dict(noise_shape="public", public_data=(np.zeros((2, 4)), np.zeros(3))), "y of shape"),
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
        local_clipping="coordinate", noise_shape="public", public_data=(np.zeros((2, 4)), np.zeros(2)),
        public_refresh_steps=7, adaptive_learning_rate=False, adaptive_noise=True, momentum=0.5,
        weight_decay=0.01, seed=5,
    )
    config = keras.saving.serialize_keras_object(opt)
    again = keras.saving.deserialize_keras_object(config)
    assert again.get_config()["local_clipping"] == "coordinate"
    assert (again.noise_shape, again.public_refresh_steps, again.momentum) == ("public", 7, 0.5)
    assert again.inner_optimizer.momentum == 0.5
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
    return load_example("adadp_beale")


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
