"""What a private search must not leak: a record's effect on others' split,
the number of trials (names, logs, tracebacks), batch-mixing scores."""

import os
import re
import subprocess
import tempfile
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops

pytest.importorskip("keras_tuner")

import tfdp  # noqa: E402
from tfdp.tuning import PrivateRandomSearch, hiding, process, scores  # noqa: E402
from tfdp.tuning import search as search_module  # noqa: E402


def _build(hp, learning_rate=None):
    model = tfdp.DPSequential([keras.Input((1,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(
            learning_rate or hp.Float("learning_rate", 0.05, 0.5), l2_norm_clip=1.0,
            noise_multiplier=1.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(n):
    ids = np.arange(n)
    return ids[:, None].astype("float32"), (ids % 2).astype("int32")


def _regression(hp):
    model = tfdp.DPSequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(hp.Fixed("learning_rate", 0.1), l2_norm_clip=1.0,
                                                  noise_multiplier=1.5), loss="mse")
    return model


def _sides(monkeypatch, num_records, split=None):
    """(training ids, validation ids) of one trial on records 0..n-1, with
    the search's randomness fixed (the same seed for D and D + z): the ids
    its fit was given and those its score saw. The fit only records (the
    split is drawn before it: training, a DP step's trace and most of the
    search's time, moves no record across it), so the search ends at its
    charge, refused for a ledger that ran no step."""
    real = np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng", lambda seed=None: real(1234))
    if split is not None:
        monkeypatch.setattr(search_module._Validation, "split", split)
    seen = {"val": set()}
    fit = tfdp.DPSequential.fit

    def spy_fit(self, x, y, **kwargs):
        weights = kwargs.get("sample_weight")
        weights = np.ones(len(x)) if weights is None else np.asarray(weights)
        seen["train"] = {int(v) for v, w in zip(x[:, 0], weights) if w > 0}

    def score(y_true, y_pred):
        seen["val"].update(int(v) for v in np.ravel(y_true))
        return np.zeros(len(y_true))

    monkeypatch.setattr(tfdp.DPSequential, "fit", spy_fit)
    ids = np.arange(num_records).astype("float32")
    tuner = PrivateRandomSearch(_regression, mean_trials=1, score=score)
    with pytest.raises(ValueError, match="this ledger has run no step"):
        tuner.search(ids[:, None], ids, batch_size=10, epochs=1, validation_split=0.3)
    monkeypatch.setattr(tfdp.DPSequential, "fit", fit)
    return seen["train"], seen["val"]


def _others_moved(monkeypatch, split=None):
    """Records of D whose side changed when z = record n was added."""
    n = 40
    train, val = _sides(monkeypatch, n, split)
    train_z, val_z = _sides(monkeypatch, n + 1, split)
    assert train | val == set(range(n)) and train_z | val_z == set(range(n + 1))
    return (train ^ (train_z - {n})) | (val ^ (val_z - {n}))


def _exact_size_split(self, rng):  # the reviewed code: round(f * N) records by permutation
    x, y = self._x, self._y
    order = rng.permutation(len(x))
    val, train = order[:round(0.3 * len(x))], order[round(0.3 * len(x)):]
    return (x[train], y[train], None), (x[val], y[val])


def test_adding_a_record_moves_no_other_record_across_the_split(trials, monkeypatch):
    trials(1)
    # An exact-size split let z replace a training record (2x the bound).
    assert _others_moved(monkeypatch) == set()
    # Negative control: the exact-size split moves other records.
    assert _others_moved(monkeypatch, split=_exact_size_split)


def _function_numbers(model, folder):
    """The numbers TensorFlow's uid counter gave the functions of an export."""
    model.export(str(folder), verbose=False)
    graph = (folder / "saved_model.pb").read_bytes()
    return sorted({int(n) for n in re.findall(rb"__inference_[A-Za-z_]+?_(\d+)", graph)})


def _counted(unique_id, start):
    """A variable's unique id ('<name>_<uid>') with its uid read from `start`."""
    name, uid = unique_id.rsplit("_", 1)
    return name, int(uid) - start


def _released(tuner, trials, tmp_path, count):
    """Everything the process holds after a search with `count` trials, with
    TensorFlow's process-wide uid counter read relative to its value before."""
    keras.backend.clear_session()
    trials(count)
    x, y = _data(40)
    start = ops.uid()
    tuner.search(x, y, batch_size=20, epochs=1, validation_split=0.25)
    model = tuner.get_best_models()[0]
    model.predict(x[:4], verbose=0)  # the user's next calls: no count in their warnings
    return dict(
        config=model.to_json(), paths=[v.path for v in model.variables],
        optimizer=[model.optimizer.name] + [v.path for v in model.optimizer.variables],
        layer_after=keras.layers.Dense(1).name,
        variable_ids=[_counted(v.value._unique_id, start) for v in model.variables],
        exported=[n - start for n in _function_numbers(model, tmp_path / f"export{count}")],
        variable_after=_counted(tf.Variable(0.0)._unique_id, start),
        history=model.history,
        metrics=[float(v) for metric in model.metrics for v in metric.variables],
        events=model.privacy.composed_event().events)


def test_nothing_the_search_leaves_counts_the_trials(in_child, trials, capfd, tmp_path):
    """Names, logs, TensorFlow's uid counter (exported function names, later
    variables' ids, the chosen model's variables' build order): the same
    after 1 trial as after 6 (6 traces: TensorFlow's retracing warning)."""
    keras.ops.zeros(1)  # TensorFlow's one-time device messages, before the comparison
    capfd.readouterr()
    tuner = PrivateRandomSearch(lambda hp: _build(hp, hp.Fixed("learning_rate", 0.1)),
                                mean_trials=3)
    one = _released(tuner, trials, tmp_path, 1)
    output = capfd.readouterr()
    six = _released(tuner, trials, tmp_path, 6)
    assert capfd.readouterr() == output
    histories = one.pop("history"), six.pop("history")
    (search,) = one.pop("events")
    assert six.pop("events") == [search, search.event]  # a rerun pays for the first too
    assert one == six
    # The chosen model's training metrics counted the held-out rows: cleared.
    assert histories == (None, None) and not any(one["metrics"])


def _frames(error):
    seen = []
    while error is not None:
        tb = error.__traceback__
        while tb is not None:
            seen.append(tb.tb_frame)
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    return seen


def _holds(value, kind, depth=0):
    if isinstance(value, kind):
        return True
    if depth < 3 and isinstance(value, (list, tuple, set, dict)):
        items = value.values() if isinstance(value, dict) else value
        return any(_holds(item, kind, depth + 1) for item in items)
    return False


def test_an_interrupted_search_leaks_neither_models_nor_the_trial_count(trials, monkeypatch):
    trials(7)
    fits = []
    fit = tfdp.DPSequential.fit

    def interrupted_fit(self, *args, **kwargs):
        fits.append(1)
        if len(fits) == 2:
            raise KeyboardInterrupt("stopped by the user")  # Ctrl-C in trial 2
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(tfdp.DPSequential, "fit", interrupted_fit)
    tuner = PrivateRandomSearch(_build, mean_trials=3)
    with pytest.raises(KeyboardInterrupt, match="stopped by the user") as info:
        tuner.search(*_data(40), batch_size=20, epochs=1, validation_split=0.25)
    frames = _frames(info.value)
    assert frames
    for frame in frames:
        for name, value in frame.f_locals.items():
            assert not _holds(value, keras.Model), (frame.f_code.co_name, name)
            assert not (type(value) is int and value == 7), (frame.f_code.co_name, name)
            assert not (isinstance(value, list) and len(value) == 7), (frame.f_code.co_name, name)
    with pytest.raises(ValueError, match="released no model"):
        tuner.get_best_models()
    # Retrying until a search releases a model would change the law of K: refused.
    with pytest.raises(ValueError, match="refuses another search"):
        tuner.search(*_data(40), batch_size=20, epochs=1, validation_split=0.25)


def test_a_score_sees_one_example_at_a_time():
    def mixing(y_true, y_pred):  # every example scores 1 when the batch holds label 9
        return np.full(len(y_true), float(np.any(np.ravel(y_true) == 9)))

    y_pred = np.zeros((5, 2))
    without = scores.per_example(mixing, np.array([0, 1, 0, 1, 0]), y_pred)
    with_z = scores.per_example(mixing, np.array([0, 1, 0, 1, 9]), y_pred)
    assert without[:4].tolist() == with_z[:4].tolist()
    with pytest.raises(ValueError, match=r"one value per example.*Received: shape \(\)"):
        scores.per_example(lambda t, p: np.mean(t == p.argmax(-1)), np.array([0, 1]),
                           np.zeros((2, 2)))


class _MixesAtInference(keras.layers.Layer):
    def call(self, x, training=None):
        return x if training else x + keras.ops.mean(x, axis=0, keepdims=True)


def test_predictions_are_made_one_example_at_a_time():
    model = keras.Sequential([keras.Input((2,)), _MixesAtInference()])
    x = np.arange(8, dtype="float32").reshape(4, 2)
    z = np.array([[1e6, -1e6]], dtype="float32")
    alone = scores.predict_each(model, x)
    assert np.array_equal(alone, scores.predict_each(model, np.concatenate([x, z]))[:4])
    assert np.array_equal(alone, 2 * x)


class _Overflows(keras.layers.Layer):
    """A weightless layer that fails when the trial runs: an index out of
    range (an assertion, check_numerics, is refused before the step)."""

    def call(self, x):
        return x + tf.gather(x, [7], axis=1)


def _overflowing(hp):
    model = tfdp.DPSequential([keras.Input((1,)), keras.layers.Dense(2), _Overflows()])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(hp.Float("learning_rate", 0.05, 0.5), l2_norm_clip=1.0,
                                        noise_multiplier=1.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    return model


def test_a_failing_trial_reports_its_type_and_nothing_that_counts_the_trials(in_child, trials):
    # TensorFlow's message names the traced function by a uid that all 6 builds advanced.
    trials(6)
    tuner = PrivateRandomSearch(_overflowing, mean_trials=3)
    with pytest.raises(RuntimeError) as info:
        tuner.search(
            *_data(40), batch_size=20, epochs=1, validation_split=0.25)
    assert str(info.value) == (
        "InvalidArgumentError: A trial of the private search failed with "
        "InvalidArgumentError; its message is withheld because it can reveal how many trials "
        "ran. " + process._HINT)
    assert info.value.__cause__ is None and info.value.__context__ is None
    with pytest.raises(ValueError, match="refuses another search"):
        tuner.search(*_data(40), batch_size=20, epochs=1, validation_split=0.25)


def test_what_the_child_reports_of_an_error():
    drawn = types.SimpleNamespace(count_drawn=True)
    failure = process._failure(ZeroDivisionError("trial 5 of 6"), drawn)
    withheld = process._error_of(failure)
    assert type(withheld) is ZeroDivisionError and "5" not in str(withheld)
    assert failure["drawn"] is True  # the parent's tuner then refuses a retry
    # Kept: the search's own refusals, and anything raised before K was drawn.
    refused = process._error_of(process._failure(hiding.Refusal("sigma varies"), drawn))
    assert type(refused) is ValueError and str(refused) == "sigma varies"
    before = types.SimpleNamespace(count_drawn=False)
    failure = process._failure(TypeError("bad build"), before)
    kept = process._error_of(failure)
    assert type(kept) is TypeError and str(kept) == "bad build" and failure["drawn"] is False


def test_ctrl_c_ends_the_child_and_removes_its_files(in_child, trials, monkeypatch):
    started, folders = [], []
    popen, mkdtemp = subprocess.Popen, tempfile.mkdtemp

    class Interrupted(popen):
        def wait(self, timeout=None):
            if not started:  # Ctrl-C while the child runs the trials
                started.append(self)
                raise KeyboardInterrupt
            return super().wait(timeout)

    def recorded(**kwargs):
        folders.append(mkdtemp(**kwargs))
        return folders[-1]

    monkeypatch.setattr(subprocess, "Popen", Interrupted)
    monkeypatch.setattr(tempfile, "mkdtemp", recorded)
    tuner = PrivateRandomSearch(_build, mean_trials=3)
    with pytest.raises(KeyboardInterrupt):
        tuner.search(*_data(40), batch_size=20, epochs=1, validation_split=0.25)
    assert started[0].returncode is not None  # killed, not left running
    assert not os.path.exists(folders[0])  # the pickled data and trials are gone
    with pytest.raises(ValueError, match="released no model"):  # it may have drawn K
        tuner.get_best_models()
