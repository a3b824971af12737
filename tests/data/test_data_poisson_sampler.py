"""PoissonSampler: the draws are Poisson sampling, padded without truncation.

Statistical tests use fixed seeds and a negative control that the same check
must reject.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfdp.data import PoissonSampler, poisson, sampling

N, B = 500, 25  # q = 0.05
DRAWS = 20000


def binomial_pmf(n, q):
    k = np.arange(n + 1, dtype=np.float64)
    lg = np.vectorize(math.lgamma)
    return np.exp(
        lg(n + 1.0) - lg(k + 1.0) - lg(n - k + 1.0) + k * math.log(q) + (n - k) * math.log1p(-q)
    )


def chi_square_pvalue(statistic, dof):
    """Upper tail of chi-square(dof), Wilson-Hilferty normal approximation."""
    z = ((statistic / dof) ** (1.0 / 3.0) - (1.0 - 2.0 / (9.0 * dof))) / math.sqrt(
        2.0 / (9.0 * dof)
    )
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def binomial_gof(sizes, n, q):
    """(chi-square p-value, KS distance, KS 0.1% critical value) vs Binomial(n, q)."""
    sizes = np.asarray(sizes)
    pmf = binomial_pmf(n, q)
    expected = pmf * len(sizes)
    observed = np.bincount(sizes, minlength=n + 1).astype(np.float64)
    # Merge cells so that every cell expects >= 5: collapse both tails.
    cells_obs, cells_exp = [], []
    acc_o = acc_e = 0.0
    for o, e in zip(observed, expected):
        acc_o += o
        acc_e += e
        if acc_e >= 5.0:
            cells_obs.append(acc_o)
            cells_exp.append(acc_e)
            acc_o = acc_e = 0.0
    cells_obs[-1] += acc_o
    cells_exp[-1] += acc_e
    cells_obs, cells_exp = np.array(cells_obs), np.array(cells_exp)
    statistic = float(((cells_obs - cells_exp) ** 2 / cells_exp).sum())
    pvalue = chi_square_pvalue(statistic, len(cells_obs) - 1)
    ks = float(np.abs(np.cumsum(observed) / len(sizes) - np.cumsum(pmf)).max())
    return pvalue, ks, 1.95 / math.sqrt(len(sizes))


def _per_step(sampler, draws, statistic, width):
    """`statistic(draw)` of steps 0..draws-1, drawn by `sampler.draw` in one
    compiled loop (about 20 times faster than iterating a dataset)."""

    @tf.function
    def run(key):
        values = tf.TensorArray(tf.float32, size=draws)
        for step in tf.range(draws, dtype=tf.int64):
            values = values.write(tf.cast(step, tf.int32), statistic(sampler.draw(key, step)))
        return values.stack()

    return run(sampling.fold_key(sampler.key, 0)).numpy().reshape(draws, width)


def indicator_matrix(sampler, draws):
    """[draws, N] 0/1 matrix of the first `draws` steps' draws."""
    n = sampler.num_examples

    def indicators(draw):
        real = tf.boolean_mask(draw["indices"], draw["mask"] > 0)
        return tf.scatter_nd(real[:, None], tf.ones_like(real, tf.float32), [n])

    return _per_step(sampler, draws, indicators, n).astype(np.float64)


def poisson_sizes(sampler, draws):
    sizes = _per_step(sampler, draws, lambda draw: tf.reduce_sum(draw["mask"]), 1)
    return sizes[:, 0].astype(np.int64)


def pipeline_sizes(sampler, draws):
    """Batch sizes of the first `draws` steps of the input pipeline `fit`
    uses (`tfdp.data.sampling.draws`)."""
    sizes = sampling.draws(sampler, sampler.key, 0, steps=draws).map(
        lambda draw: tf.reduce_sum(draw["mask"])).batch(1000)
    return np.concatenate([b.numpy() for b in sizes]).astype(np.int64)


class FixedSizeShuffle:
    """Negative control in the graph: a uniformly random subset of exactly b
    records (shuffle, take b), drawn through the same pipeline."""

    def __init__(self, num_examples, batch_size, seed):
        self.num_examples, self.batch_size = num_examples, batch_size
        self.key = sampling.sampling_key(seed)

    def draw(self, key, step):
        order = tf.random.experimental.stateless_shuffle(
            tf.range(self.num_examples, dtype=tf.int64), seed=sampling.fold_key(key, step))
        return sampling.padded_draw(order[: self.batch_size], self.batch_size)


