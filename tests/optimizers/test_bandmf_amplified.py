"""DPBandMF's amplified mode: `fit` on arrays samples cyclically (each record
in one secret group, step t Poisson-samples group t mod b only). One band is
DP-SGD exactly; the groups' activity pattern and inclusion rates; the groups
survive a resume; the expected batch size is checked."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.data.cyclic_poisson import CyclicPoissonSampler, record_groups
from tfdp.data.poisson import PoissonSampler
from tfdp.data.sampling import sampling_key
from tfdp.optimizers import bandmf as bandmf_module

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(n=256, dim=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def classifier(optimizer, dim=6, seed=1):
    keras.utils.set_random_seed(seed)
    model = tfdp.DPSequential([keras.Input((dim,)), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


def bandmf_opt(bands=4, seed=0, **kwargs):
    return tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.5), 1.0, 1.0, bands=bands,
                                    seed=seed, **kwargs)


def test_one_band_through_fit_is_dp_sgd_update_for_update_and_in_epsilon():
    x, y = data()
    sgd = classifier(tfdp.optimizers.DPOptimizer(keras.optimizers.SGD(0.5), 1.0, 1.0, seed=3))
    sgd.fit(x, y, batch_size=16, epochs=2, verbose=0)
    band = classifier(bandmf_opt(bands=1, seed=3))
    band.fit(x, y, batch_size=16, epochs=2, verbose=0)
    # the same seed gives the same Poisson draws and the same noise: the same model
    np.testing.assert_array_equal(band.layers[0].kernel.numpy(), sgd.layers[0].kernel.numpy())
    assert band.privacy.steps == sgd.privacy.steps == 32
    assert band.privacy.epsilon(1e-5) == sgd.privacy.epsilon(1e-5)
    assert band.privacy.relation == "add_or_remove"
    # negative control: another seed (other draws and noise) is told apart
    other = classifier(bandmf_opt(bands=1, seed=4))
    other.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert np.max(np.abs(other.layers[0].kernel.numpy() - sgd.layers[0].kernel.numpy())) > 1e-3


def test_more_bands_charge_one_dp_sgd_step_per_round_of_b_steps():
    x, y = data()
    model = classifier(bandmf_opt(bands=4))
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=10, verbose=0)
    (event,) = model.privacy.composed_event().events
    q = 16 * 4 / 256
    assert event.count == 3  # ceil(10 / 4)
    assert event.event == tfdp.accounting.dpsgd_event(1.0, q)
    expected = tfdp.accounting.bandmf.amplified_epsilon(1.0, 10, 4, q, 1e-5)
    assert model.privacy.epsilon(1e-5) == pytest.approx(expected, rel=1e-12)


def draws_of(sampler, steps, key_seed=0):
    """The real records of each step's draw, as sets."""
    key = sampling_key(key_seed)
    out = []
    for step in steps:
        draw = sampler.draw(key, step)
        out.append(draw["indices"].numpy()[draw["mask"].numpy() == 1])
    return out


