"""DPIS's math (MECHANISMS.md 4): releases, two-stage sampling, weights, events, budget."""

import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from tfdp import accounting
from tfdp.data.importance import ImportanceSampler
from tfdp.mechanisms import importance_sampling as isp

DELTA = 1e-5


def _records(n=60, d=4, seed=0):
    """Per-example gradients with norms spread over [0.05, 3] (C = 1 clips some)."""
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(n, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    norms = rng.uniform(0.05, 3.0, size=n)
    return directions * norms[:, None], norms


def _draw_many(grads, ghat, k_tilde, n_tilde, b, clip, draws, seed, capped=True):
    """`draws` independent DPIS estimates (no noise) via the library's stages.

    Returns (estimates [draws, d], accepted counts [draws], stage-1 counts).
    """
    n = len(grads)
    rng = np.random.default_rng(seed)
    q = isp.first_stage_probabilities(ghat, k_tilde, b)
    if not capped:  # the paper: min(b * ghat / K~, 1) with an uncapped ghat
        q = np.minimum(b * ghat / k_tilde, 1.0).astype(np.float32)
    stage1 = (rng.random((draws, n)) < q).astype(np.float32)
    sq = np.tile(np.sum(grads**2, axis=1), draws).astype(np.float32)
    stage = isp.second_stage(
        sq,
        np.tile(ghat, draws),
        clip,
        rng.random(draws * n).astype(np.float32),
        stage1.reshape(-1),
    )
    weights = isp.importance_weights(stage["norms"], stage["accepted"], k_tilde, n_tilde)
    weights = weights.numpy().reshape(draws, n)
    estimates = weights @ grads / b
    accepted = stage["accepted"].numpy().reshape(draws, n).sum(axis=1)
    return estimates, accepted, stage1.sum(axis=1)


# -- releases -----------------------------------------------------------------


def test_clamp_keeps_k_between_floor_and_ceiling():
    assert isp.clamp_norm_sum(3.0, batch_size=10, clip=0.5, n_tilde=100.0) == pytest.approx(5.5)
    assert isp.clamp_norm_sum(30.0, batch_size=10, clip=0.5, n_tilde=100.0) == 30.0
    assert isp.clamp_norm_sum(1e6, batch_size=10, clip=0.5, n_tilde=100.0) == 50.0
    assert isp.clamp_norm_sum(-7.0, batch_size=10, clip=0.5, n_tilde=100.0, xi=0.01) == pytest.approx(5.01)


def test_k_floor_at_or_above_the_ceiling_is_refused():
    with pytest.raises(ValueError, match="K~ floor .* Received: batch_size=99"):
        isp.clamp_norm_sum(10.0, batch_size=99, clip=1.0, n_tilde=100.0)
    with pytest.raises(ValueError, match="Received: xi=0.0"):
        isp.clamp_norm_sum(10.0, batch_size=10, clip=1.0, n_tilde=100.0, xi=0.0)


@pytest.mark.parametrize("sigma_n", [0.0, -1.0, float("nan")])
def test_non_positive_sigma_n_is_refused(sigma_n):
    with pytest.raises(ValueError, match="sigma_n"):
        isp.count_event(sigma_n)
    with pytest.raises(ValueError, match="sigma_n"):
        isp.noisy_count(100, sigma_n, np.random.default_rng(0))


def test_count_and_norm_sum_events():
    assert isp.count_event(30.0) == dp_accounting.GaussianDpEvent(30.0)
    assert isp.norm_sum_event(2.0, 0.05) == dp_accounting.PoissonSampledDpEvent(
        0.05, dp_accounting.GaussianDpEvent(2.0)
    )
    assert isp.norm_sum_sampling_probability(64, 1400.0) == pytest.approx(64 / 1400)
    assert isp.norm_sum_sampling_probability(64, 50.0) == 1.0


def test_k_release_noise_has_the_accounted_scale():
    """K' = (S + N(0, (sigma_K C)^2)) / p_K: with all norms 0 its std is sigma_K C / p_K.

    The paper puts N(0, (sigma_K C)^2) after the 1/p_K scaling while charging
    sensitivity C: that smaller noise (std sigma_K C) must not be what runs.
    """
    rng = np.random.default_rng(1)
    sigma_k, clip, p = 3.0, 0.5, 0.25
    samples = np.array(
        [isp.noisy_norm_sum(np.zeros(10), clip, sigma_k, p, rng) for _ in range(4000)]
    )
    want = sigma_k * clip / p
    assert np.std(samples) == pytest.approx(want, rel=0.05)
    assert abs(np.std(samples) - sigma_k * clip) > 0.5 * want  # negative control
    assert abs(np.mean(samples)) < 4 * want / math.sqrt(4000)


def test_k_release_is_unbiased_for_the_clipped_norm_sum():
    rng = np.random.default_rng(2)
    _, norms = _records(200)
    clipped = np.minimum(norms, 1.0)
    samples = np.array([isp.noisy_norm_sum(norms, 1.0, 0.5, 0.2, rng) for _ in range(3000)])
    error = np.std(samples) / math.sqrt(len(samples))
    assert abs(np.mean(samples) - clipped.sum()) < 4 * error
    assert abs(np.mean(samples) - norms.sum()) > 10 * error  # the unclipped sum is not it


# -- sampling -------------------------------------------------------------------


def test_ghat_is_capped_so_stage_one_probabilities_stay_at_most_one():
    norms = np.array([0.0, 0.001, 0.3, 0.9, float("nan")])
    ghat = isp.first_stage_bounds(norms, k=5, floor=0.01, k_tilde=20.0, batch_size=10).numpy()
    np.testing.assert_allclose(ghat, [0.05, 0.05, 1.5, 2.0, 2.0], rtol=1e-6)
    q = isp.first_stage_probabilities(ghat, 20.0, 10)
    np.testing.assert_allclose(q, [0.025, 0.025, 0.75, 1.0, 1.0], rtol=1e-6)


@pytest.mark.parametrize("k_tilde", [150.0, 12.0])  # k*b*C = 5*4*1 = 20: both sides
def test_inclusion_probability_is_exactly_b_norm_over_k(k_tilde):
    """With the cap, q_i * p_i = b ||g_i clipped|| / K~ exactly, also for K~ < k b C."""
    _, norms = _records(40, seed=3)
    b, k, clip = 4, 5.0, 1.0
    clipped = np.minimum(norms, clip)
    ghat = isp.first_stage_bounds(clipped, k, 0.01, k_tilde, b).numpy()
    q = isp.first_stage_probabilities(ghat, k_tilde, b)
    stage = isp.second_stage(norms**2, ghat, clip, np.zeros(40), np.ones(40))
    pi = q * stage["probability"].numpy()
    np.testing.assert_allclose(pi, b * clipped / k_tilde, rtol=1e-5)
    if k_tilde < k * b * clip:
        # Negative control, the paper's uncapped rule q = min(b k ||g|| / K~, 1):
        # the largest-norm records are included less often than b ||g|| / K~.
        paper_q = np.minimum(b * k * clipped / k_tilde, 1.0)
        paper_pi = paper_q * clipped / (k * clipped)
        # Their terms (b / (N~ pi_i)) ||g_i clipped|| exceed K~ / N~ by 1.5x and more.
        assert np.max((b * clipped / k_tilde) / paper_pi) > 1.5


@pytest.mark.parametrize("k_tilde", [150.0, 12.0])
def test_every_accepted_term_has_norm_k_over_n(k_tilde):
    grads, norms = _records(40, seed=4)
    n_tilde, b, clip = 43.5, 4, 1.0
    ghat = isp.first_stage_bounds(np.minimum(norms, clip), 5.0, 0.01, k_tilde, b).numpy()
    rng = np.random.default_rng(0)
    stage = isp.second_stage(norms**2, ghat, clip, rng.random(40), np.ones(40))
    weights = isp.importance_weights(stage["norms"], stage["accepted"], k_tilde, n_tilde).numpy()
    accepted = stage["accepted"].numpy()
    assert accepted.sum() >= 5
    term_norms = np.linalg.norm(weights[:, None] * grads, axis=1)
    np.testing.assert_allclose(term_norms[accepted], k_tilde / n_tilde, rtol=1e-5)
    assert np.all(weights[~accepted] == 0)
    # The same term written the paper's way: (b / (N~ pi_i)) * clip(g_i).
    pi = isp.first_stage_probabilities(ghat, k_tilde, b) * stage["probability"].numpy()
    clip_factor = np.minimum(1.0, np.minimum(ghat, clip) / norms)
    paper_terms = (b / (n_tilde * pi))[:, None] * clip_factor[:, None] * grads
    np.testing.assert_allclose(paper_terms[accepted], (weights[:, None] * grads)[accepted], rtol=1e-4)


def test_rejected_padding_and_nan_rows_get_zero_weight():
    stage = isp.second_stage(
        np.array([1.0, float("nan"), 4.0, 0.0], np.float32),
        np.array([2.0, 2.0, 2.0, 2.0], np.float32),
        1.0,
        np.zeros(4, np.float32),
        np.array([1.0, 1.0, 0.0, 1.0], np.float32),
    )
    np.testing.assert_array_equal(stage["accepted"].numpy(), [True, False, False, False])
    weights = isp.importance_weights(stage["norms"], stage["accepted"], 10.0, 100.0).numpy()
    np.testing.assert_allclose(weights, [0.1, 0.0, 0.0, 0.0])


def test_estimator_is_unbiased_for_the_mean_clipped_gradient():
    """Mean over draws of (1/b) sum_accepted (b / (N pi_i)) clip(g_i) = (1/N) sum clip(g_i)."""
    grads, norms = _records(60, d=4, seed=5)
    n, b, clip, k = 60, 6, 1.0, 3.0
    clipped = np.minimum(norms, clip)
    k_tilde = float(clipped.sum())
    ghat = isp.first_stage_bounds(clipped, k, 0.01, k_tilde, b).numpy()
    estimates, _, _ = _draw_many(grads, ghat, k_tilde, float(n), b, clip, draws=20000, seed=6)
    truth = (grads * (clipped / norms)[:, None]).mean(axis=0)
    error = estimates.std(axis=0) / math.sqrt(len(estimates))
    np.testing.assert_array_less(np.abs(estimates.mean(axis=0) - truth), 4.5 * error)
    # Negative control: without the 1/pi weights (plain mean of the accepted
    # clipped gradients) the estimate is biased towards large gradients.
    rng = np.random.default_rng(7)
    pi = b * clipped / k_tilde
    chosen = rng.random((20000, n)) < pi
    naive = (chosen * (clipped / norms)) @ grads / b
    assert np.max(np.abs(naive.mean(axis=0) - truth) / error) > 10


def test_without_the_cap_the_estimator_is_biased():
    """K~ < k b C and the paper's min(., 1): big records are under-sampled (negative control)."""
    grads, norms = _records(60, d=4, seed=8)
    n, b, clip, k = 60, 12, 1.0, 5.0
    clipped = np.minimum(norms, clip)
    k_tilde = float(clipped.sum())
    assert k_tilde < k * b * clip
    uncapped = k * np.maximum(clipped, 0.01)
    estimates, _, _ = _draw_many(
        grads, uncapped.astype(np.float32), k_tilde, float(n), b, clip, 20000, seed=9, capped=False
    )
    truth = (grads * (clipped / norms)[:, None]).mean(axis=0)
    error = estimates.std(axis=0) / math.sqrt(len(estimates))
    assert np.max(np.abs(estimates.mean(axis=0) - truth) / error) > 10


def test_sampler_realised_batch_size_averages_b():
    """Stage 1 (the sampler) then stage 2: about k b drawn, b accepted on average."""
    _, norms = _records(500, seed=10)
    b, clip, k = 20, 1.0, 5.0
    clipped = np.minimum(norms, clip)
    k_tilde = float(clipped.sum())
    ghat = isp.first_stage_bounds(clipped, k, 0.01, k_tilde, b).numpy()
    sampler = ImportanceSampler(500, b, steps_per_epoch=400, seed=11)
    sampler.start_epoch(
        k_tilde, ghat, population=500.0,
        expected_size=isp.released_first_stage_size(k, 0.01, k_tilde, 500.0, b),
    )
    # `epoch()`'s draws, from one traced `draw_tensors` (the graph path the
    # training pipeline runs) instead of 400 eager ones.
    draw_tensors = tf.function(sampler.draw_tensors)
    draws = [{key: value.numpy() for key, value in draw_tensors().items()}
             for _ in range(sampler.steps_per_epoch)]
    for draw in draws:
        assert len(draw["indices"]) == sampler.padded_size
    # Stage 2 is elementwise: one call over all the epoch's draws, row for row
    # what one call per draw gives.
    def joined(key):
        return np.concatenate([d[key] for d in draws])

    indices = joined("indices")
    stage = isp.second_stage(norms[indices] ** 2, joined("ghat"), clip, joined("uniform"), joined("mask"))
    accepted = stage["accepted"].numpy().reshape(len(draws), sampler.padded_size).sum(axis=1)
    drawn = [int(draw["mask"].sum()) for draw in draws]
    error = np.std(accepted) / math.sqrt(len(accepted))
    assert abs(np.mean(accepted) - b) < 4 * error
    assert np.mean(drawn) == pytest.approx(sampler.expected_stage1_size(), rel=0.02)
    assert np.mean(drawn) <= isp.released_first_stage_size(k, 0.01, k_tilde, 500.0, b)
    assert abs(np.mean(drawn) - b) > 20 * error  # stage 1 alone is ~k b, not b


SIZE_30 = {"expected_size": 30.0, "population": 300.0}


def test_sampler_never_truncates_and_is_reproducible():
    ghat = np.full(300, 0.1, np.float32)
    sampler = ImportanceSampler(300, 10, steps_per_epoch=3, seed=5)
    sampler.start_epoch(10.0, ghat, **SIZE_30)  # q = 0.1, ~30 drawn
    sampler.ghat_table.assign(np.full(300, 0.9, np.float32))  # grew: q = 0.9, ~270 drawn
    draw = sampler.draw()  # reads the table as it is now
    count = int(draw["mask"].sum())
    assert count > sampler.padded_size
    assert len(draw["indices"]) % sampler.padded_size == 0 and len(draw["indices"]) >= count
    assert sampler.overflow_count == 1
    again = ImportanceSampler(300, 10, steps_per_epoch=3, seed=5)
    again.start_epoch(10.0, np.full(300, 0.9, np.float32), **SIZE_30)
    drawn = draw["indices"][draw["mask"] == 1]
    replay = again.draw()
    np.testing.assert_array_equal(replay["indices"][replay["mask"] == 1], drawn)
    again.start_epoch(10.0, None, epoch_index=1, **SIZE_30)
    other = again.draw()
    assert not np.array_equal(other["indices"][other["mask"] == 1], drawn)


# -- accounting -------------------------------------------------------------------


def test_step_event_at_the_worst_case_k_is_dpsgd():
    n_tilde, clip, b, sigma = 1453.5, 0.1, 64, 1.7
    event = isp.step_event(sigma, clip, n_tilde * clip, n_tilde, b)
    dpsgd = accounting.dpsgd_event(sigma, b / n_tilde)
    assert event.sampling_probability == pytest.approx(dpsgd.sampling_probability, rel=1e-12)
    assert event.event.noise_multiplier == pytest.approx(sigma, rel=1e-12)
    ours = accounting.compute_epsilon(event.event.noise_multiplier, event.sampling_probability, 500, DELTA)
    theirs = accounting.compute_epsilon(sigma, b / n_tilde, 500, DELTA)
    assert ours == pytest.approx(theirs, rel=1e-9)
    # A smaller K~ (smaller gradients) costs less privacy at the same sigma_G.
    smaller = isp.step_event(sigma, clip, 0.3 * n_tilde * clip, n_tilde, b)
    cheaper = accounting.compute_epsilon(
        smaller.event.noise_multiplier, smaller.sampling_probability, 500, DELTA
    )
    assert cheaper < 0.9 * theirs


def test_step_event_refuses_k_below_b_c():
    with pytest.raises(ValueError, match="k_tilde"):
        isp.step_event(1.0, 1.0, 5.0, 100.0, 10)


def _simulate(k_tildes, epochs, epoch_divider, target=2.0, steps=20, b=16, n_tilde=800.0, clip=1.0):
    """Runs the budget allocation over epochs with the given K~ per epoch."""
    ledger = accounting.PrivacyLedger()
    ledger.record(isp.count_event(16.0))
    release = isp.norm_sum_event(5.0, b / n_tilde)
    sigmas = []
    for epoch, k_tilde in enumerate(k_tildes):
        ledger.record(release)
        worst = isp.uses_worst_case(epoch, epochs, epoch_divider)
        sigma, projected = isp.allocate_noise_multiplier(
            ledger, target, DELTA, batch_size=b, clip=clip, n_tilde=n_tilde, k_tilde=k_tilde,
            steps_per_epoch=steps, epochs_left=epochs - epoch,
            future_k_tilde=n_tilde * clip if worst else k_tilde, epoch_events=[release],
            max_noise_multiplier=sigmas[-1] if sigmas else None,
        )
        assert projected <= target
        ledger.begin_steps(isp.step_event(sigma, clip, k_tilde, n_tilde, b))
        ledger.advance(steps)
        sigmas.append(sigma)
    return sigmas, ledger.epsilon(DELTA)


def test_allocation_gives_non_increasing_sigma_when_k_falls():
    falling = list(np.linspace(800.0, 200.0, 8))
    sigmas, spent = _simulate(falling, epochs=8, epoch_divider=0.5)
    assert all(later <= earlier for earlier, later in zip(sigmas, sigmas[1:])), sigmas
    assert sigmas[-1] < 0.8 * sigmas[0]  # the second phase spends the saved budget
    assert spent <= 2.0
    # Negative control: K~ rising in the second phase forces sigma_G up.
    rising = falling[:4] + [200.0, 300.0, 450.0, 700.0]
    sigmas, spent = _simulate(rising, epochs=8, epoch_divider=0.5)
    assert any(later > earlier for earlier, later in zip(sigmas[4:], sigmas[5:])), sigmas
    assert spent <= 2.0


@pytest.mark.parametrize("seed", [0, 1])
def test_total_epsilon_never_exceeds_the_target(seed):
    rng = np.random.default_rng(seed)
    k_tildes = list(rng.uniform(17.0, 800.0, size=6))  # any path, rising or falling
    for divider in (0.0, 0.8):
        sigmas, spent = _simulate(k_tildes, epochs=6, epoch_divider=divider)
        assert spent <= 2.0
        assert spent >= 1.9  # and the budget is actually used, not wasted


def test_allocation_refuses_an_unreachable_target():
    ledger = accounting.PrivacyLedger()
    ledger.record(dp_accounting.GaussianDpEvent(0.5))  # already spends epsilon > 5
    with pytest.raises(ValueError, match="target_epsilon=1 cannot be met"):
        isp.allocate_noise_multiplier(
            ledger, 1.0, DELTA, batch_size=16, clip=1.0, n_tilde=800.0, k_tilde=400.0,
            steps_per_epoch=10, epochs_left=2,
        )


def test_allocation_projects_the_ledger_without_changing_it():
    ledger = accounting.PrivacyLedger()
    ledger.record(isp.count_event(16.0))
    before = ledger.to_json()
    sigma, projected = isp.allocate_noise_multiplier(
        ledger, 1.0, DELTA, batch_size=16, clip=1.0, n_tilde=800.0, k_tilde=800.0,
        steps_per_epoch=50, epochs_left=1,
    )
    assert ledger.to_json() == before
    ledger.begin_steps(accounting.dpsgd_event(sigma, 16 / 800.0))
    ledger.advance(50)
    assert ledger.epsilon(DELTA) == pytest.approx(projected, rel=1e-9)
    assert 0.995 <= projected <= 1.0


def test_second_stage_clips_to_the_smaller_of_ghat_and_c():
    """clipped_norms (which refresh ghat for the next step) are
    min(||g_i||, ghat_i, C): rows where ghat < C are clipped to ghat, not C."""
    norms = np.array([0.5, 3.0, 3.0, 0.2, 5.0], np.float32)
    ghat = np.array([2.0, 2.0, 0.8, 0.8, 10.0], np.float32)
    clip = 1.5
    stage = isp.second_stage(norms**2, ghat, clip, np.zeros(5, np.float32), np.ones(5, np.float32))
    np.testing.assert_allclose(stage["clipped_norms"].numpy(), [0.5, 1.5, 0.8, 0.2, 1.5], rtol=1e-5)
    np.testing.assert_allclose(stage["probability"].numpy(), [0.25, 0.75, 1.0, 0.25, 0.15], rtol=1e-5)
