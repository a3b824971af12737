"""The compiled noise kernel draws the graph generator's values bit for bit,
and the graph generator runs, named, wherever the kernel cannot."""

import contextlib
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.mechanisms import dpsgd, gaussian, native_noise
from tfdp.mechanisms.native import build

DTYPES = [tf.float32, tf.float64, tf.bfloat16, tf.float16]
# Scalar, one, sizes around the packets (4 doubles, 8 floats, 16 lanes),
# a dynamic shape, and a large tensor sharded over threads.
SHAPES = [[], [1], [2], [3], [7, 3], [9], [15], [16], [17], [33], [1031], [2**16 + 1],
          [1000, 1031]]


@contextlib.contextmanager
def graph_generator():
    """The graph generator forced, as TFDP_NOISE_KERNEL=graph does."""
    before = os.environ.get(build.ENV_SWITCH)
    os.environ[build.ENV_SWITCH] = "graph"
    try:
        yield
    finally:
        if before is None:
            del os.environ[build.ENV_SWITCH]
        else:
            os.environ[build.ENV_SWITCH] = before


@pytest.fixture(scope="module")
def library():
    """The compiled op (built on first use); CI must have it."""
    ops = native_noise._load()
    if ops.library is None:
        message = f"the noise kernel is unavailable here: {ops.reason}"
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    return ops.library


def bits(tensor):
    return tensor.numpy().view(f"u{tensor.dtype.size}")


def both_paths(make):
    """(graph generator's tensors, kernel's tensors): `make()` builds and runs
    a fresh tf.function on each path (a trace keeps the path it was traced on)."""
    with graph_generator():
        reference = make()
    return reference, make()


def assert_same_bits(reference, kernel):
    assert len(reference) == len(kernel)
    for ref, got in zip(reference, kernel):
        assert ref.dtype == got.dtype and ref.shape == got.shape
        np.testing.assert_array_equal(bits(ref), bits(got))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_draws_the_graph_values_bit_for_bit(library, dtype):
    shapes = SHAPES + [tf.constant([5, 13])]
    seeds = [tf.constant([41, i], tf.int64) for i in range(len(shapes))]
    stddev = tf.constant(0.7, tf.float64 if dtype == tf.float64 else tf.float32)
    factor = gaussian._radius_factor(stddev, gaussian._work_dtype(dtype))
    plan = [(shape, i, dtype, [i]) for i, shape in enumerate(shapes)]  # a draw each
    reference = gaussian._graph_draws(plan, seeds, stddev)  # eager: tracing 14 draws is slow
    kernel = [native_noise.draw(library, shape, seed, dtype, factor)[0]
              for shape, seed in zip(shapes, seeds)]
    assert_same_bits(reference, kernel)
    # End to end in a tf.function, as the train step runs: small tensors share a draw.
    assert_same_bits(*both_paths(lambda: tf.function(lambda: gaussian.normals(
        SHAPES[:-1], seeds[:len(SHAPES) - 1], [dtype] * (len(SHAPES) - 1), stddev))()))


def runnable_isas():
    """The instruction sets of the op's loops this CPU runs (x86: from /proc/cpuinfo)."""
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return ["portable"] + [isa for isa in ("avx2", "avx512f") if isa in flags]


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_every_instruction_set_draws_the_same_bits(library, dtype):
    """The portable loops and the AVX2 and AVX-512 ones (where this CPU runs
    them) all give the graph's values: CI machines may pick any of them."""
    sizes = [1, 9, 33, 1031, 70001]
    seeds = [tf.constant([17, n], tf.int64) for n in sizes]
    factor = gaussian._radius_factor(1.0, gaussian._work_dtype(dtype))
    reference = gaussian._graph_draws([([n], i, dtype, [i]) for i, n in enumerate(sizes)], seeds, 1.0)
    for isa in runnable_isas():
        drawn = [library.tfdp_gaussian_noise(tf.constant([n]), seed, tf.cast(factor, tf.float64),
                                             dtype=dtype, isa=isa)[0]
                 for n, seed in zip(sizes, seeds)]
        assert_same_bits(reference, drawn)


