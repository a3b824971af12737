"""Guards found missing by a mutation test of the privacy code (issue 43, item 12).

* An unseeded DPBandMF run on arrays (cyclic Poisson sampling) must draw its
  secret record groups from fresh entropy: a constant groups key passed
  every test (each record's group would then be known to anyone with the
  code, and two runs would share their groups).
* The DP-BandMF noise-state file is a secret (its holder can subtract the
  noise from the released iterates): it must be readable by its owner only,
  0600; a mutant writing 0644 passed.

Issue 55, item 8 (each mutant below passed every relevant test):

* Adaptive clipping's count of unclipped units must get its whole noise
  sigma_b (halved in `update_clip_norm`), from its own stream (seeded on the
  gradient noise's stream 0 it repeated a gradient coordinate's normal), and
  a step must be noised at C_t, read before C_{t+1} is assigned (in
  `privatize` and in the physical-batch step; swapped, a step that shrinks C
  was noised 90x too little).
* An unseeded noise key draws 64 secret bits a word (16 passed).
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
from tfdp.optimizers import bandmf_state, dp_optimizer
from tfdp.per_example.grads import MaterializedGrads, PerExampleGradients

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


class _GroupsDrawn(Exception):
    pass


class _StopBeforeTheFirstStep(keras.callbacks.Callback):
    """Ends a fit once its sampler is made (fit draws the groups key and
    builds the cyclic Poisson sampler before `on_train_begin`); no step, so
    no trace of a train step: the groups are the sampler's, fixed when it is
    made, whether or not steps follow."""

    def on_train_begin(self, logs=None):
        raise _GroupsDrawn


def groups_of_a_run(seed):
    """The record groups the sampler of one fresh fit draws (the fit stops
    before its first step)."""
    x, y = data()
    model = classifier(bandmf_opt(seed=seed))
    made = len(CapturingSampler.made)
    with pytest.raises(_GroupsDrawn):
        model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0,
                  callbacks=[_StopBeforeTheFirstStep()])
    assert len(CapturingSampler.made) == made + 1  # this fit's own sampler
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
    seeded = groups_of_a_run(9)
    np.testing.assert_array_equal(groups_of_a_run(9), seeded)
    assert np.mean(seeded != groups_of_a_run(10)) > 0.5


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


# -- issue 55, item 8: adaptive clipping's count and the noise key ---------------

COUNT_STDDEV, EXPECTED = 2.0, 64.0


def adaptive_optimizer(variables, **kwargs):
    optimizer = tfdp.optimizers.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=3,
                                      target_unclipped_quantile=0.1,
                                      clipped_count_stddev=COUNT_STDDEV, **kwargs)
    optimizer.build(variables)
    return optimizer


def count_and_gradient_noise(steps=200):
    """The count's standard normal and the gradient noise's of `steps` steps
    (the centred count 0, the clipped sums 0) of a two-entry variable, whose
    stream draws one pair of words as the scalar count does."""
    variable = tf.Variable(tf.zeros([2]))
    optimizer = adaptive_optimizer([variable])
    info = {"expected_batch_size": tf.constant(EXPECTED)}
    counts, gradients = [], []
    for step in range(steps):
        optimizer.iterations.assign(step)
        optimizer.clip_norm().assign(1.0)
        grads = optimizer.noisy_gradients([tf.zeros([2])], info, [variable])
        released = optimizer.update_clip_norm({"unclipped_count": tf.constant(0.0)}, info)
        # b_t = (0 + N(0, sigma_b^2)) / B + 1/2, never clamped here (sigma_b / B = 1/32)
        counts.append((float(released["unclipped_fraction"]) - 0.5) * EXPECTED / COUNT_STDDEV)
        gradients.append(grads[0].numpy() * EXPECTED / float(optimizer.noise_stddev(EXPECTED)))
    return np.array(counts), np.array(gradients)


@pytest.fixture(scope="module")
def step_noises():
    return count_and_gradient_noise()


def test_the_count_of_unclipped_units_gets_its_whole_noise(step_noises):
    """sigma_b is charged (the gradient's multiplier is lowered by it): the
    count's noise must have it. Halved, the std below is 0.5."""
    counts, gradients = step_noises
    assert 0.85 < float(np.std(counts)) < 1.15
    assert 0.85 < float(np.std(gradients)) < 1.15  # control: the gradients' unit normals


def test_the_count_noise_is_its_own_stream_not_a_gradients(step_noises):
    """Seeded on the gradient noise's stream 0, the count's normal repeats a
    gradient coordinate's (correlation 1): one noise would pay twice. Their
    squares are compared too (a shared radius with another angle)."""
    counts, gradients = step_noises
    correlations = [abs(np.corrcoef(f(counts), f(gradients[:, i]))[0, 1])
                    for i in range(2) for f in (np.asarray, np.square)]
    assert max(correlations) < 0.3, correlations


def _noise_of_a_shrinking_step(physical_batch_size):
    """(std of the gradient noise on the sum, C_{t+1}) of one step from C_t = 1
    whose every unit is unclipped at target 0.1: C_{t+1} is about C_t / 90."""
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((64,)), keras.layers.Dense(
        64, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=tfdp.optimizers.DPSGD(
        1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=3, target_unclipped_quantile=0.1,
        clip_learning_rate=5.0, clipped_count_stddev=COUNT_STDDEV), loss="mse")
    x = np.zeros((64, 64), np.float32)  # gradients 0: the update is the noise alone
    history = model.fit(x, x, batch_size=16, epochs=1, steps_per_epoch=1, verbose=0,
                        physical_batch_size=physical_batch_size)
    std = float(np.std(model.layers[0].kernel.numpy())) * 16  # lr 1, divided by b = 16
    return std, history.history["clip_norm"][-1]


def test_a_step_that_shrinks_the_clip_norm_is_noised_at_the_old_one():
    """The noise reads C_t before C_{t+1} is assigned (privatize): noised at
    C_{t+1} = C_t / 90 the sum's noise would be 90x too small."""
    variable = tf.Variable(tf.zeros([4000]))
    optimizer = adaptive_optimizer([variable], clip_learning_rate=5.0)
    batch = 16
    per_example = PerExampleGradients(
        [variable], [MaterializedGrads([variable], [tf.fill([batch, 4000], 1e-6)])])
    info = {"mask": tf.ones([batch]), "expected_batch_size": tf.constant(float(batch))}
    sigma_grad = (1.0 - (2 * COUNT_STDDEV) ** -2) ** -0.5
    grads, released = optimizer.privatize(per_example, info)
    assert float(released["clip_norm"]) < 0.02  # it shrank, from C_t = 1
    assert float(np.std(grads[0].numpy())) * batch == pytest.approx(sigma_grad, rel=0.1)


def test_a_step_in_physical_batches_that_shrinks_the_clip_norm_is_noised_at_the_old_one():
    std, new = _noise_of_a_shrinking_step(physical_batch_size=4)
    sigma_grad = (1.0 - (2 * COUNT_STDDEV) ** -2) ** -0.5
    assert new < 0.02
    assert std == pytest.approx(sigma_grad, rel=0.1)


def test_an_unseeded_noise_key_has_64_secret_bits_a_word():
    """Each of the key's two words is a full 64-bit draw: across 256 keys
    every 16-bit quarter of a word takes about 256 values (a key with 16
    secret bits a word, sign-extended or zero-padded, repeats its upper
    quarters: at most 2 values each)."""
    words = np.stack([dp_optimizer._noise_key(None) for _ in range(256)]).view(np.uint64)
    assert words.shape == (256, 2)
    for column in range(2):
        quarters = [(words[:, column] >> np.uint64(16 * q)) & np.uint64(0xFFFF) for q in range(4)]
        assert all(len(set(part.tolist())) > 240 for part in quarters)
        assert all(np.mean(quarters[a] == quarters[b]) < 0.05
                   for a in range(4) for b in range(a + 1, 4))
    assert len({tuple(key) for key in words.tolist()}) == 256
    optimizer = tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0)
    other = tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0)
    assert not set(optimizer._noise_key.tolist()) & set(other._noise_key.tolist())
    # control: a seeded key is reproducible
    np.testing.assert_array_equal(dp_optimizer._noise_key(5), dp_optimizer._noise_key(5))