@pytest.fixture(scope="module")
def sizes():
    return poisson_sizes(PoissonSampler(N, B, seed=1234), DRAWS)


def test_size_mean_and_variance(sizes):
    q = B / N
    mean_sd = math.sqrt(N * q * (1 - q) / DRAWS)
    assert abs(sizes.mean() - N * q) < 5 * mean_sd
    var = N * q * (1 - q)
    var_sd = var * math.sqrt(2.0 / DRAWS)
    assert abs(sizes.var(ddof=1) - var) < 5 * var_sd


def test_size_distribution_is_binomial(sizes):
    pvalue, ks, ks_critical = binomial_gof(sizes, N, B / N)
    assert pvalue > 1e-3
    assert ks < ks_critical


def test_input_pipeline_draws_binomial_sizes():
    """The same law through the dataset `fit` iterates (its own step keys)."""
    sizes = pipeline_sizes(PoissonSampler(N, B, seed=77), 3000)
    pvalue, ks, ks_critical = binomial_gof(sizes, N, B / N)
    assert pvalue > 1e-3 and ks < ks_critical
    doubled = pipeline_sizes(PoissonSampler(N, 2 * B, seed=77), 3000)  # negative control
    assert binomial_gof(doubled, N, B / N)[0] < 1e-9


def test_negative_control_fixed_size_sampler_is_rejected():
    sizes = poisson_sizes(FixedSizeShuffle(N, B, seed=1234), DRAWS // 4)
    assert np.all(sizes == B)
    pvalue, ks, ks_critical = binomial_gof(sizes, N, B / N)
    assert pvalue < 1e-9
    assert ks > ks_critical
    assert sizes.var() < 0.5 * N * (B / N) * (1 - B / N)
    # Its per-record rates are right: only the size law tells it apart.
    assert inclusion_is_uniform(indicator_matrix(FixedSizeShuffle(50, 5, seed=7), 40000), 0.1)


def test_negative_control_doubled_q_is_rejected():
    sizes = poisson_sizes(PoissonSampler(N, 2 * B, seed=1234), DRAWS // 4)
    pvalue, ks, ks_critical = binomial_gof(sizes, N, B / N)
    assert pvalue < 1e-9
    assert ks > ks_critical


def numpy_indicator_matrix(sampler, draws):
    x = np.zeros((draws, sampler.num_examples), dtype=np.float64)
    for t in range(draws):
        x[t, sampler.sample_indices()] = 1.0
    return x


class FavouringSampler:
    """Negative control: Poisson sampling that includes record 0 with 1.2 q."""

    def __init__(self, num_examples, batch_size, seed):
        self.num_examples, self.q = num_examples, batch_size / num_examples
        self.rng = np.random.default_rng(seed)

    def sample_indices(self):
        q = np.full(self.num_examples, self.q)
        q[0] *= 1.2
        return np.flatnonzero(self.rng.random(self.num_examples) < q)


class StickySampler(FavouringSampler):
    """Negative control: right marginals, but repeats the last draw 30% of the time."""

    last = None

    def sample_indices(self):
        if self.last is None or self.rng.random() >= 0.3:
            self.last = np.flatnonzero(self.rng.random(self.num_examples) < self.q)
        return self.last


class PairedSampler(FavouringSampler):
    """Negative control: right marginals, but record 2k+1 comes with record 2k."""

    def sample_indices(self):
        pairs = np.flatnonzero(self.rng.random(self.num_examples // 2) < self.q)
        return np.sort(np.concatenate([2 * pairs, 2 * pairs + 1]))


def inclusion_is_uniform(x, q):
    """Every record's inclusion count is Binomial(draws, q) (z within 4.5, chi-square)."""
    draws, n = x.shape
    z = (x.sum(axis=0) - draws * q) / math.sqrt(draws * q * (1 - q))
    return bool(np.abs(z).max() < 4.5 and chi_square_pvalue(float((z**2).sum()), n) > 1e-3)


def across_steps_independent(x, q):
    """Batch sizes and per-record indicators are uncorrelated from one step to the next."""
    draws, n = x.shape
    sizes = x.sum(axis=1)
    r_sizes = np.corrcoef(sizes[:-1], sizes[1:])[0, 1]
    centred = x - q
    lag1 = (centred[:-1] * centred[1:]).mean() / (q * (1 - q))
    return bool(abs(r_sizes) < 4 / math.sqrt(draws) and abs(lag1) < 4 / math.sqrt(draws * n))


def within_step_independent(x, q):
    """Records of one step are included independently (neighbours and every pair)."""
    draws, n = x.shape
    both = (x[:, :-1] * x[:, 1:]).mean()
    corr = np.corrcoef(x.T)
    off_diagonal = corr[~np.eye(n, dtype=bool)]
    return bool(abs(both - q * q) < 6 * math.sqrt(q * q / (draws * (n - 1)))
                and np.abs(off_diagonal).max() < 5.5 / math.sqrt(draws))


def test_every_record_included_with_probability_q():
    n, b, draws = 50, 5, 40000
    assert inclusion_is_uniform(indicator_matrix(PoissonSampler(n, b, seed=7), draws), b / n)
    # Negative control: a sampler that favours record 0 by 20% is caught.
    assert not inclusion_is_uniform(numpy_indicator_matrix(FavouringSampler(n, b, seed=7), draws), b / n)


@pytest.fixture(scope="module")
def independence_draws():
    return indicator_matrix(PoissonSampler(100, 10, seed=11), 20000)


def test_draws_independent_across_steps_and_records(independence_draws):
    assert across_steps_independent(independence_draws, 0.1)
    assert within_step_independent(independence_draws, 0.1)


@pytest.mark.parametrize("sampler, across, within", [(StickySampler, False, True), (PairedSampler, True, False)])
def test_negative_control_dependent_samplers_are_caught(sampler, across, within):
    """Samplers with the right inclusion probability but dependent draws."""
    x = numpy_indicator_matrix(sampler(100, 10, seed=11), 20000)
    assert across_steps_independent(x, 0.1) == across
    assert within_step_independent(x, 0.1) == within


def test_chunked_walk_is_still_poisson(monkeypatch):
    """A walk that needs several chunks of gaps (forced: chunks of 4 gaps,
    about 7 of them a draw) draws the same law: sizes Binomial(N, q), every
    record at q, independent records."""
    monkeypatch.setattr(sampling, "chunk_size", lambda expected: 4)
    monkeypatch.setattr(poisson, "_TRACED_DRAWS", {})  # retrace with the small chunks
    sizes = poisson_sizes(PoissonSampler(N, B, seed=99), DRAWS // 4)
    pvalue, ks, ks_critical = binomial_gof(sizes, N, B / N)
    assert pvalue > 1e-3 and ks < ks_critical
    x = indicator_matrix(PoissonSampler(100, 10, seed=8), 20000)
    assert inclusion_is_uniform(x, 0.1) and within_step_independent(x, 0.1)


def draw_numpy(sampler, step, key=None):
    draw = sampler.draw(sampler.key if key is None else key, step)
    return draw["indices"].numpy(), draw["mask"].numpy()


def test_draw_shapes_and_padding():
    sampler = PoissonSampler(1000, 50, seed=0)
    for step in range(20):
        indices, mask = draw_numpy(sampler, step)
        assert indices.dtype == np.int64 and mask.dtype == np.float32
        assert len(indices) == len(mask) == sampler.padded_size
        count = int(mask.sum())
        assert np.all(mask[:count] == 1) and np.all(mask[count:] == 0)
        assert np.all(indices[count:] == 0)
        real = indices[:count]
        assert np.all(np.diff(real) > 0)  # sorted, distinct
        assert real.min(initial=0) >= 0 and real.max(initial=0) < 1000


def test_default_steps_per_epoch():
    assert PoissonSampler(1000, 50).steps_per_epoch == 20
    assert PoissonSampler(1797, 64).steps_per_epoch == 28
    assert PoissonSampler(10, 10).steps_per_epoch == 1
    assert PoissonSampler(1000, 50, steps_per_epoch=3).steps_per_epoch == 3
    sampler = PoissonSampler(60000, 256)
    assert sampler.sampling_probability == 256 / 60000
    assert sampler.padded_size == 336  # default overflow probability 1e-6


def test_full_sampling_includes_everything():
    sampler = PoissonSampler(13, 13, seed=0)
    for step in range(3):
        indices, mask = draw_numpy(sampler, step)
        assert list(indices[mask == 1]) == list(range(13))
    assert list(draw_numpy(PoissonSampler(1, 1), 0)[0]) == [0] * 8


def test_oversized_draw_is_never_truncated():
    sampler = PoissonSampler(1000, 50, seed=0)
    forced = np.random.default_rng(0).permutation(1000)[: 2 * sampler.padded_size + 3]
    draw = sampler.pad(tf.constant(forced))
    indices, mask = draw["indices"].numpy(), draw["mask"].numpy()
    assert len(indices) == 3 * sampler.padded_size
    np.testing.assert_array_equal(indices[mask == 1], forced)
    assert mask.sum() == len(forced)
    unfixed = PoissonSampler(1000, 50, multiple=8, fixed_shape=False)
    for count, length in [(0, 8), (1, 8), (8, 8), (9, 16), (500, 504)]:
        assert len(unfixed.pad(tf.range(count))["mask"]) == length


def test_natural_overflows_are_padded_not_truncated():
    # overflow_probability=0.5 makes roughly half the draws overflow.
    sampler = PoissonSampler(400, 40, seed=3, overflow_probability=0.5, multiple=1)
    overflowed = 0
    for step in range(200):
        drawn = sampler.sample_indices(sampler.key, step).numpy()
        indices, mask = draw_numpy(sampler, step)
        assert len(indices) % sampler.padded_size == 0
        assert len(indices) >= len(drawn)
        np.testing.assert_array_equal(indices[mask == 1], drawn)
        overflowed += len(drawn) > sampler.padded_size
    assert overflowed > 20


def test_empty_draw_is_a_valid_step():
    sampler = PoissonSampler(1000, 1, seed=0)
    draw = sampler.pad(tf.zeros([0], tf.int64))
    indices, mask = draw["indices"].numpy(), draw["mask"].numpy()
    assert len(indices) == sampler.padded_size
    assert mask.sum() == 0 and np.all(indices == 0)


def test_empty_draws_occur_naturally():
    sampler = PoissonSampler(1000, 1, seed=0)  # P(empty) ~ 0.37
    sizes = poisson_sizes(sampler, 200)
    assert (sizes == 0).sum() > 30


def test_a_draw_is_a_function_of_key_and_step():
    a, b = PoissonSampler(60000, 256, seed=42), PoissonSampler(60000, 256, seed=42)
    for step in (0, 1, 10**12):
        np.testing.assert_array_equal(draw_numpy(a, step)[0], draw_numpy(b, step)[0])
    assert not np.array_equal(draw_numpy(a, 0)[0], draw_numpy(a, 1)[0])
    c = PoissonSampler(60000, 256, seed=43)
    assert not np.array_equal(draw_numpy(a, 0)[0], draw_numpy(c, 0)[0])


def test_seed_none_keys_from_os_entropy():
    a, b = PoissonSampler(60000, 256), PoissonSampler(60000, 256)
    assert not np.array_equal(a.key, b.key)
    assert not np.array_equal(draw_numpy(a, 0)[0], draw_numpy(b, 0)[0])


@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        ((0, 1), {}, ValueError, "num_examples"),
        ((10.0, 1), {}, TypeError, "num_examples"),
        ((10, 0), {}, ValueError, "expected_batch_size"),
        ((10, 11), {}, ValueError,
         r"expected_batch_size.*\(10\).*Received: expected_batch_size=11"),
        ((10, "5"), {}, TypeError, "expected_batch_size"),
        ((10, 5), {"steps_per_epoch": 0}, ValueError, "steps_per_epoch"),
        ((10, 5), {"steps_per_epoch": 2.5}, ValueError, "steps_per_epoch"),
        ((10, 5), {"seed": "abc"}, TypeError, "seed"),
        ((10, 5), {"seed": -1}, TypeError, "seed"),
    ],
)
def test_validation(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        PoissonSampler(*args, **kwargs)
