"""Guards found missing by a mutation test of the privacy code (issue 43, item 12).

* An unseeded DPBandMF run on arrays (cyclic Poisson sampling) must draw its
  secret record groups from fresh entropy: a constant groups key passed
  every test (each record's group would then be known to anyone with the
  code, and two runs would share their groups).
* The DP-BandMF noise-state file is a secret (its holder can subtract the
  noise from the released iterates): it must be readable by its owner only,
  0600; a mutant writing 0644 passed.
"""

import os
import stat

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.data.cyclic_poisson import CyclicPoissonSampler
from tfdp.optimizers import bandmf as bandmf_module
from tfdp.optimizers import bandmf_state

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(n=256, dim=6):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, dim)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def classifier(optimizer, dim=6):
    keras.utils.set_random_seed(1)
    model = tfdp.DPSequential([keras.Input((dim,)), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


def bandmf_opt(seed=None, bands=4, **kwargs):
    return tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.5), 1.0, 1.0, bands=bands,
                                    seed=seed, **kwargs)


class CapturingSampler(CyclicPoissonSampler):
    made = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        CapturingSampler.made.append(self)


def groups_of_a_run(seed):
    """The record groups the sampler of one fresh 2-step run used."""
    x, y = data()
    model = classifier(bandmf_opt(seed=seed))
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0)
    return CapturingSampler.made[-1].groups.copy()


def test_unseeded_runs_draw_different_record_groups_and_seeded_ones_the_same(monkeypatch):
    monkeypatch.setattr(bandmf_module, "CyclicPoissonSampler", CapturingSampler)
    CapturingSampler.made = []
    first, second = groups_of_a_run(None), groups_of_a_run(None)
    assert len(first) == 256 and set(first.tolist()) == {0, 1, 2, 3}
    # independent uniform groups in 4 bands: about 3/4 of the records differ
    differ = float(np.mean(first != second))
    assert differ > 0.5, f"two unseeded runs share {1 - differ:.0%} of their record groups"
    # an unseeded run's groups are not a seeded run's either (a key from a
    # fixed seed, e.g. seed 0, passed for "random")
    for seed in (0, 1):
        assert np.mean(first != groups_of_a_run(seed)) > 0.5
    # control: a seeded run reproduces its groups, another seed does not
    np.testing.assert_array_equal(groups_of_a_run(9), groups_of_a_run(9))
    assert np.mean(groups_of_a_run(9) != groups_of_a_run(10)) > 0.5


@pytest.fixture
def usual_umask():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.usefixtures("usual_umask")
@pytest.mark.parametrize("order", ["cyclic poisson", "fixed order"])
def test_the_noise_state_file_and_its_previous_copy_are_owner_only(tmp_path, order):
    x, y = data()
    path = str(tmp_path / "noise_state.npz")
    model = classifier(bandmf_opt(seed=3, noise_state=path))
    if order == "cyclic poisson":
        model.fit(x, y, batch_size=16, epochs=2, steps_per_epoch=4, verbose=0)
    else:
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)
        model.fit(dataset, epochs=2, verbose=0)
    previous = bandmf_state.previous_path(path)
    assert os.path.exists(path) and os.path.exists(previous)
    assert oct(mode(path)) == oct(0o600)
    assert oct(mode(previous)) == oct(0o600)
    # an explicit save to a new path too (a plain new file here would be 0644)
    other = str(tmp_path / "copy.npz")
    model.optimizer.save_noise_state(other)
    assert oct(mode(other)) == oct(0o600)
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    assert mode(plain) == 0o644  # control: the umask leaves others able to read
