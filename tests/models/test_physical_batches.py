"""fit(physical_batch_size=k): chunked per-example work, one noise per logical step."""

import contextlib
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tests.forced_draws import force_draws
from tests.noiseless import NoiselessDPSGD
from tfdp.models import chunked_step, state_writes

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(n=300, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, n)
    weights = rng.uniform(0.5, 2.0, n).astype("float32")
    return x, y, weights


def train(optimizer, physical_batch_size, batch_size=96, epochs=2, sample_weight=True, n=300,
          jit_compile=False):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3),
    ])
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"], jit_compile=jit_compile)
    x, y, weights = data(n)
    history = model.fit(
        x, y, sample_weight=weights if sample_weight else None, batch_size=batch_size,
        epochs=epochs, verbose=0, physical_batch_size=physical_batch_size,
    )
    return model, history.history


def dpsgd(**kwargs):
    return tfdp.optimizers.DPSGD(0.5, l2_norm_clip=0.3, noise_multiplier=1.0, seed=7, **kwargs)


def adam(**kwargs):
    return tfdp.optimizers.DPOptimizer(
        keras.optimizers.Adam(0.05), l2_norm_clip=0.3, noise_multiplier=1.0, seed=7, **kwargs
    )


def sadpsgd():
    x, y, _ = data(60, seed=1)
    return tfdp.optimizers.SADPSGD(
        0.5, l2_norm_clip=0.3, noise_multiplier=1.0, public_energy_data=(x, y),
        initial_temperature=0.01, seed=7,
    )


