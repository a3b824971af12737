"""tfdp.per_example.validate: every refusal and slow path in one report."""

import json

import keras
import numpy as np
import pytest

import tfdp
from tfdp import cli

L = keras.layers


def _sgd():
    return tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0)


def _bn_model():
    inputs = keras.Input((4,))
    h = L.BatchNormalization(name="bn")(L.Dense(8)(inputs))
    return tfdp.DPModel(inputs, L.Dense(2)(h))


def test_every_refusal_is_listed_at_once_with_its_reason_and_fix():
    inputs = keras.Input((3, 4), batch_size=2)
    h = L.LSTM(4, stateful=True, name="memory")(inputs)
    h = L.BatchNormalization(name="bn")(h)
    model = tfdp.DPModel(inputs, L.Dense(2)(h))
    report = tfdp.per_example.validate(model, loss=["mse", "mae"], optimizer=keras.optimizers.SGD(),
                                       run_eagerly=True)
    subjects = [f.subject for f in report.refused]
    assert subjects == ["layer 'memory' (LSTM)", "layer 'bn' (BatchNormalization)", "loss",
                        "optimizer", "setting run_eagerly"], subjects
    assert not report.ok and all(f.reason and f.fix for f in report.findings)
    assert "stateful=False" in report.refused[0].reason
    assert "training=False" in report.refused[1].fix
    text = str(report)
    assert text.startswith("fit would refuse this model: 5 refused") and "5. [refused]" in text


def test_slow_paths_are_listed_and_do_not_fail_the_model():
    inputs = keras.Input((4,))
    h = L.PReLU(name="prelu")(L.Dense(8)(inputs))
    model = tfdp.DPModel(inputs, L.Dense(2)(h))
    report = tfdp.per_example.validate(model, loss=lambda y, p: keras.ops.sum(p, -1), optimizer=_sgd())
    assert report.ok
    assert [f.subject for f in report.slow] == ["layer 'prelu' (PReLU)", "loss"]

    h = L.Lambda(lambda t: t * 2, name="doubt")(L.Dense(8)(inputs))
    vectorized = tfdp.DPModel(inputs, L.Dense(2)(h))
    [finding] = tfdp.per_example.validate(vectorized).slow
    assert finding.subject == "model" and "'doubt' (Lambda)" in finding.reason


def test_insisting_on_the_batched_path_turns_the_fallback_into_a_refusal():
    inputs = keras.Input((4,))
    h = L.Lambda(lambda t: t * 2, name="doubt")(inputs)
    model = tfdp.DPModel(inputs, L.Dense(2)(h), per_example_gradients="batched")
    [finding] = tfdp.per_example.validate(model).refused
    assert finding.subject == "model"


def test_a_clean_compiled_model_has_no_findings():
    inputs = keras.Input((4,))
    model = tfdp.DPModel(inputs, L.Dense(2)(inputs))
    model.compile(optimizer=_sgd(), loss="mse")
    report = tfdp.per_example.validate(model)
    assert report.ok and report.findings == []
    assert "fit accepts this model: 0 refused, 0 slow" in str(report)


def test_a_train_step_override_and_a_plain_keras_model_are_refused():
    class Custom(tfdp.DPSequential):
        def train_step(self, data):
            return super().train_step(data)

    model = Custom([keras.Input((4,)), L.Dense(2)])
    assert [f.subject for f in tfdp.per_example.validate(model).refused] == ["model"]
    plain = keras.Sequential([keras.Input((4,)), L.Dense(2)])
    assert "not a tfdp model" in tfdp.per_example.validate(plain).refused[0].reason


def test_per_example_path_says_fit_refuses_what_fit_refuses():
    model = _bn_model()
    assert "but fit refuses layer 'bn' (BatchNormalization)" in model.per_example_path
    model.compile(optimizer=_sgd(), loss="mse")
    with pytest.raises(ValueError, match="'bn'"):
        model.fit(np.ones((8, 4), "float32"), np.zeros((8, 2), "float32"), batch_size=4,
                  steps_per_epoch=1, verbose=0)


def test_the_cli_prints_the_report_and_fails_on_a_refusal(tmp_path, capsys):
    path = str(tmp_path / "bn.keras")
    _bn_model().save(path)
    with pytest.raises(SystemExit) as exited:
        cli.main(["validate", path])
    assert exited.value.code == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["findings"][0]["subject"] == "layer 'bn' (BatchNormalization)"


def test_a_batch_normalization_called_in_inference_mode_or_frozen_is_accepted():
    inputs = keras.Input((4,))
    h = L.BatchNormalization()(L.Dense(8)(inputs), training=False)
    frozen = L.BatchNormalization()
    frozen.trainable = False
    model = tfdp.DPModel(inputs, L.Dense(2)(frozen(h)))
    assert tfdp.per_example.validate(model, loss="mse").ok
    assert "fit refuses" not in model.per_example_path


def test_several_outputs_are_refused_at_compile_with_the_way_round():
    inputs = keras.Input((4,))
    h = L.Dense(8)(inputs)
    model = tfdp.DPModel(inputs, [L.Dense(2, name="kind")(h), L.Dense(1, name="size")(h)])
    with pytest.raises(ValueError, match=r"2 outputs .*Concatenate\(\)\(\[head_a, head_b\]\)"):
        model.compile(optimizer=_sgd(), loss="mse")
    [finding] = tfdp.per_example.validate(model, loss="mse").refused
    assert finding.subject == "model" and "Several outputs" in finding.reason


def test_text_inputs_are_refused_only_when_no_layer_of_the_model_reads_text():
    words = keras.Input((), dtype="string")
    lookup = keras.layers.StringLookup(vocabulary=["a", "b"], name="words")
    reads = tfdp.DPModel(words, keras.layers.Dense(2)(keras.ops.one_hot(lookup(words), 3)))
    assert not [f for f in tfdp.per_example.validate(reads).refused
                if f.subject.startswith("input")]
    raw = keras.Input((), dtype="string")
    hashed = keras.ops.one_hot(keras.layers.Hashing(3)(raw), 3)  # strings, but no text layer
    ignores = tfdp.DPModel(raw, keras.layers.Dense(2)(hashed))
    assert [f for f in tfdp.per_example.validate(ignores).refused
            if f.subject.startswith("input")]
