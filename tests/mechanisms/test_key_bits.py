"""Every privacy-relevant seed keeps 64 secret bits in its Philox key word.

`tf.random.experimental.stateless_fold_in(seed, data)` returns
`[stateless_random_uniform_full_int([], seed, dtype=data.dtype), data]`: a
Python int `data` makes an int32 seed whose only secret is one 32-bit word,
and 2^32 candidates can be searched to subtract a step's noise. These tests
trace real train steps and walk every op (function library and while-loop
bodies included): no stateless random op may take an int32 seed. They also
check that the augmentation key (which user code sees) shares no word with
any noise seed.
"""

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tfdp.mechanisms import dpsgd, gaussian, quantile_clipping
from tfdp.models import augmentation
from tfdp.models.state_writes import _called_functions

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _library(graph, library):
    """Every function reachable from `graph`'s function library, by name."""
    for name, function in getattr(graph, "_functions", {}).items():
        if name not in library and getattr(function, "graph", None) is not None:
            library[name] = function.graph
            _library(function.graph, library)
    return library


def _ops(graph, library, seen):
    for op in graph.get_operations():
        yield op
        for name in _called_functions(op):
            nested = library.get(name)
            if nested is not None and name not in seen:
                seen.add(name)
                _library(nested, library)
                yield from _ops(nested, library, seen)


def seed_inputs(graph):
    """(op type, input name, dtype, whether inside a called function) of
    every seed or key input of a stateless random op under `graph`."""
    found, top = [], set(graph.get_operations())
    for op in _ops(graph, _library(graph, {}), set()):
        if not op.type.startswith("Stateless") or "Random" not in op.type:
            continue
        names = [arg.name for arg in op.op_def.input_arg]
        for name, tensor in zip(names, op.inputs):
            if name in ("seed", "key"):
                found.append((op.type, name, tensor.dtype, op not in top))
    return found


class _Traced(Exception):
    """Stops `fit` once its step is traced: nothing needs to run."""


def traced_step(model, x, y, **fit_kwargs):
    """The graph `fit` traces the model's train step in (no step runs)."""
    graphs = []
    step = model.train_step

    def spy(data):
        step(data)
        graphs.append(tf.compat.v1.get_default_graph())
        raise _Traced

    model.train_step = spy
    fit_kwargs.setdefault("steps_per_epoch", 1)
    try:
        model.fit(x, y, epochs=1, verbose=0, **fit_kwargs)
    except _Traced:
        pass
    return graphs[0]


def classifier(optimizer):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


def data(n=40):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


def flip(x, seed):
    return tf.where(tf.random.stateless_uniform([], seed) < 0.5, -x, x)


STEPS = {
    "dpsgd": (lambda: tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0), {}),
    "adaptive_clipping": (lambda: tfdp.optimizers.DPSGD(
        0.1, noise_multiplier=1.0, target_unclipped_quantile=0.5, clipped_count_stddev=1.0), {}),
    "bandmf": (lambda: tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.1), 1.0, 1.0, bands=2),
               {}),
    "user_level": (lambda: tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0),
                   {"user_ids": np.arange(40) // 4, "examples_per_user": 2}),
    "augmentation": (lambda: tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0),
                     {"augment": flip, "augmentations": 2}),
}


def test_every_stateless_seed_of_a_traced_train_step_is_64_bit():
    for name, (optimizer, fit_kwargs) in STEPS.items():
        x, y = data()
        if name == "bandmf":  # DP-BandMF trains on a fixed-order pipeline
            batches = tf.data.Dataset.from_tensor_slices((x[:16], y[:16])).batch(8, True)
            graph = traced_step(classifier(optimizer()), batches, None, steps_per_epoch=None)
        else:
            graph = traced_step(classifier(optimizer()), x, y, batch_size=8, **fit_kwargs)
        seeds = seed_inputs(graph)
        # The noise's deep tail (a while-loop body) was walked too.
        assert any(nested for *_, nested in seeds), name
        narrow = [s for s in seeds if s[2] not in (tf.int64, tf.uint64)]
        assert not narrow, (name, narrow)


def test_the_walk_finds_an_int32_fold_in_a_while_body():
    """Negative control: the old fold (Python int data), inside a loop."""

    def body(i, total):
        seed = tf.random.experimental.stateless_fold_in(tf.constant([1, 2], tf.int64), 3)
        return i + 1, total + tf.random.stateless_uniform([], seed)

    graph = tf.function(lambda: tf.while_loop(lambda i, t: i < 2, body, [0, 0.0])) \
        .get_concrete_function().graph
    assert any(dtype == tf.int32 and nested for _, _, dtype, nested in seed_inputs(graph))


def stream_seeds(tensors, seed):
    """The stream seeds `gaussian_noise_like` hands to `normals`."""
    captured = []

    def spy(shapes, seeds, dtypes, stddev=1.0):
        captured.extend(seeds)
        return gaussian.normals(shapes, seeds, dtypes, stddev)

    real, dpsgd.normals = dpsgd.normals, spy
    try:
        dpsgd.gaussian_noise_like(tensors, 1.0, seed)
    finally:
        dpsgd.normals = real
    return captured


def test_noise_streams_are_64_bit_and_distinct():
    seeds = stream_seeds([tf.zeros([3]), tf.zeros([2, 2]), tf.zeros([5])],
                         tf.constant([0x1234, 7], tf.int64))
    assert [s.dtype for s in seeds] == [tf.int64] * 3
    assert len({int(s[1]) for s in seeds}) == 3
    # Every stream's first word is a full 64-bit draw, not a sign-extended int32.
    assert all(not -2**31 <= int(s[0]) < 2**31 for s in seeds)


def halves(words):
    """Each 64-bit word and its two 32-bit halves."""
    out = set()
    for word in words:
        word = int(word) & (2**64 - 1)
        out |= {word, word & 0xFFFFFFFF, word >> 32}
    return out


def test_the_augmentation_key_shares_no_word_with_the_noise_seeds():
    optimizer = tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, seed=3)
    optimizer.iterations.assign(5)
    noise_seed = optimizer.noise_seed()
    streams = stream_seeds([tf.zeros([3]), tf.zeros([70000])], noise_seed)
    deep = [tf.random.experimental.stateless_fold_in(s, tf.constant(1, tf.int64))
            for s in streams]
    count = tf.random.experimental.stateless_fold_in(
        noise_seed, tf.constant(quantile_clipping.COUNT_STREAM, tf.int64))
    secret = halves(np.concatenate([np.asarray(s)[:1] for s in [noise_seed, count, *streams,
                                                                 *deep]]))
    key = augmentation.step_key(optimizer)
    assert not halves(np.asarray(key)) & secret
    # What fn sees for an all-zero record (its hash is 0): fn returns its seed.
    aug = augmentation.Augmentation(lambda x, seed: seed, 2, True)
    seen = aug.expand(tf.zeros([1, 2], tf.int64), tf.zeros([1]), tf.ones([1]), tf.ones([1]),
                      key)[0]
    assert not halves(np.asarray(seen).ravel()) & secret
