"""The vectorised Box-Muller generator draws N(0, 1): moments, KS, tails."""

import math
import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tfdp
from tfdp.mechanisms import gaussian
from tfdp.mechanisms.gaussian import normals, numpy_normal, standard_normal

SEED = tf.constant([11, 3], tf.int64)


def test_draws_are_standard_normal_with_a_negative_control():
    z = standard_normal([1_000_001], SEED).numpy()  # odd size: the last pair is cut
    assert z.shape == (1_000_001,) and np.all(np.isfinite(z))
    # Sampling sd of the mean ~0.001, of the variance ~0.0014: 5-6 sigma margins.
    assert abs(z.mean()) < 0.006 and abs(z.var() - 1) < 0.008
    assert abs(stats.kurtosis(z)) < 0.03
    assert stats.kstest(z, "norm").pvalue > 1e-4
    # Tails: P(|z| > 4) = 6.3e-5, about 63 draws; the 1/1000 quantiles too.
    assert 30 < np.sum(np.abs(z) > 4) < 100
    # Negative control: the radius without its square root is not Gaussian.
    u = tf.random.stateless_uniform([2, 500_000], seed=SEED).numpy()
    wrong = -2 * np.log1p(-u[0]) * np.cos(2 * np.pi * u[1])
    assert stats.kstest(wrong / wrong.std(), "norm").pvalue < 1e-10


def test_halves_are_independent_and_seeds_give_fresh_streams():
    z = standard_normal([400_000], SEED).numpy()
    cos_half, sin_half = z[:200_000], z[200_000:]
    assert abs(np.corrcoef(cos_half, sin_half)[0, 1]) < 0.01  # sd ~0.0022
    assert abs(np.corrcoef(cos_half**2, sin_half**2)[0, 1]) < 0.01
    other = standard_normal([400_000], SEED + 1).numpy()
    assert abs(np.corrcoef(z, other)[0, 1]) < 0.01
    np.testing.assert_array_equal(z, standard_normal([400_000], SEED).numpy())


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.bfloat16])
def test_shape_and_dtype(dtype):
    z = standard_normal(tf.constant([3, 5, 2]), SEED, dtype=dtype)
    assert z.shape == (3, 5, 2) and z.dtype == dtype


# -- the tail: no cap ---------------------------------------------------------

# A float32 uniform is a multiple of 2^-23, so Box-Muller on float32 uniforms
# never exceeds this radius (the generator tfdp used before issue 34).
FLOAT32_CAP = math.sqrt(2 * 23 * math.log(2))  # 5.6467


def float32_box_muller(count, seed):
    """The float32-uniform Box-Muller transform: the negative control."""
    u = tf.random.stateless_uniform([2, count // 2], seed=seed)
    radius = tf.sqrt(-2.0 * tf.math.log1p(-u[0]))
    angle = 2.0 * math.pi * u[1]
    return tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], 0)


