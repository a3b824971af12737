"""A crash while saving never destroys the file being replaced (issue 25, item 7).

Keras writes in place: a SIGKILL during `model.save()` over a good `.keras`
file left a truncated one in 4 of 4 trials. tfdp's models write to a
temporary file and rename it; a save that dies part-way leaves the old file.
"""

import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

import tfdp


def _model():
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _dies_half_way(self, filepath, *args, **kwargs):
    with open(filepath, "wb") as f:  # as a kill mid-write leaves it
        f.write(b"PK\x03\x04 truncated")
    raise KeyboardInterrupt("killed mid-write")


@pytest.mark.parametrize("method, name", [("save", "m.keras"), ("save_weights", "m.weights.h5")])
def test_a_save_that_dies_half_way_leaves_the_old_file(tmp_path, monkeypatch, method, name):
    model = _model()
    path = tmp_path / name
    getattr(model, method)(path)
    good = path.read_bytes()
    monkeypatch.setattr(keras.Model, method, _dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        getattr(model, method)(path)
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == [name]  # no temporary file left behind


def test_model_checkpoint_writes_through_the_atomic_save(tmp_path, monkeypatch):
    model = _model()
    path = tmp_path / "last.keras"
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    y = np.arange(32) % 3
    checkpoint = keras.callbacks.ModelCheckpoint(str(path))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[checkpoint])
    good = path.read_bytes()
    monkeypatch.setattr(keras.Model, "save", _dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[checkpoint])
    assert path.read_bytes() == good
    monkeypatch.undo()
    assert tfdp.load_model(path)._read_dp_steps() == 4  # the first fit's 4 steps


def test_load_model_right_after_import_tfdp(tmp_path):
    path = tmp_path / "m.keras"
    _model().save(path)
    code = ("import sys, tfdp; m = tfdp.load_model(sys.argv[1]); "
            "print(type(m).__name__, m.privacy.epsilon(1e-5))")
    root = pathlib.Path(tfdp.__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                            text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["DPSequential", "0.0"]


@pytest.mark.parametrize("method, name", [("save", "m.keras"), ("save_weights", "m.weights.h5")])
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask022", "umask027"])
def test_a_new_file_gets_the_mode_a_plain_keras_save_gives(tmp_path, method, name, umask, mode):
    """0o666 less the umask, as Keras's own open() gives it (the temporary
    file of `tempfile.mkstemp` left 0o600: unreadable by another user or
    group, e.g. a serving process). A plain Keras save is the control."""
    model = _model()
    previous = os.umask(umask)
    try:
        getattr(model, method)(tmp_path / name)
        getattr(keras.Model, method)(model, tmp_path / f"plain.{name}")
    finally:
        os.umask(previous)
    assert oct((tmp_path / f"plain.{name}").stat().st_mode & 0o777) == oct(mode)
    assert oct((tmp_path / name).stat().st_mode & 0o777) == oct(mode)


@pytest.mark.parametrize("method, name", [("save", "m.keras"), ("save_weights", "m.weights.h5")])
def test_replacing_a_file_keeps_its_mode(tmp_path, method, name):
    model = _model()
    path = tmp_path / name
    getattr(model, method)(path)
    os.chmod(path, 0o640)
    previous = os.umask(0o022)  # a new file would get 0o644
    try:
        getattr(model, method)(path)
    finally:
        os.umask(previous)
    assert oct(path.stat().st_mode & 0o777) == oct(0o640)
    assert os.listdir(tmp_path) == [name]


KILLED_MID_SAVE = """
import os, signal, sys
import keras
import tfdp

def killed_mid_write(self, filepath, *args, **kwargs):
    with open(filepath, "wb") as f:
        f.write(b"PK\\x03\\x04 half a file")
    os.kill(os.getpid(), signal.SIGKILL)

model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
setattr(keras.Model, sys.argv[2], killed_mid_write)
getattr(model, sys.argv[2])(sys.argv[1])
"""


@pytest.mark.parametrize("method, name", [("save", "m.keras"), ("save_weights", "m.weights.h5")])
def test_the_next_save_removes_what_a_killed_save_left(tmp_path, method, name):
    """Each SIGKILL during a save left a `.<name>.<hex>.tmp<ending>` file that
    nothing removed (the old code); the next save of that path removes them,
    and only them."""
    root = pathlib.Path(tfdp.__file__).resolve().parents[1]
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(tmp_path / name), method],
                            capture_output=True, timeout=300, cwd=root)
    assert killed.returncode == -9, killed.stderr[-2000:]
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(f".{name}."), leftovers
    others = [".other.keras.0123456789ab.tmp.keras", f".{name}.notours.tmp.keras", "notes.txt"]
    for other in others:
        (tmp_path / other).write_text("not tfdp's leftover of this path")

    model = _model()
    getattr(model, method)(tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others + [name])
    if method == "save":
        assert tfdp.load_model(tmp_path / name).privacy.steps == 0
    else:
        model.load_weights(tmp_path / name)


def test_a_save_running_elsewhere_keeps_its_temporary_file(tmp_path):
    """While another save holds the folder (its shared lock), the leftovers
    stay; the next save without one removes them."""
    import fcntl

    model = _model()
    leftover = tmp_path / ".m.keras.00112233aabb.tmp.keras"
    leftover.write_bytes(b"another process is writing this")
    other = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(other, fcntl.LOCK_SH)  # as a save in another process holds it
        model.save(tmp_path / "m.keras")
        assert leftover.exists()
    finally:
        os.close(other)
    model.save(tmp_path / "m.keras")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.keras"]