def assert_same_run(unsplit, split):
    (model_a, logs_a), (model_b, logs_b) = unsplit, split
    for a, b in zip(model_a.get_weights(), model_b.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert model_a.privacy.steps == model_b.privacy.steps
    assert model_a.privacy.epsilon(1e-5) == model_b.privacy.epsilon(1e-5)
    assert logs_a.keys() == logs_b.keys()
    for key in logs_a:
        np.testing.assert_allclose(logs_a[key], logs_b[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        dpsgd,
        lambda: dpsgd(weight_decay=0.1),
        lambda: dpsgd(weight_decay=0.1, weight_decay_placement="after_noise"),
        adam,
        lambda: adam(weight_decay=0.1),
        sadpsgd,
    ],
    ids=["dpsgd", "dpsgd_decay_before_clip", "dpsgd_decay_after_noise", "adam",
         "adam_decay_before_clip", "sadpsgd"],
)
def test_chunked_run_equals_the_unsplit_run(make_optimizer):
    # 23 divides no padded batch: the last chunk of each step is partial.
    assert_same_run(train(make_optimizer(), None), train(make_optimizer(), 23))


@pytest.fixture(scope="module")
def xla_run_in_chunks_of_23():
    """One XLA run in chunks of 23 rows (a partial last chunk: 23 divides no
    padded batch) and the rows of every chunk its trace saw; an XLA fit
    compiles for seconds, so the two tests below read this one."""
    with pytest.MonkeyPatch.context() as patch:
        traced, _ = record_chunk_rows(patch, at_run_time=False)
        run = train(dpsgd(), 23, epochs=1, jit_compile=True)
    return run, traced


@pytest.mark.xdist_group("physical_batches_xla_run")
def test_chunked_run_equals_the_unsplit_run_under_xla(xla_run_in_chunks_of_23):
    # XLA pads every batch to one fixed length: chunks of static shape.
    unsplit = train(dpsgd(), None, epochs=1, jit_compile=True)
    assert_same_run(unsplit, xla_run_in_chunks_of_23[0])


def test_noise_is_drawn_once_per_logical_step():
    # Noise alone moves the weights (all gradients clipped to ~0 by a tiny
    # clip): the chunked run must end where the unsplit one does, and a run
    # with a different seed (negative control) must not.
    def noisy(seed):
        return tfdp.optimizers.DPSGD(1.0, l2_norm_clip=1e-6, noise_multiplier=1e7, seed=seed)

    unsplit, _ = train(noisy(3), None, epochs=1)
    split, _ = train(noisy(3), 16, epochs=1)
    other, _ = train(noisy(4), 16, epochs=1)
    a, b, c = (m.trainable_variables[0].numpy() for m in (unsplit, split, other))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.abs(a - c).max() > 1e-2


def test_empty_and_tiny_batches():
    # Expected batch 1 of 60: many Poisson draws are empty (no chunk runs).
    unsplit = train(dpsgd(), None, batch_size=1, epochs=1, n=60)
    split = train(dpsgd(), 1, batch_size=1, epochs=1, n=60)
    assert_same_run(unsplit, split)


def record_chunk_rows(monkeypatch, at_run_time=True):
    """Records the rows of every chunk's per-example work: (static rows at
    trace time, rows at run time; XLA compiles no Python call, so the
    latter stays empty with at_run_time=False)."""
    traced, ran = [], []
    original = chunked_step.compute_per_example_gradients

    def recording(model, x, *args, **kwargs):
        traced.append(x.shape[0])
        if at_run_time:
            log = tf.py_function(lambda n: ran.append(int(n)) or 0, [tf.shape(x)[0]], tf.int32)
            with tf.control_dependencies([log]):
                x = tf.identity(x)
        return original(model, x, *args, **kwargs)

    monkeypatch.setattr(chunked_step, "compute_per_example_gradients", recording)
    if at_run_time:  # the probe is Python in the step, which the state-writes scan refuses
        monkeypatch.setattr(chunked_step, "checked_per_example_pass",
                            lambda model: contextlib.nullcontext())
        monkeypatch.setattr(state_writes, "checked_train_step",
                            lambda model, then=None: contextlib.nullcontext())
    return traced, ran


def test_per_example_work_sees_chunks_of_at_most_k_rows(monkeypatch):
    # Without XLA a step's chunks are k rows but the last, which ends at the
    # last drawn row: 4 steps at batch 96 of 300 run [16] * 6 or so, and a
    # tail shorter than 16 (all 16 at once would be one in 16).
    traced, ran = record_chunk_rows(monkeypatch)
    model, _ = train(dpsgd(), 16, epochs=1)
    assert traced and set(traced) == {None}
    assert ran and max(ran) == 16 and min(ran) < 16
    draws = model.privacy.steps
    assert sum(size < 16 for size in ran) <= draws


@pytest.mark.xdist_group("physical_batches_xla_run")
def test_chunks_have_k_rows_under_xla(xla_run_in_chunks_of_23):
    # Every chunk, the last one too, is traced with k = 23 static rows.
    _, traced = xla_run_in_chunks_of_23
    assert traced and set(traced) == {23}


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "8", 65, 2**31 - 16, 2**31, 2**32, 2**32 + 16])
def test_bad_physical_batch_size_is_refused_before_training(value):
    # Batch 32 of 300 pads to 64 rows: a chunk of more rows computes padding
    # only, and 2**31 overflowed the chunk count (the step trained on noise).
    model = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=dpsgd(), loss=LOSS)
    x, y, _ = data()
    with pytest.raises(ValueError, match=r"physical_batch_size=" + repr(value).replace(".", r"\.")):
        model.fit(x, y, batch_size=32, physical_batch_size=value, verbose=0)
    assert model.privacy.steps == 0
    assert chunked_step.check_physical_batch_size(dpsgd(), 64, 300, 32) == 64


XLA_COMPILATIONS = """
import keras, numpy as np, tfdp
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 2, 64)
model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=1),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
model.fit(x, y, batch_size=16, physical_batch_size=4, epochs=1, steps_per_epoch=12, verbose=0)
"""


