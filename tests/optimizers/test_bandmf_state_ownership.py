"""A DP-BandMF noise state belongs to one run (issue 43, item 4).

Two runs that share a `noise_state` path overwrite each other's file and
`.prev`. A resume must then never continue the other run's noise history
(or, amplified, its secret record groups): the model records the stream
its steps ran (saved with its weights) and the file names the stream that
wrote it; a file of another stream is refused, naming both.
"""

import json

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


def pipeline(x, y, batch=8):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def classifier(optimizer, dim=6, seed=1):
    keras.utils.set_random_seed(seed)
    model = tfdp.DPSequential([keras.Input((dim,)), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


def bandmf_opt(**kwargs):
    return tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.5), 1.0, 1.0, bands=4, **kwargs)


def stream_id(path):
    meta, _, _ = bandmf_state.load(path)
    return meta["stream_id"]


def fit(model, mode, x, y, epochs=1):
    if mode == "fixed":
        model.fit(pipeline(x, y), epochs=epochs, verbose=0)
    else:
        model.fit(x, y, batch_size=8, epochs=epochs, steps_per_epoch=8, verbose=0)


@pytest.mark.parametrize("mode", ["fixed", "amplified"])
def test_a_resume_never_continues_another_runs_noise_state(tmp_path, mode):
    """Runs A and B share one path (the guide's own name in two tuning runs).
    B's two epochs leave B@16 in the file and B@8 in `.prev`: A's model at
    step 8 would find a state "at its step" in `.prev`, with the same
    settings and layout. Before the fix it continued B's noise history and,
    amplified, B's secret record groups."""
    x, y = data(n=64 if mode == "fixed" else 128)
    state = str(tmp_path / "noise_state.npz")
    run_a = classifier(bandmf_opt(noise_state=state))
    fit(run_a, mode, x, y)
    run_a.save(tmp_path / "a.keras")
    id_a = stream_id(state)
    run_b = classifier(bandmf_opt(noise_state=state))
    fit(run_b, mode, x, y)
    fit(run_b, mode, x, y)
    id_b = stream_id(state)
    assert id_b != id_a and stream_id(bandmf_state.previous_path(state)) == id_b

    resumed = tfdp.models.load_model(tmp_path / "a.keras")
    resumed.compile(optimizer=bandmf_opt(noise_state=state), loss=LOSS)
    with pytest.raises(ValueError) as refused:
        fit(resumed, mode, x, y)
    message = str(refused.value)
    assert "another run" in message and id_a in message and id_b in message
    assert state in message and "fresh_noise_history=True" in message
    assert "own noise_state path" in message
    assert resumed.privacy.steps == 8  # nothing ran


def test_a_run_resumes_its_own_previous_state_when_another_run_wrote_the_file(
        tmp_path, monkeypatch):
    """B's one epoch leaves B@8 in the file and A@8 in `.prev`: A resumes
    from its own `.prev`, with its own history (B's would be refused)."""
    x, y = data()
    state = str(tmp_path / "noise_state.npz")
    run_a = classifier(bandmf_opt(noise_state=state))
    fit(run_a, "fixed", x, y)
    run_a.save(tmp_path / "a.keras")
    id_a = stream_id(state)
    history_a = [h.numpy().copy() for h in run_a.optimizer._stream.history]
    run_b = classifier(bandmf_opt(noise_state=state))
    fit(run_b, "fixed", x, y)

    restored = []
    restore = bandmf_state.restore
    monkeypatch.setattr(bandmf_state, "restore", lambda stream, meta, history, fingerprints: (
        restored.append((meta["stream_id"], history)),
        restore(stream, meta, history, fingerprints)))
    resumed = tfdp.models.load_model(tmp_path / "a.keras")
    resumed.compile(optimizer=bandmf_opt(noise_state=state), loss=LOSS)
    fit(resumed, "fixed", x, y)
    ((restored_id, history),) = restored
    assert restored_id == id_a
    assert all(np.array_equal(a, b) for a, b in zip(history, history_a))
    assert resumed.privacy.steps == 16
    assert [e.count for e in resumed.privacy.composed_event().events] == [2]


def test_the_stream_is_recorded_in_the_weights_and_a_model_that_records_none_is_refused(tmp_path):
    """`save_weights` (what BackupAndRestore writes) carries the record; a
    weights file without one (an older tfdp's) cannot resume a stream."""
    x, y = data()
    state = str(tmp_path / "noise_state.npz")
    model = classifier(bandmf_opt(noise_state=state))
    fit(model, "fixed", x, y)
    model.save_weights(tmp_path / "a.weights.h5")
    lineage = model._noise_stream_record.lineage
    assert lineage[0] == [0, stream_id(state)]

    restored = classifier(bandmf_opt(noise_state=state))
    restored.load_weights(tmp_path / "a.weights.h5")
    assert restored._noise_stream_record.lineage == lineage
    fit(restored, "fixed", x, y)  # resumes: the record and the file agree
    assert restored.privacy.steps == 16

    older = classifier(bandmf_opt(noise_state=state))
    older.load_weights(tmp_path / "a.weights.h5")
    older._noise_stream_record.lineage = None  # as a file saved before the record
    with pytest.raises(ValueError, match="do not record which DP-BandMF noise stream"):
        fit(older, "fixed", x, y)


def test_a_state_file_that_names_no_run_is_refused(tmp_path):
    """A state file of an older tfdp (no lineage) cannot show whose it is."""
    x, y = data()
    state = str(tmp_path / "noise_state.npz")
    model = classifier(bandmf_opt(noise_state=state))
    fit(model, "fixed", x, y)
    model.save(tmp_path / "a.keras")
    with np.load(state) as saved:
        arrays = dict(saved)
    meta = json.loads(bytes(arrays["meta"]).decode("utf-8"))
    del meta["lineage"]
    meta["version"] = 2
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), np.uint8)
    np.savez(state, **arrays)
    resumed = tfdp.models.load_model(tmp_path / "a.keras")
    resumed.compile(optimizer=bandmf_opt(noise_state=state), loss=LOSS)
    with pytest.raises(ValueError, match="does not record which run wrote it"):
        fit(resumed, "fixed", x, y)
