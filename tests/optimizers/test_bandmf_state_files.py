"""The `noise_state` file around crashes and bad paths (issue 44, items 3-5).

- A path that cannot be written (a directory, an unwritable folder, "")
  is refused before the first step, with `noise_state` named; a directory
  or a file that is not tfdp's own is never renamed to `.prev`.
- A truncated, empty or bit-flipped state file is refused naming the file,
  not as a raw BadZipFile / EOFError.
- A save killed mid-write leaves its secret temporary file behind: the next
  save (or `fit`'s start) removes it.
"""

import os
import stat

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.optimizers import bandmf_state

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(n=64, dim=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def dataset():
    x, y = data()
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)


def classifier(noise_state, dim=6):
    keras.utils.set_random_seed(1)
    model = tfdp.DPSequential([keras.Input((dim,)), keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPBandMF(
        keras.optimizers.SGD(0.5), 1.0, 1.0, bands=4, noise_state=noise_state), loss=LOSS)
    return model


def refused_before_a_step(noise_state, match):
    model = classifier(noise_state)
    with pytest.raises((ValueError, OSError), match=match) as refused:
        model.fit(dataset(), epochs=1, verbose=0)
    assert model.privacy.steps == 0
    assert "noise_state" in str(refused.value)
    return refused.value


# -- item 3: the path is probed before the first step --------------------------------


def test_a_directory_is_refused_before_a_step_and_never_renamed(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "mine.txt").write_text("user data")
    refused_before_a_step(str(folder), "is a directory")
    assert (folder / "mine.txt").read_text() == "user data"
    assert not os.path.exists(str(folder) + ".prev")


def test_an_empty_path_is_refused_before_a_step(tmp_path):
    refused_before_a_step("", "noise_state")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_unwritable_folder_is_refused_before_a_step(tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        refused_before_a_step(str(folder / "state.npz"), "cannot be written")
    finally:
        folder.chmod(stat.S_IRWXU)


def test_an_unwritable_folder_is_refused_before_a_step_even_as_root(tmp_path, monkeypatch):
    """The probe is a real write: a folder where writing fails (simulated,
    since root writes anywhere) is refused before the first step."""
    real_open = os.open
    folder = str(tmp_path / "run")

    def failing_open(path, *args, **kwargs):
        if os.fspath(path).startswith(folder + os.sep):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, *args, **kwargs)

    os.makedirs(folder)
    monkeypatch.setattr(os, "open", failing_open)
    error = refused_before_a_step(os.path.join(folder, "state.npz"), "cannot be written")
    assert "Permission denied" in str(error)


def test_a_file_that_is_not_a_noise_state_is_never_replaced_or_renamed(tmp_path):
    path = tmp_path / "notes.npz"
    path.write_bytes(b"the user's own file")
    refused_before_a_step(str(path), "not a DP-BandMF noise state")
    assert path.read_bytes() == b"the user's own file"
    assert not os.path.exists(str(path) + ".prev")


def test_a_prev_that_is_not_tfdps_own_is_refused_before_a_step(tmp_path):
    path = tmp_path / "state.npz"
    model = classifier(str(path))
    model.fit(dataset(), epochs=1, verbose=0)
    os.remove(path)
    (tmp_path / "state.npz.prev").mkdir()
    refused_before_a_step(str(path), "state.npz.prev")


# -- item 4: a damaged file is named ---------------------------------------------------


def saved_state(tmp_path):
    path = str(tmp_path / "state.npz")
    model = classifier(path)
    model.fit(dataset(), epochs=1, verbose=0)
    model.save(tmp_path / "ckpt.keras")
    return path


@pytest.mark.parametrize("damage", ["empty", "truncated", "bit_flip"])
def test_a_damaged_state_file_is_refused_naming_it(tmp_path, damage):
    path = saved_state(tmp_path)
    content = bytearray(open(path, "rb").read())
    if damage == "empty":
        content = b""
    elif damage == "truncated":
        content = content[: len(content) // 2]
    else:
        index = content.index(b"history_0") + 200  # inside the history array's bytes
        content[index] ^= 0x10
    with open(path, "wb") as file:
        file.write(bytes(content))
    with pytest.raises(ValueError, match="Cannot read the DP-BandMF noise state") as refused:
        bandmf_state.load(path)
    assert path in str(refused.value) and "noise_state" in str(refused.value)
    resumed = tfdp.models.load_model(tmp_path / "ckpt.keras")
    resumed.compile(optimizer=tfdp.optimizers.DPBandMF(
        keras.optimizers.SGD(0.5), 1.0, 1.0, bands=4, noise_state=path), loss=LOSS)
    with pytest.raises(ValueError, match="Cannot read the DP-BandMF noise state"):
        resumed.fit(dataset(), epochs=1, verbose=0)
    assert resumed.privacy.steps == 8


# -- item 5: leftovers of a killed save are removed --------------------------------------


def test_a_killed_saves_temporary_file_is_removed_at_the_next_save(tmp_path, monkeypatch):
    path = str(tmp_path / "state.npz")
    model = classifier(path)
    model.fit(dataset(), epochs=1, verbose=0)

    class Killed(BaseException):
        pass

    def killed_replace(source, target):  # the process dies before the rename
        raise Killed()

    leftovers = []
    monkeypatch.setattr(os, "replace", killed_replace)
    monkeypatch.setattr(os, "remove", lambda p: leftovers.append(p))  # SIGKILL: no cleanup
    with pytest.raises(Killed):
        model.optimizer.save_noise_state()
    monkeypatch.undo()
    assert len([f for f in os.listdir(tmp_path) if f not in ("state.npz", "state.npz.prev")]) == 1
    (tmp_path / "unrelated.tmp").write_text("not tfdp's")
    model.optimizer.save_noise_state()
    assert sorted(os.listdir(tmp_path)) == ["state.npz", "unrelated.tmp"]


@pytest.mark.parametrize("kind", ["fifo", "broken link"])
def test_a_path_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path, kind):
    """A FIFO at the noise_state path blocked fit forever (its read waits for a
    writer; found by review); a broken link is not a file of tfdp's either."""
    path = str(tmp_path / "noise.npz")
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(str(tmp_path / "missing"), path)
    refused_before_a_step(path, "is not a regular file")


# -- issue 55, item 7: a noise_state path that is a symbolic link -------------------------


def test_a_symbolic_link_is_followed_and_the_secrets_stay_where_it_points(tmp_path):
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    model = classifier(str(secrets / "state.npz"))
    model.fit(dataset(), epochs=1, verbose=0)  # the file exists: now link to it
    link = run / "noise_state.npz"
    link.symlink_to(secrets / "state.npz")
    model.compile(optimizer=tfdp.optimizers.DPBandMF(
        keras.optimizers.SGD(0.5), 1.0, 1.0, bands=4, noise_state=str(link)), loss=LOSS)
    model.fit(dataset(), epochs=2, verbose=0)  # resumes through the link, saves twice
    assert model.privacy.steps == 24
    assert link.is_symlink() and os.readlink(link) == str(secrets / "state.npz")
    assert sorted(os.listdir(run)) == ["noise_state.npz"]  # no regular file beside the link
    assert sorted(os.listdir(secrets)) == ["state.npz", "state.npz.prev"]
    meta, _, _ = bandmf_state.load(str(link))
    assert meta["start"] + meta["steps"] == 24