def test_a_records_group_is_active_exactly_every_b_steps():
    n, bands, start = 600, 4, 5
    # q = 1: the active group is drawn whole, so the draws show the pattern exactly
    sampler = CyclicPoissonSampler(n, n // bands, bands, sampling_key(1), stream_start=start,
                                   seed=0)
    assert sampler.sampling_probability == 1.0
    groups = sampler.groups
    steps = list(range(start, start + 3 * bands))
    for step, drawn in zip(steps, draws_of(sampler, steps)):
        active = (step - start) % bands
        np.testing.assert_array_equal(np.sort(drawn), np.flatnonzero(groups == active))
    # every record has a group, and any b consecutive steps draw each record once
    counts = np.zeros(n, int)
    for drawn in draws_of(sampler, range(start + 2, start + 2 + bands)):
        counts[drawn] += 1
    assert (counts == 1).all()
    # the groups are uniform and independent of the record (chi-square, 3 dof,
    # 99.9% point 16.3)
    big = record_groups(sampling_key(2), 40000, bands)
    observed = np.bincount(big, minlength=bands)
    assert ((observed - 10000) ** 2 / 10000).sum() < 16.3
    # negative control: a plain Poisson sampler's draws break the pattern
    plain = PoissonSampler(n, n // bands, seed=0)
    drawn = draws_of(plain, [start])[0]
    assert set(groups[drawn]) != {0}


def inclusion_rates(sampler, groups, bands, steps):
    """(rate of a member of the active group, rate of a record outside it)."""
    inside = outside = inside_total = outside_total = 0
    for step, drawn in enumerate(draws_of(sampler, range(steps))):
        active = groups == step % bands
        mask = np.zeros(len(groups), bool)
        mask[drawn] = True
        inside += mask[active].sum()
        inside_total += active.sum()
        outside += mask[~active].sum()
        outside_total += (~active).sum()
    return inside / inside_total, outside / outside_total


def test_inclusion_rate_is_q_in_the_active_group_and_zero_outside():
    n, bands, batch, steps = 4000, 4, 250, 240
    sampler = CyclicPoissonSampler(n, batch, bands, sampling_key(3), seed=0)
    q = sampler.sampling_probability
    assert q == 0.25
    inside, outside = inclusion_rates(sampler, sampler.groups, bands, steps)
    # standard error of the inside rate: sqrt(q (1 - q) / (1000 * 240)) = 0.00088
    assert abs(inside - q) < 5 * 0.00088, inside
    assert outside == 0.0
    # the expected batch size is q N / b
    sizes = [len(d) for d in draws_of(sampler, range(100))]
    assert abs(np.mean(sizes) - batch) < 5 * np.sqrt(batch * (1 - q) / 100)
    # negative control: plain Poisson sampling at the same expected batch size
    # fails both checks
    plain = PoissonSampler(n, batch, seed=0)
    inside, outside = inclusion_rates(plain, sampler.groups, bands, steps)
    assert abs(inside - q) > 0.1 and outside > 0.05


def test_an_expected_batch_size_above_n_over_bands_is_refused_before_any_step():
    x, y = data()
    model = classifier(bandmf_opt(bands=8))
    with pytest.raises(ValueError, match=r"expected batch size.*batch_size <= N / bands = 32.*"
                                         r"Received: batch_size=64, bands=8, N=256"):
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert model.privacy.steps == 0


class CapturingSampler(CyclicPoissonSampler):
    made = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        CapturingSampler.made.append(self)


def test_a_resume_keeps_every_records_group(tmp_path, monkeypatch):
    monkeypatch.setattr(bandmf_module, "CyclicPoissonSampler", CapturingSampler)
    CapturingSampler.made = []
    x, y = data()
    state = str(tmp_path / "noise_state.npz")
    first = classifier(bandmf_opt(seed=9, noise_state=state))
    first.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=6, verbose=0)
    first.save(tmp_path / "ckpt.keras")
    groups = CapturingSampler.made[-1].groups.copy()

    def resumed(**kwargs):
        model = tfdp.models.load_model(tmp_path / "ckpt.keras")
        model.compile(optimizer=bandmf_opt(seed=None, **kwargs), loss=LOSS)
        model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=6, verbose=0)
        return model, CapturingSampler.made[-1]

    model, sampler = resumed(noise_state=state)  # unseeded: the groups come from the file
    np.testing.assert_array_equal(sampler.groups, groups)
    assert sampler.stream_start == 0
    (event,) = model.privacy.composed_event().events  # one stream: ceil(12 / 4) rounds
    assert event.count == 3
    # negative control: a new stream draws new groups (and is its own segment)
    model, sampler = resumed(fresh_noise_history=True)
    assert np.mean(sampler.groups != groups) > 0.5
    assert sampler.stream_start == 6
    assert [e.count for e in model.privacy.composed_event().events] == [2, 2]


def test_a_resume_on_other_data_is_refused(tmp_path):
    x, y = data()
    state = str(tmp_path / "noise_state.npz")
    model = classifier(bandmf_opt(noise_state=state))
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=4, verbose=0)
    model.save(tmp_path / "ckpt.keras")
    loaded = tfdp.models.load_model(tmp_path / "ckpt.keras")
    loaded.compile(optimizer=bandmf_opt(noise_state=state), loss=LOSS)
    with pytest.raises(ValueError, match="cyclic Poisson sampling of 256 records, expected batch "
                                         "size 16, this fit's cyclic Poisson sampling of 128"):
        loaded.fit(x[:128], y[:128], batch_size=16, epochs=1, verbose=0)
    assert loaded.privacy.steps == 4


@pytest.mark.parametrize("kind", ["memmap", "records"])
def test_memmaps_and_record_sources_train_as_the_arrays(tmp_path, kind):
    x, y = data()
    if kind == "memmap":
        np.save(tmp_path / "x.npy", x)
        np.save(tmp_path / "y.npy", y)
        args = (np.load(tmp_path / "x.npy", mmap_mode="r"), np.load(tmp_path / "y.npy", mmap_mode="r"))
    else:
        tfdp.data.write_records(tf.data.Dataset.from_tensor_slices((x, y)), str(tmp_path / "r"))
        args = (tfdp.data.read_records(str(tmp_path / "r")),)
    reference = classifier(bandmf_opt(seed=5))
    reference.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=8, verbose=0)
    model = classifier(bandmf_opt(seed=5))
    model.fit(*args, batch_size=16, epochs=1, steps_per_epoch=8, verbose=0)
    # the same groups, draws and noise, read from disk
    np.testing.assert_allclose(model.layers[0].kernel.numpy(), reference.layers[0].kernel.numpy(),
                               rtol=1e-6, atol=1e-7)
    assert model.privacy.epsilon(1e-5) == reference.privacy.epsilon(1e-5)