def test_kernel_matches_eagerly_too(library):
    seed = tf.constant([5, 6], tf.int64)
    assert_same_bits(*both_paths(lambda: gaussian.normals(
        [[3], [4099], [70001]], [seed, seed + 1, seed + 2],
        [tf.float32, tf.float64, tf.bfloat16], stddev=2.5)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_equals_graph_noise_plus_sum(library, dtype):
    """(sum + noise) / b in one pass: the graph's noise, sum and division."""
    rng = np.random.default_rng(3)
    tensors = [tf.cast(rng.normal(size=shape) * 3, dtype)
               for shape in ([1031, 3], [17], [5], [], [70001])]
    seeds = [tf.constant([8, i], tf.int64) for i in range(len(tensors))]
    divisor = tf.constant(96.0)

    def make():
        return tf.function(lambda: gaussian.add_normals(tensors, seeds, tf.constant(1.3), divisor))()

    with graph_generator():
        noise = tf.function(lambda: gaussian.normals(
            [t.shape for t in tensors], seeds, [dtype] * len(tensors), tf.constant(1.3)))()
        by_hand = [(t + n) / tf.cast(divisor, dtype) for t, n in zip(tensors, noise)]
    reference, kernel = both_paths(make)
    assert_same_bits(by_hand, reference)
    assert_same_bits(reference, kernel)


# Seeds (s, 0x5EED) whose draw of 128 entries has a crafted radius word w0 at
# pair `index` (found by a search over Philox words, checked below):
DEEPEST = (120033045, 54, 0)           # w0 = 0: the deep tail (refinement rounds)
TOP = (125617881, 55, 2**32 - 1)       # the top word: radius ~2^-15, not 0 (no atom)
LARGEST = (14727552, 22, 1)            # w0 = 1: radius sqrt(64 ln 2) = 6.66


@pytest.mark.parametrize("crafted", [DEEPEST, TOP, LARGEST], ids=["deepest", "top", "largest"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_crafted_words_give_the_graph_values(library, crafted, dtype):
    key, index, word = crafted
    seed = tf.constant([key, 0x5EED], tf.int64)
    assert int(gaussian._words([2, 64], seed)[0, index]) == word  # the crafted word is there
    factor = gaussian._radius_factor(1.0, gaussian._work_dtype(dtype))
    _, deep = native_noise.draw(library, [128], seed, dtype, factor)
    assert bool(deep) == (word == 0)  # the kernel hands the deep tail to the graph
    reference, kernel = both_paths(lambda: gaussian.normals([[128]], [seed], [dtype]))
    assert_same_bits(reference, kernel)
    sums = [tf.cast(tf.range(128) % 7, dtype)]  # the fused op: the same fallback
    assert_same_bits(*both_paths(lambda: tf.function(
        lambda: gaussian.add_normals(sums, [seed], 1.0))()))
    z = kernel[0].numpy().astype(np.float64)
    radius = np.hypot(z[index], z[64 + index])
    if word == 0:
        assert radius**2 / 2 > 32 * np.log(2) * (1 - 1e-2)  # beyond every word's cell
    elif word == 1:
        np.testing.assert_allclose(radius, np.sqrt(64 * np.log(2)), rtol=1e-2)
    else:
        assert z[index] != 0.0 and z[64 + index] != 0.0 and radius < 1e-4


def test_the_train_step_noise_is_the_same_on_both_paths(library):
    sums = [tf.ones([300, 7]), tf.fill([7], 2.0), tf.ones([3, 3], tf.float64)]
    seed = tf.constant([9, 9], tf.int64)
    reference, kernel = both_paths(lambda: tf.function(
        lambda: dpsgd.noisy_mean(sums, 1.7, 64.0, seed))())
    assert_same_bits(reference, kernel)
    assert native_noise.noise_path().startswith("compiled kernel")


@pytest.mark.parametrize("divisor", [3.0, 250.0])
def test_a_python_constant_divisor_gives_the_same_bits_in_tf_function(library, divisor):
    """Grappler turns / b for a constant b into * (1 / b) inside tf.function:
    both paths must divide with the same TensorFlow op to be rewritten alike."""
    rng = np.random.default_rng(0)
    sums = [tf.constant(rng.normal(size=[300, 7]), tf.float32),
            tf.constant(rng.normal(size=[7]), tf.float32)]
    seed = tf.constant([9, 9], tf.int64)
    reference, kernel = both_paths(lambda: tf.function(
        lambda: dpsgd.noisy_mean([s * 1.0 for s in sums], 1.7, divisor, seed))())
    assert_same_bits(reference, kernel)


def test_a_stddev_computed_in_the_step_gives_the_same_bits(library):
    """A stddev that is a product in the step (adaptive clipping's sigma * C_t,
    DPIS's sigma_G * C_e): Grappler's constant push-down rewrote the graph
    generator's sqrt(2) * (sigma * C_t) to C_t * (sqrt(2) * sigma), an ulp
    apart for about one C_t in four, and the kernel's factor not."""
    sums = [tf.constant(np.random.default_rng(0).normal(size=[8, 4]), tf.float32),
            tf.zeros([4])]
    seed = tf.constant([9, 9], tf.int64)
    clip = tf.Variable(2.0)
    sigma = 1.2810252304406972  # adaptive clipping's for z = 1, sigma_b = 0.8

    def make():
        step = tf.function(lambda: dpsgd.noisy_mean(sums, sigma * clip, 16.0, seed))
        noised = []
        for value in np.random.default_rng(1).uniform(1.0, 3.0, 24):
            clip.assign(value)
            noised.extend(step())
        return noised

    assert_same_bits(*both_paths(make))


def test_forced_fallback_is_taken_and_named(library, monkeypatch):
    monkeypatch.setenv(build.ENV_SWITCH, "graph")
    assert native_noise.library_here([tf.float32]) is None
    assert native_noise.noise_path() == "graph generator (TFDP_NOISE_KERNEL=graph)"
    assert build.load().library is None
    assert gaussian.standard_normal([3], tf.constant([1, 2], tf.int64)).shape == (3,)


def test_missing_compiler_falls_back_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.delenv(build.ENV_SWITCH, raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ anywhere
    monkeypatch.setenv("TFDP_CACHE_DIR", str(tmp_path / "cache"))  # nothing cached
    monkeypatch.setattr(native_noise, "_loaded", None)
    assert build.load().reason == "no C++ compiler: 'g++' is not on PATH (set CXX to one)"
    assert native_noise.noise_path() == (
        "graph generator (no C++ compiler: 'g++' is not on PATH (set CXX to one))")
    assert native_noise.library_here([tf.float32]) is None
    assert gaussian.standard_normal([3], tf.constant([1, 2], tf.int64)).shape == (3,)


def test_a_compiler_that_fails_falls_back_with_its_message(monkeypatch, tmp_path):
    script = tmp_path / "broken-c++"
    script.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\n"
                      "echo 'fatal: no headers' >&2; exit 3\n")
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setenv("TFDP_CACHE_DIR", str(tmp_path / "cache"))
    ops = build.load()
    assert ops.library is None
    assert "failed (exit 3): fatal: no headers" in ops.reason


def test_a_kernel_that_disagrees_with_the_graph_is_refused():
    class Wrong:
        def tfdp_gaussian_noise(self, shape, seed, factor, dtype):
            return tf.zeros(shape, dtype), tf.constant(False)

    reason = native_noise._self_check(Wrong())
    assert reason.startswith("the compiled op's float32 draw of 1 differs from the graph")


class _ZeroNoiseOffCheck:
    """A planted op: the real values for the old fixed self-check's seeds
    (second word 0x5EED), no noise for every other seed."""

    def __init__(self, library):
        self.library = library

    def _factor(self, seed, factor):
        return tf.where(seed[1] == 0x5EED, factor, tf.zeros_like(factor))

    def tfdp_gaussian_noise(self, shape, seed, factor, dtype):
        return self.library.tfdp_gaussian_noise(shape, seed, self._factor(seed, factor),
                                                dtype=dtype)

    def tfdp_gaussian_noise_add(self, total, seed, factor):
        return self.library.tfdp_gaussian_noise_add(total, seed, self._factor(seed, factor))

    def tfdp_gaussian_noise_add_group(self, totals, seed, factor):
        return self.library.tfdp_gaussian_noise_add_group(totals, seed,
                                                          self._factor(seed, factor))


def test_the_self_check_draws_unpredictable_seeds_sizes_and_stddev():
    first, second = native_noise._random_check(), native_noise._random_check()
    assert first[0] != second[0] or first[2] != second[2]
    assert max(first[0]) > 2 * 256 * 8  # past one chunk, over several shards
    assert [int(v) for v in first[1][0]] != [int(v) for v in second[1][0]]


def test_a_library_that_drops_the_noise_off_the_check_seeds_is_refused(library):
    planted = _ZeroNoiseOffCheck(library)
    assert native_noise._self_check(planted) is not None
    assert native_noise._self_check(library) is None  # negative control: the real op passes


def test_the_self_check_runs_eagerly_when_the_first_noise_is_traced(library):
    assert tf.function(lambda: native_noise._self_check(library) or "passed")() == "passed"


def test_a_fused_add_that_differs_is_refused(library):
    class WrongAdd(_ZeroNoiseOffCheck):
        def tfdp_gaussian_noise(self, shape, seed, factor, dtype):
            return self.library.tfdp_gaussian_noise(shape, seed, factor, dtype=dtype)

    assert "fused add" in native_noise._self_check(WrongAdd(library))


@pytest.mark.parametrize("where", ["library", "folder"])
def test_a_cache_writable_by_others_is_refused_with_the_path(library, monkeypatch, tmp_path,
                                                              where):
    monkeypatch.delenv(build.ENV_SWITCH, raising=False)
    monkeypatch.setenv("TFDP_CACHE_DIR", str(tmp_path / "cache"))
    _, version = build._compiler()
    target = tmp_path / "cache" / "native" / build._cache_key(version) / build._LIBRARY_NAME
    for folder in (tmp_path / "cache", target.parent.parent, target.parent):
        folder.mkdir(mode=0o700)
    shutil.copyfile(native_noise._load().path, target)  # as a build leaves it, without compiling
    target.chmod(0o755)
    # Negative control: a private cache passes (not loaded: a second copy of
    # the op's kernels registered in this process would clash).
    assert build._unsafe([target, target.parent, target.parent.parent, tmp_path / "cache"]) is None
    planted = target if where == "library" else target.parent
    planted.chmod(planted.stat().st_mode | 0o022)
    refused = build.load()
    assert refused.library is None
    assert str(planted) in refused.reason and "TFDP_CACHE_DIR" in refused.reason
    monkeypatch.setattr(native_noise, "_loaded", None)
    assert native_noise.noise_path() == f"graph generator ({refused.reason})"


@pytest.mark.parametrize("changed", range(len(build.SOURCES)),
                         ids=[source.name for source in build.SOURCES])
def test_a_changed_source_builds_into_a_new_cache_folder(monkeypatch, tmp_path, changed):
    """The cache folder is keyed by every source's bytes, so a library built
    from an older source (other inputs: the fused ops once took a divisor) is
    never loaded for a newer one."""
    sources = []
    for source in build.SOURCES:
        sources.append(tmp_path / source.name)
        shutil.copyfile(source, sources[-1])
    monkeypatch.setattr(build, "SOURCES", tuple(sources))
    key = build._cache_key("g++ 1.0")
    assert build._cache_key("g++ 1.0") == key  # negative control: the same sources, the same key
    sources[changed].write_bytes(sources[changed].read_bytes() + b"\n")
    assert build._cache_key("g++ 1.0") != key


def test_a_cache_owned_by_another_user_is_refused(library, monkeypatch, tmp_path):
    monkeypatch.setenv("TFDP_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir(mode=0o700)
    monkeypatch.setattr(build.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    assert "is not owned by this user" in build._unsafe([tmp_path / "cache"])


def test_xla_takes_the_graph_generator(library):
    @tf.function(jit_compile=True)
    def draw():
        assert native_noise.library_here([tf.float32]) is None
        return gaussian.standard_normal([5], tf.constant([1, 2], tf.int64))

    assert draw().shape == (5,)


# -- a real fit: the same weights on both paths -------------------------------------------


def _adaptive_fit_weights():
    """The weights after a seeded 3-step fit with adaptive clipping, its
    train step traced on the current path."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = rng.normal(size=(64, 4)).astype(np.float32)
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(
        0.1, l2_norm_clip=2.0, noise_multiplier=1.1, seed=5, target_unclipped_quantile=0.5),
        loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0)
    return [tf.constant(w) for w in model.get_weights()]


def test_a_seeded_fit_with_adaptive_clipping_trains_the_same_bits_on_both_paths(library):
    """Grappler optimizes each path's compiled train step as a whole, so a
    rewrite can reach the graph generator's arithmetic and not the op's
    inputs: these weights were ulps apart at step 3 (the noise factor of
    the test above)."""
    with graph_generator():
        reference = _adaptive_fit_weights()
    assert_same_bits(reference, _adaptive_fit_weights())