def test_xla_compiles_the_chunked_step_once(tmp_path):
    """12 Poisson draws of about 16 rows in chunks of 4: the chunk counts
    differ from step to step, the compiled step must not (it compiled once
    per distinct count, about 5 s each on a GPU). XLA dumps one module per
    compilation."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path}", TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", XLA_COMPILATIONS], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [f for f in os.listdir(tmp_path)
             if "one_step_on_data" in f and f.endswith("before_optimizations.txt")]
    assert len(steps) == 1, sorted(steps)


def test_a_draw_that_fills_the_padded_batch_equals_the_unsplit_step_under_xla(monkeypatch):
    """Draws of exactly the padded length (64 rows, batch 32 of 300) in
    chunks of 6: the last chunk reaches 2 rows past the batch, which XLA's
    static chunks fill with the last row and must mask out."""
    padded = tfdp.data.PoissonSampler(300, 32).padded_size
    assert padded == 64 and padded % 6 != 0
    rng = np.random.default_rng(5)
    force_draws(monkeypatch, [np.sort(rng.choice(300, padded, replace=False)) for _ in range(2)])

    def run(physical_batch_size, jit_compile):
        keras.utils.set_random_seed(0)
        model = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer=NoiselessDPSGD(0.5, l2_norm_clip=0.3, noise_multiplier=1.0),
                      loss=LOSS, jit_compile=jit_compile)
        x, y, _ = data()
        model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=2, verbose=0,
                  physical_batch_size=physical_batch_size)
        assert model.privacy.steps == 2
        return model.get_weights()

    unsplit = run(None, False)
    for got, want in zip(run(6, True), unsplit):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_optimizer_overriding_privatize_is_refused_in_the_chunked_step():
    """Refused at fit, and also when compiled after a chunked fit and its
    train step driven by hand (the chunked step bypassed its privatize)."""

    class Custom(tfdp.optimizers.DPSGD):
        def privatize(self, per_example, step_info):
            return super().privatize(per_example, step_info)

    x, y, _ = data()
    model = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=Custom(0.5, l2_norm_clip=0.3, noise_multiplier=1.0), loss=LOSS)
    with pytest.raises(ValueError, match="Custom cannot split.*overrides privatize"):
        model.fit(x, y, batch_size=32, physical_batch_size=8, verbose=0)
    model.compile(optimizer=dpsgd(), loss=LOSS)
    model.fit(x, y, batch_size=32, physical_batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
    instance = dpsgd()
    instance.privatize = lambda per_example, step_info: (_ for _ in ()).throw(AssertionError)
    for optimizer in (Custom(0.5, l2_norm_clip=0.3, noise_multiplier=1.0), instance):
        model.compile(optimizer=optimizer, loss=LOSS)
        steps = model.privacy.steps
        step_info = {"mask": tf.ones([8]), "expected_batch_size": tf.constant(32.0)}
        with pytest.raises(ValueError, match="cannot split.*overrides privatize"):
            model.train_step(((x[:8], y[:8]), step_info))
        assert model.privacy.steps == steps


@pytest.mark.parametrize(
    "optimizer",
    [
        tfdp.optimizers.DPIS(
            learning_rate=0.5, l2_norm_clip=1.0, target_epsilon=4.0, epochs=3, sigma_n=5.0, seed=1
        ),
        tfdp.optimizers.AdaDP(learning_rate=0.01, l2_norm_clip=0.7, noise_multiplier=1.3, seed=1),
    ],
    ids=["dpis", "adadp"],
)
def test_mechanisms_that_cannot_split_refuse_clearly(optimizer):
    model = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=LOSS)
    x, y, _ = data()
    name = type(optimizer).__name__
    with pytest.raises(ValueError, match=rf"{name} cannot split.*physical_batch_size=None"):
        model.fit(x, y, batch_size=32, physical_batch_size=8, verbose=0)
    assert model.privacy.steps == 0


def test_memmap_and_record_source_feed_the_chunked_step(tmp_path):
    x, y, _ = data()
    path = tmp_path / "x.npy"
    np.save(path, x)
    unsplit, logs = train_on(dpsgd(), x, y, None)
    mapped = train_on(dpsgd(), np.load(path, mmap_mode="r"), y, 23)
    records = tfdp.data.RecordSource(list(zip(x, y)))
    from_records = train_on(dpsgd(), records, None, 23)
    assert_same_run((unsplit, logs), mapped)
    assert_same_run((unsplit, logs), from_records)


def train_on(optimizer, x, y, physical_batch_size):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
    history = model.fit(x, y, batch_size=96, epochs=1, verbose=0,
                        physical_batch_size=physical_batch_size)
    return model, history.history
