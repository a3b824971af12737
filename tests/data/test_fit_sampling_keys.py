"""Every unseeded `fit` draws its batches with a fresh secret key.

A key shared by two fits would make their draws related (and a key reused
across runs makes batches predictable), so this watches the key each fit's
input pipeline is built with (`make_dataset` -> `sampling.draws`): a cache
or a refactor that hands a second fit the first one's key, or skips
building its pipeline with a new one, fails here. A seeded optimizer's fits
keep their reproducible keys (the seed and the steps already taken).
"""

import keras
import numpy as np

import tfdp
from tfdp.data import poisson, sampling


def fit_keys(monkeypatch, seed, fits=3):
    """The sampling key each of `fits` fits of one model built its pipeline with."""
    keys = []

    def watched_draws(sampler, key, *args, **kwargs):
        keys.append(np.asarray(key, np.int64).copy())
        return sampling.draws(sampler, key, *args, **kwargs)

    monkeypatch.setattr(poisson, "draws", watched_draws)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 2, 64)
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
    optimizer = tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for _ in range(fits):
        model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)
    return keys, optimizer


def distinct(keys):
    return len({tuple(key.tolist()) for key in keys})


def test_every_unseeded_fit_draws_with_a_fresh_key(monkeypatch):
    keys, _ = fit_keys(monkeypatch, seed=None)
    assert len(keys) == 3  # one pipeline, with its own key, per fit
    assert distinct(keys) == 3


def test_negative_control_a_reused_key_is_caught(monkeypatch):
    fixed = sampling.sampling_key(0)
    monkeypatch.setattr(poisson, "sampling_key", lambda seed=None: fixed.copy())
    keys, _ = fit_keys(monkeypatch, seed=None)
    assert len(keys) == 3 and distinct(keys) == 1


def test_seeded_fits_keep_their_reproducible_keys(monkeypatch):
    keys, optimizer = fit_keys(monkeypatch, seed=7)
    expected = [sampling.sampling_key(optimizer.sampling_seed(steps)) for steps in (0, 2, 4)]
    np.testing.assert_array_equal(np.stack(keys), np.stack(expected))
