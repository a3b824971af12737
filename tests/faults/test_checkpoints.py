"""Resumed runs draw fresh noise; corrupted or mismatched checkpoints are refused."""

import shutil

import keras
import numpy as np
import pytest

import tfdp
from tests.faults.ledger_files import (read_ledger, resealed, rewrite_ledger,
                                       rewrite_ledger_in_archive)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 4)).astype(np.float32), rng.integers(0, 3, 32)


def build(units=5, seed=None):
    model = tfdp.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(units, activation="tanh"), keras.layers.Dense(3)]
    )
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed),
        loss=LOSS,
    )
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A model trained 6 steps (two fits, two sampling rates), saved both ways."""
    x, y = data()
    model = build()
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=4, verbose=0)
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)
    folder = tmp_path_factory.mktemp("checkpoint")
    model.save(folder / "model.keras")
    model.save_weights(folder / "model.weights.h5")
    return folder, model


def one_full_batch_step(model):
    x, y = data()
    model.fit(x, y, batch_size=len(x), epochs=1, steps_per_epoch=1, verbose=0)  # q = 1: same batch
    return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])


def _noise_distance_ratios(folder, resumes):
    """Each resume's distance from the noiseless step, over the noise's
    expected distance lr sigma C sqrt(d) / b (sigma = 1).

    Only the noise differs between resumes of one full-batch step (q = 1):
    the same step without noise is their common centre."""
    quiet = keras.models.load_model(folder / "model.keras")
    quiet.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1e-9), loss=LOSS)
    centre = one_full_batch_step(quiet)
    expected = 0.1 * 1.0 * 1.0 * np.sqrt(centre.size) / 32
    return [np.linalg.norm(resumed - centre) / expected for resumed in resumes]


def test_two_resumes_from_one_checkpoint_draw_different_noise(checkpoint):
    folder, _ = checkpoint
    first = one_full_batch_step(keras.models.load_model(folder / "model.keras"))
    second = one_full_batch_step(keras.models.load_model(folder / "model.keras"))
    start = np.concatenate(
        [v.numpy().ravel() for v in keras.models.load_model(folder / "model.keras").trainable_variables]
    )
    assert not np.allclose(first, second)
    assert not np.allclose(first, start)
    # Each resume adds all of the noise: it lies at the expected distance from
    # the noiseless step (chi with d = 43: +-11% per sigma, so 40% is ~3.7 sigma).
    for ratio in _noise_distance_ratios(folder, (first, second)):
        assert ratio == pytest.approx(1.0, rel=0.4)


@pytest.mark.parametrize("noise_multiplier", [0.5, 0.05])
def test_negative_control_a_resume_with_less_noise_is_caught(checkpoint, noise_multiplier):
    """The distance check above catches a resume that adds half the noise or
    almost none (seeded here, so the control is reproducible)."""
    folder, _ = checkpoint
    weak = keras.models.load_model(folder / "model.keras")
    weak.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=noise_multiplier, seed=3),
        loss=LOSS,
    )
    (ratio,) = _noise_distance_ratios(folder, [one_full_batch_step(weak)])
    assert ratio != pytest.approx(1.0, rel=0.4)
    assert ratio == pytest.approx(noise_multiplier, abs=0.1)


def test_negative_control_a_user_seed_reproduces_the_noise(tmp_path):
    """With a seed (tests only), resumes are identical: the comparison above can see equality.

    The seed is never saved, so each resume compiles a new optimizer with it.
    """
    x, y = data()
    model = build(seed=5)
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0)
    model.save(tmp_path / "seeded.keras")

    def reseeded():
        loaded = keras.models.load_model(tmp_path / "seeded.keras")
        assert loaded.optimizer.seed is None
        loaded.compile(
            optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=5),
            loss=LOSS,
        )
        return loaded

    first = one_full_batch_step(reseeded())
    second = one_full_batch_step(reseeded())
    np.testing.assert_array_equal(first, second)


def test_a_resumed_seeded_run_does_not_replay_earlier_noise(tmp_path):
    """Noise is keyed by the model's step count: a resume compiled with the
    same seed draws new noise at its next step, not step 1's again. The
    gradients are zero here (a bias-free linear model on x = 0), so each
    update is the noise alone."""
    x, y = np.zeros((32, 4), np.float32), np.zeros(32, np.int64)

    def seeded(model):
        model.compile(
            optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=5),
            loss=LOSS,
        )
        return model

    def update(model):
        before = model.get_weights()[-1].copy()
        model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=1, verbose=0)
        return model.get_weights()[-1] - before

    def linear():
        keras.utils.set_random_seed(0)
        return tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3, use_bias=False)])

    model = seeded(linear())
    start = model.get_weights()[-1].copy()
    first = update(model)
    model.save(tmp_path / "mid.keras")
    second = update(seeded(keras.models.load_model(tmp_path / "mid.keras")))
    assert np.linalg.norm(first) > 0 and np.linalg.norm(second) > 0
    assert not np.allclose(first, second)
    # Control: a fresh model with the same seed replays step 1 exactly, so
    # the comparison above can see a replay.
    fresh = seeded(linear())
    np.testing.assert_array_equal(fresh.get_weights()[-1], start)
    np.testing.assert_allclose(update(fresh), first, rtol=1e-6)


def test_the_ledger_survives_save_and_load(checkpoint):
    folder, model = checkpoint
    restored = keras.models.load_model(folder / "model.keras")
    assert restored.privacy.steps == 6
    assert restored.privacy.epsilon(1e-5) == pytest.approx(model.privacy.epsilon(1e-5))
    fresh = build()
    fresh.build((None, 4))
    fresh.load_weights(folder / "model.weights.h5")
    assert fresh.privacy.epsilon(1e-5) == pytest.approx(model.privacy.epsilon(1e-5))


def corrupt_bytes(source, target, start_fraction, count=200):
    data = bytearray(open(source, "rb").read())
    start = int(len(data) * start_fraction)
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xFF
    open(target, "wb").write(bytes(data))


def test_corrupted_files_are_refused(checkpoint, tmp_path):
    folder, _ = checkpoint
    corrupt_bytes(folder / "model.keras", tmp_path / "flipped.keras", 0.3)
    with pytest.raises(Exception, match="CRC|zip|Bad|corrupt"):
        keras.models.load_model(tmp_path / "flipped.keras")
    data = open(folder / "model.keras", "rb").read()
    open(tmp_path / "truncated.keras", "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match="zip file"):
        keras.models.load_model(tmp_path / "truncated.keras")
    weights = open(folder / "model.weights.h5", "rb").read()
    open(tmp_path / "truncated.weights.h5", "wb").write(weights[: len(weights) // 2])
    model = build()
    model.build((None, 4))
    with pytest.raises(OSError, match="truncated file"):
        model.load_weights(tmp_path / "truncated.weights.h5")


@pytest.mark.parametrize(
    "transform, message",
    [
        (lambda t: t[: len(t) // 2], "Corrupt privacy ledger: invalid JSON"),
        (lambda t: b"\xff\xfe" + t, "Corrupt privacy ledger: not UTF-8"),
        (lambda t: t.replace(b'"start": 4', b'"start": 3'), "Corrupt privacy ledger"),
        (lambda t: resealed(t, steps=5), "Mismatched checkpoint: its privacy ledger was saved at step 5"),
    ],
)
def test_a_corrupted_or_mismatched_ledger_is_refused(checkpoint, tmp_path, transform, message):
    folder, _ = checkpoint
    path = tmp_path / "bad.weights.h5"
    shutil.copy(folder / "model.weights.h5", path)
    rewrite_ledger(path, transform)
    model = build()
    model.build((None, 4))
    with pytest.raises(ValueError, match=message):
        model.load_weights(path)


def test_a_corrupted_ledger_inside_a_keras_file_is_refused_by_tfdp(checkpoint, tmp_path):
    """A .keras archive whose zip is intact (valid CRCs) but whose ledger is cut:
    keras loads the archive and tfdp's own check refuses the ledger."""
    folder, _ = checkpoint
    rewrite_ledger_in_archive(folder / "model.keras", tmp_path / "bad.keras",
                              lambda t: t[: len(t) // 2], tmp_path / "model.weights.h5")
    with pytest.raises(ValueError, match="Corrupt privacy ledger: invalid JSON"):
        keras.models.load_model(tmp_path / "bad.keras")


def test_weights_and_ledger_from_two_checkpoints_are_refused(checkpoint, tmp_path):
    """An older step counter with a newer ledger (closed segments beyond it)."""
    folder, model = checkpoint
    x, y = data()
    model.fit(x, y, batch_size=4, epochs=1, steps_per_epoch=2, verbose=0)  # a third segment
    model.save_weights(tmp_path / "newer.weights.h5")
    path = tmp_path / "mixed.weights.h5"
    shutil.copy(folder / "model.weights.h5", path)
    newer_ledger = read_ledger(tmp_path / "newer.weights.h5")
    rewrite_ledger(path, lambda _: newer_ledger)
    fresh = build()
    fresh.build((None, 4))
    with pytest.raises(ValueError, match="Mismatched checkpoint"):
        fresh.load_weights(path)


# Keras warns while it reads the foreign weights this test feeds in on purpose.
@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer:UserWarning")
def test_weights_without_a_ledger_or_of_another_model_are_refused(checkpoint, tmp_path):
    folder, _ = checkpoint
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    plain.save_weights(tmp_path / "plain.weights.h5")
    model = build()
    model.build((None, 4))
    with pytest.raises(ValueError, match="hold no tfdp privacy ledger"):
        model.load_weights(tmp_path / "plain.weights.h5")
    wider = build(units=7)
    wider.build((None, 4))
    with pytest.raises(ValueError, match="could not be loaded|shape"):
        wider.load_weights(folder / "model.weights.h5")