def radii_beyond(generate, cap, chunks=8, size=2**24):
    """How many of chunks * size / 2 pairs have a radius above `cap`."""
    draw = tf.function(generate)
    beyond = 0
    for chunk in range(chunks):
        z = draw(size, tf.constant([29, chunk], tf.int64)).numpy()
        radius_sq = z[: size // 2].astype(np.float64) ** 2 + z[size // 2 :].astype(np.float64) ** 2
        beyond += int(np.sum(radius_sq > cap**2))
    return beyond


def test_tail_goes_past_the_float32_cap_with_a_negative_control():
    # 2^26 pairs; P(radius > 5.6467) = 2^-23 a pair: 8 expected (P(none) = 3e-4).
    # The margin 1e-4 covers float32 rounding of the capped radii.
    beyond = radii_beyond(lambda n, seed: standard_normal([n], seed), FLOAT32_CAP + 1e-4)
    assert 1 <= beyond <= 24, beyond
    # Negative control: the float32-uniform generator never gets there.
    assert radii_beyond(float32_box_muller, FLOAT32_CAP + 1e-4) == 0


class ZeroWords:
    """Replaces `levels` rounds of radius words by 0 (the deepest cell, w0 = 0),
    then lets the real words through: crafted randomness for the deep tail."""

    def __init__(self, levels):
        self.levels, self.calls = levels, 0

    def __call__(self, shape, seed):
        words = gaussian._REAL_WORDS(shape, seed)
        self.calls += 1
        if self.calls > self.levels:
            return words
        if self.calls == 1:  # the first draw: [2, half], w0 in row 0
            return tf.concat([tf.zeros_like(words[:1]), words[1:]], 0)
        return tf.zeros_like(words)


@pytest.mark.parametrize("levels", [1, 2])
def test_deep_tail_is_exponential_beyond_each_cell(monkeypatch, levels):
    # Every w0 = 0: the radius must be sqrt(2 (32 ln 2 * levels + Exp(1))).
    monkeypatch.setenv("TFDP_NOISE_KERNEL", "graph")  # crafted words reach the graph only
    monkeypatch.setattr(gaussian, "_REAL_WORDS", gaussian._words, raising=False)
    monkeypatch.setattr(gaussian, "_words", ZeroWords(levels))
    z = standard_normal([200_000], SEED).numpy().astype(np.float64)
    half_sq = (z[:100_000] ** 2 + z[100_000:] ** 2) / 2
    excess = half_sq - 32 * math.log(2) * levels
    assert excess.min() > -1e-3
    # float32 radii of ~7 carry ~1e-6 relative error: loose enough for KS.
    assert stats.kstest(excess, "expon").pvalue > 1e-4
    angle = np.arctan2(z[100_000:], z[:100_000])
    assert stats.kstest(angle, "uniform", args=(-np.pi, 2 * np.pi)).pvalue > 1e-4
    # Negative control: the float32 generator given its deepest cell stops at its cap.
    deepest = tf.fill([2, 1000], np.float32(1 - 2**-23))
    capped = tf.sqrt(-2.0 * tf.math.log1p(-deepest[0])).numpy().astype(np.float64)
    capped_excess = capped**2 / 2 - 23 * math.log(2)
    assert stats.kstest(capped_excess, "expon").pvalue < 1e-10


def test_numpy_normal_moments_ks_and_tail():
    rng = np.random.default_rng(5)
    z = numpy_normal(rng, size=1_000_000)
    assert abs(z.mean()) < 0.006 and abs(z.var() - 1) < 0.008
    assert abs(stats.kurtosis(z)) < 0.03
    assert stats.kstest(z, "norm").pvalue > 1e-4
    assert 30 < np.sum(np.abs(z) > 4) < 100
    assert isinstance(numpy_normal(rng, 2.0), float)
    assert numpy_normal(rng, 1.0, size=(2, 3)).shape == (2, 3)


class ZeroFirstIntegers:
    """A NumPy Generator whose first radius words are all 0 (deepest cell)."""

    def __init__(self, seed):
        self.rng, self.calls = np.random.default_rng(seed), 0

    def integers(self, low, high, size, dtype):
        words = self.rng.integers(low, high, size=size, dtype=dtype)
        self.calls += 1
        if self.calls == 1:
            words[0] = 0
        return words


def test_numpy_normal_deep_tail_is_exponential():
    z = numpy_normal(ZeroFirstIntegers(6), size=200_000)
    excess = (z[:100_000] ** 2 + z[100_000:] ** 2) / 2 - 32 * math.log(2)
    assert excess.min() > -1e-9
    assert stats.kstest(excess, "expon").pvalue > 1e-4


def test_every_gaussian_draw_in_tfdp_goes_through_the_uncapped_generator():
    """The noise-tail bound (0 extra delta) holds only if no privacy noise is
    drawn elsewhere: NumPy's normal caps at 13.7, TensorFlow's at 5.68.
    tfdp.auditing is left out: its draws build attack records (random
    directions), they protect nothing."""
    root = pathlib.Path(tfdp.__file__).parent
    draws = re.compile(
        r"\.(normal|standard_normal|stateless_normal|truncated_normal)\(|random\.normal"
    )
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "gaussian.py" and path.parent.name == "mechanisms":
            continue
        if path.parent.name == "auditing":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if draws.search(code) and ">>>" not in code and "..." not in code[:8]:
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_small_tensors_share_a_draw_and_stay_independent():
    """Tensors of at most 2^16 entries are cut from one draw: each is still
    N(0, 1), and no two share entries."""
    shapes = [[300, 100], [17], [], [0], [2**16], [2**16 + 1]]
    seeds = [tf.constant([4, i], tf.int64) for i in range(len(shapes))]
    z = normals(shapes, seeds, [tf.float32] * len(shapes))
    assert [t.shape.as_list() for t in z] == shapes
    flat = np.concatenate([t.numpy().ravel() for t in z])
    assert stats.kstest(flat, "norm").pvalue > 1e-4
    assert np.intersect1d(z[1].numpy(), z[0].numpy()).size == 0  # no entry reused
    assert abs(np.corrcoef(z[0].numpy().ravel()[:2**14], z[4].numpy()[:2**14])[0, 1]) < 0.03


# -- no atom: the top words and the small-radius law (issue 43, item 6) -------

# Radius words w0 at both ends of the range (0: the deepest cell) and angle
# words w1 where a coarse angle lands on 0, pi / 2, pi, 3 pi / 2 or 2 pi.
TOP = 2**32
W0 = [TOP - 1, TOP - 2, TOP - 128, TOP - 129, TOP - 256, TOP - 2**20, 2**31, 1, 2, 0]
W1 = [0, 1, 2**30, 2**31, 3 * 2**30, TOP - 1, TOP - 128, 2**29, 7, TOP - 2**20]


class CraftedWords:
    """The first draw's words are W0 (radius) and W1 (angle); later rounds
    (the deep tail of w0 = 0) take the real words."""

    def __init__(self):
        self.calls = 0

    def __call__(self, shape, seed):
        self.calls += 1
        if self.calls > 1:
            return gaussian._REAL_WORDS(shape, seed)
        return tf.constant([W0, W1], tf.uint32)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.bfloat16])
