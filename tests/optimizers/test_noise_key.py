"""The noise key: never saved, never replayed (issue 14, item 3).

Whoever knows a step's noise can subtract it from the released update. A
seed must therefore stay out of saved files, and a model loaded and compiled
with a new optimizer of the same seed must not add the noise of its earlier
steps again (the key is folded with the model's private step count).
"""

import json
import zipfile

import h5py
import keras
import numpy as np

import tfdp

DIM, BATCH, LEARNING_RATE, STEPS = 30, 8, 1.0, 3
# x = 0: the kernel's per-example gradients are 0, so each update is noise alone.
X_ZERO = np.zeros((BATCH, DIM), np.float32)
Y_ZERO = np.zeros((BATCH, DIM), np.float32)


def seeded(seed=7):
    return tfdp.optimizers.DPSGD(LEARNING_RATE, l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed)


class KernelTrace(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.kernels = []

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(self.model.layers[0].kernel.numpy().copy())


def noise_of_steps(model):
    """The noise (on the clipped sum) of each of STEPS full-batch steps."""
    trace = KernelTrace()
    start = model.layers[0].kernel.numpy().copy()
    model.fit(X_ZERO, Y_ZERO, batch_size=BATCH, epochs=1, steps_per_epoch=STEPS,
              callbacks=[trace], verbose=0)
    kernels = [start] + trace.kernels
    return [-(b - a) * BATCH / LEARNING_RATE for a, b in zip(kernels, kernels[1:])]


def keys_anywhere(value):
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from keys_anywhere(item)
    elif isinstance(value, list):
        for item in value:
            yield from keys_anywhere(item)


def h5_names(path):
    names = []
    with h5py.File(path, "r") as file:
        file.visit(names.append)
    return names


def test_no_seed_is_saved_and_a_same_seed_optimizer_never_replays_noise(tmp_path):
    """Broken variants caught: `seed` in get_config (the .keras file held
    seed=7, and the loaded optimizer re-used it), and noise keyed by the
    optimizer's own iteration counter only (a new DPSGD(seed=7) on the loaded
    model added exactly the first run's noise vectors again).
    """
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential(
        [keras.Input((DIM,)), keras.layers.Dense(DIM, use_bias=False, kernel_initializer="zeros")]
    )
    model.compile(optimizer=seeded(), loss="mse")
    first = noise_of_steps(model)
    assert abs(float(np.std(first)) - 1.0) < 0.1  # sigma * C = 1: it is the noise

    path = tmp_path / "model.keras"
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    assert "seed" not in set(keys_anywhere(config["compile_config"]))
    weights = tmp_path / "model.weights.h5"
    model.save_weights(weights)
    assert not [n for n in h5_names(weights) if "seed" in n or "key" in n]

    loaded = keras.models.load_model(path)
    assert loaded.optimizer.seed is None
    loaded.compile(optimizer=seeded(), loss="mse")
    second = noise_of_steps(loaded)
    loaded.compile(optimizer=seeded(), loss="mse")
    third = noise_of_steps(loaded)
    earlier = first + second
    for step in second + third:
        for old in earlier:
            if step is not old:
                assert not np.allclose(step, old, atol=1e-3)
    # Control: the seed still makes runs reproducible. Another load of the same
    # file with the same seed adds the same noise as `second`: what differs
    # above is the step count in the key, not chance.
    again = keras.models.load_model(path)
    again.compile(optimizer=seeded(), loss="mse")
    for a, b in zip(noise_of_steps(again), second):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