def test_top_radius_words_give_no_zero_draw(monkeypatch, dtype):
    """w0 = 2^32 - k must give E = -ln(1 - k 2^-32) > 0, not a float32
    uniform rounded to 1.0 (radius 0, both draws exactly 0.0: an atom of
    2^-25 a pair); no angle word makes a draw exactly 0 either."""
    monkeypatch.setenv("TFDP_NOISE_KERNEL", "graph")  # crafted words reach the graph only
    monkeypatch.setattr(gaussian, "_REAL_WORDS", gaussian._words, raising=False)
    monkeypatch.setattr(gaussian, "_words", CraftedWords())
    z = standard_normal([2 * len(W0)], SEED, dtype=dtype).numpy().astype(np.float64)
    cos_part, sin_part = z[: len(W0)], z[len(W0) :]
    assert np.all(cos_part != 0.0) and np.all(sin_part != 0.0), z
    radius = np.sqrt(cos_part**2 + sin_part**2)
    words = np.asarray(W0[:-1], np.float64)  # the last one went to the deep tail
    expected = np.sqrt(-2.0 * np.log(words / TOP))
    rtol = 1e-2 if dtype == tf.bfloat16 else 1e-5
    np.testing.assert_allclose(radius[:-1], expected, rtol=rtol)
    assert radius[-1] ** 2 / 2 > 32 * math.log(2) * (1 - 1e-2)
    expected_angle = (np.asarray(W1, np.float64) + 0.5) * 2 * np.pi / TOP
    off = np.arctan2(sin_part, cos_part) - expected_angle
    off = (off + np.pi) % (2 * np.pi) - np.pi  # an angle just below 2 pi may wrap to 0
    # Angle words above 2^24 carry float32 rounding of the word (2^-24 relative).
    rtol = 1e-2 if dtype == tf.bfloat16 else 1e-6
    assert np.all(np.abs(off) <= rtol * expected_angle), off


def test_numpy_normal_top_words_give_no_zero_draw():
    class Crafted:
        def integers(self, low, high, size, dtype):
            return np.asarray([W0[:-1], W1[:-1]], dtype)

    z = numpy_normal(Crafted(), size=2 * (len(W0) - 1))
    cos_part, sin_part = z[: len(W0) - 1], z[len(W0) - 1 :]
    assert np.all(cos_part != 0.0) and np.all(sin_part != 0.0), z
    radius = np.sqrt(cos_part**2 + sin_part**2)
    np.testing.assert_allclose(radius, np.sqrt(-2 * np.log(np.asarray(W0[:-1]) / TOP)), rtol=1e-9)


SMALL_RADII = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1]


def small_radius_counts(chunks=4, size=2**24):
    """How many of chunks * size / 2 pairs have a radius <= each of SMALL_RADII."""
    draw = tf.function(lambda seed: standard_normal([size], seed))
    counts = np.zeros(len(SMALL_RADII), np.int64)
    for chunk in range(chunks):
        z = draw(tf.constant([31, chunk], tf.int64)).numpy().astype(np.float64)
        radius_sq = z[: size // 2] ** 2 + z[size // 2 :] ** 2
        counts += [int(np.sum(radius_sq <= r**2)) for r in SMALL_RADII]
    return counts, chunks * size // 2


def law_holds(counts, pairs, scale):
    """Each count within 5 binomial sds of P(R <= r) = 1 - exp(-r^2 / (2 scale^2))."""
    p = -np.expm1(-np.square(SMALL_RADII) / (2 * scale**2))
    expected = pairs * p
    return bool(np.all(np.abs(counts - expected) <= 5 * np.sqrt(expected * (1 - p)) + 1))


def test_small_radius_law_near_zero_with_a_negative_control():
    # 2^25 pairs: about 17 radii below 1e-3, 1,700 below 1e-2, 168,000 below 0.1.
    counts, pairs = small_radius_counts()
    assert law_holds(counts, pairs, 1.0), counts
    # Negative control: the same counts fail the law of a 5% larger or smaller scale.
    assert not law_holds(counts, pairs, 1.05) and not law_holds(counts, pairs, 0.95)
