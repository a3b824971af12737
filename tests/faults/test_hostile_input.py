"""Hostile input: the `tfdp` command, the accounting API and training data.

Any argument (NaN, inf, negative, zero, huge, wrong type) gets a clear error
or a correct answer, never a crash trace or a silently wrong epsilon.
Training rows with NaN/Inf never bypass clipping (MECHANISMS.md 0.1): they
contribute nothing, and are counted in the "nonfinite_examples" log.
Hypothesis runs derandomized (reproducible, stable run time).
"""

import contextlib
import io
import json
import math
import subprocess
import sys

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tfdp
from tfdp import accounting, cli
from tests.noiseless import NoiselessDPSGD

CLI = settings(max_examples=60, deadline=None, derandomize=True, database=None)
API = settings(max_examples=40, deadline=None, derandomize=True, database=None)
CALIBRATION = settings(max_examples=6, deadline=None, derandomize=True, database=None)

hostile_text = st.sampled_from(
    ["nan", "NaN", "inf", "-inf", "-1", "0", "0.0", "1e308", "1e400", "1e-320", "1e-300", "abc", "",
     "3.5", "99999999999999999999999", "0x10", "1_000", " 7", "-0", "1e-12", "2", "60000", "1e6"]
)


def run_cli(argv):
    """(exit code, stdout, stderr) of `tfdp ARGV`, run in-process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def check_clear_error_or_answer(code, out, err):
    assert "Traceback" not in out + err
    if code == 2:  # argparse's usage error or tfdp's "error:" line
        last = err.strip().splitlines()[-1]  # after argparse's usage lines, if any
        assert last.startswith("tfdp") and "error:" in last, err
        return None
    assert code == 0, (code, err)
    result = json.loads(out)
    assert isinstance(result["epsilon"], float) and result["epsilon"] >= 0.0
    assert not math.isnan(result["epsilon"])
    return result


EPSILON_ARGS = {"--num-examples": "60000", "--batch-size": "256", "--noise-multiplier": "1.1",
                "--epochs": "3", "--delta": "1e-5"}


@CLI
@given(field=st.sampled_from(sorted(EPSILON_ARGS)), value=hostile_text,
       accountant=st.sampled_from(["rdp", "pld", "xyz"]))
def test_tfdp_epsilon_on_hostile_arguments(field, value, accountant):
    args = dict(EPSILON_ARGS, **{field: value})
    argv = ["epsilon", "--accountant", accountant] + [a for pair in args.items() for a in pair]
    result = check_clear_error_or_answer(*run_cli(argv))
    if result is not None:  # the answer is the accountant's for the parsed settings
        n, b = int(args["--num-examples"]), int(args["--batch-size"])
        expected = accounting.compute_dpsgd_epsilon(
            n, b, float(args["--noise-multiplier"]), float(args["--epochs"]), float(args["--delta"]),
            accountant=accountant,
        )
        assert result["epsilon"] == pytest.approx(expected) or result["epsilon"] == expected


CALIBRATE_ARGS = {"--num-examples": "60000", "--batch-size": "256", "--epsilon": "3",
                  "--epochs": "3", "--delta": "1e-5"}


@CLI
@given(field=st.sampled_from(sorted(CALIBRATE_ARGS)), value=hostile_text)
def test_tfdp_calibrate_on_hostile_arguments(field, value):
    args = dict(CALIBRATE_ARGS, **{field: value})
    argv = ["calibrate"] + [a for pair in args.items() for a in pair]
    result = check_clear_error_or_answer(*run_cli(argv))
    if result is not None:  # a correct answer: the noise found reaches the target
        assert result["noise_multiplier"] > 0
        assert result["epsilon"] <= float(args["--epsilon"]) * (1 + 1e-9)


@pytest.mark.parametrize(
    "argv, names",
    [([], "required: command"), (["nonsense"], "invalid choice: 'nonsense'"),
     (["epsilon"], "required: --batch-size, --epochs, --noise-multiplier"),
     (["epsilon", "--num-examples", "10", "--batch-size", "20", "--noise-multiplier", "1", "--epochs", "1"],
      "Received: batch_size=20"),
     (["train", "--dataset", "nope"], "argument --dataset: invalid choice: 'nope'"),
     (["train", "--epochs", "-3"], "argument --epochs: expected an integer >= 1, got '-3'"),
     (["train", "--epsilon", "1", "--noise-multiplier", "1"], "--noise-multiplier: not allowed with argument --epsilon"),
     (["train", "--momentum", "1"], "argument --momentum: expected a number in [0, 1), got '1'"),
     (["train", "--momentum", "-0.1"], "argument --momentum: expected a number in [0, 1), got '-0.1'")],
)
def test_tfdp_usage_errors_are_one_line(argv, names):
    """Exit 2, no traceback, and the error is one last line naming what was wrong."""
    code, out, err = run_cli(argv)
    assert code == 2 and "Traceback" not in err and out == ""
    lines = err.rstrip("\n").split("\n")
    errors = [line for line in lines if "error:" in line]
    assert errors == [lines[-1]], err
    assert lines[-1].startswith("tfdp") and names in lines[-1], err


def test_the_installed_command_prints_no_traceback():
    """End to end through a real process (the console script's module)."""
    completed = subprocess.run(
        [sys.executable, "-m", "tfdp.cli", "epsilon", "--num-examples", "100", "--batch-size", "10",
         "--noise-multiplier", "1e-300", "--epochs", "1", "--accountant", "pld"],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 2, completed.stderr
    assert "Traceback" not in completed.stderr and "error:" in completed.stderr


# -- the accounting API: answers that are right, not just no crash ---------------------------

sigmas = st.floats(1e-3, 1e3)
rates = st.floats(1e-6, 1.0)


@API
@given(sigma=sigmas, q=rates, steps=st.integers(1, 10**5), delta=st.floats(1e-12, 0.1))
def test_epsilon_is_monotone_where_it_must_be(sigma, q, steps, delta):
    epsilon = accounting.compute_epsilon(sigma, q, steps, delta)
    assert epsilon >= 0 and not math.isnan(epsilon)
    assert accounting.compute_epsilon(sigma, q, 2 * steps, delta) >= epsilon
    assert accounting.compute_epsilon(sigma * 2, q, steps, delta) <= epsilon
    assert accounting.compute_epsilon(sigma, min(1.0, q * 2), steps, delta) >= epsilon
    ledger = accounting.PrivacyLedger()
    ledger.begin_steps(accounting.dpsgd_event(sigma, q))
    ledger.advance(steps)
    assert ledger.epsilon(delta) == epsilon  # one answer, whichever way it is asked


@CALIBRATION
@given(target=st.floats(0.05, 50.0), q=st.floats(1e-4, 1.0), steps=st.integers(1, 5000))
def test_calibrated_noise_reaches_its_target(target, q, steps):
    try:
        sigma = accounting.calibrate_noise_multiplier(target, 1e-5, q, steps)
    except ValueError as error:  # unreachable targets get a clear error
        assert "Received" in str(error)
        return
    assert accounting.compute_epsilon(sigma, q, steps, 1e-5) <= target * (1 + 1e-9)


@pytest.mark.parametrize("sigma", [1e-300, 5e-324])
def test_vanishing_noise_gives_inf_or_a_clear_error(sigma):
    assert accounting.compute_epsilon(sigma, 0.01, 100, 1e-5) == math.inf  # valid, if useless
    with pytest.raises(ValueError, match="accountant='rdp'"):
        accounting.compute_epsilon(sigma, 0.01, 100, 1e-5, accountant="pld")


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_huge_noise_gives_the_same_epsilon_as_less_noise(accountant):
    """1e308 once gave inf (dp_accounting overflows) while 1e154 gave 0.0."""
    less = accounting.compute_epsilon(1e154, 0.01, 100, 1e-5, accountant=accountant)
    assert less == 0.0
    assert accounting.compute_epsilon(1e308, 0.01, 100, 1e-5, accountant=accountant) == less


# -- training data with NaN / Inf rows ---------------------------------------------------------


def one_step(x, y, method, batch_size, seed=0):
    keras.utils.set_random_seed(seed)
    model = tfdp.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)],
        per_example_gradients=method,
    )
    model.compile(
        optimizer=NoiselessDPSGD(1.0, l2_norm_clip=0.5, noise_multiplier=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    start = [v.numpy() for v in model.trainable_variables]
    history = model.fit(x, y, batch_size=batch_size, epochs=1, steps_per_epoch=1, verbose=0)
    return [v.numpy() - s for v, s in zip(model.trainable_variables, start)], history.history


@pytest.mark.parametrize("method", ["fast", "vectorized"])
def test_nonfinite_rows_contribute_nothing_and_are_counted(method):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(24, 4)) * 10).astype(np.float32)  # large: every gradient is clipped
    y = rng.integers(0, 3, 24)
    x[20] = 1e30  # huge but finite: a legitimate record, clipped like any other
    bad = x.copy()
    bad[[2, 9, 17]] = [[np.nan] * 4, [0, np.inf, 0, 0], [-np.inf, 1, 1, 1]]
    # q = 1: every row is in the batch; the expected batch size stays 24.
    dirty, logs = one_step(bad, y, method, batch_size=24)
    keep = np.ones(24, bool)
    keep[[2, 9, 17]] = False
    clean_x = np.where(keep[:, None], x, 0.0).astype(np.float32)
    clean_y = y.copy()
    # The same step with the bad rows' weights at 0 (same expected batch size).
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)],
        per_example_gradients=method,
    )
    model.compile(
        optimizer=NoiselessDPSGD(1.0, l2_norm_clip=0.5, noise_multiplier=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    start = [v.numpy() for v in model.trainable_variables]
    model.fit(clean_x, clean_y, sample_weight=keep.astype(np.float32), batch_size=24, epochs=1,
              steps_per_epoch=1, verbose=0)
    expected = [v.numpy() - s for v, s in zip(model.trainable_variables, start)]
    for got, want in zip(dirty, expected):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # Clipping held: the step is at most lr * C * (rows kept) / b.
    norm = math.sqrt(sum(float(np.sum(g**2)) for g in dirty))
    assert norm <= 0.5 * 21 / 24 + 1e-6
    assert logs["nonfinite_examples"] == [3.0]  # counted and reported
    assert math.isfinite(logs["loss"][0])


def test_negative_control_a_clipper_that_lets_nan_through_would_poison_the_model():
    """Without the 0.1 rule (NaN factors kept), one NaN row makes every weight NaN."""
    import tensorflow as tf

    from tfdp.mechanisms import dpsgd

    class LeakyDPSGD(NoiselessDPSGD):
        def privatize(self, per_example, step_info):
            norms = tf.sqrt(per_example.sq_norms())
            factors = tf.minimum(1.0, self.l2_norm_clip / norms) * step_info["mask"]
            sums = [tf.tensordot(factors, g, axes=1) for g in per_example.materialize()]
            return dpsgd.noisy_mean(sums, 0.0, step_info["expected_batch_size"], self.noise_seed()), {
                "nonfinite_examples": tf.constant(0.0)}

    x = np.ones((8, 4), np.float32)
    x[3] = np.nan
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=LeakyDPSGD(1.0, l2_norm_clip=0.5, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, np.zeros(8, np.int64), batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
    assert not np.all(np.isfinite(model.trainable_variables[0].numpy()))


@pytest.mark.parametrize("mechanism", ["dpsgd", "dpis", "adadp"])
def test_tfdp_train_prints_test_accuracy_and_the_saved_ledgers_epsilon(tmp_path, mechanism):
    """The success path of README's first command, through the entry point
    (two epochs, seed 0: DP-SGD 81%, DPIS 84%, AdaDP 61%; chance is 10%)."""
    path = str(tmp_path / "digits.keras")
    code, out, _ = run_cli(["train", "--dataset", "digits", "--mechanism", mechanism,
                            "--epsilon", "3", "--epochs", "2", "--seed", "0", "--verbose", "0",
                            "--output", path])
    assert code == 0
    result = json.loads(out)
    assert result["mechanism"] == mechanism
    assert 0.4 < result["test_accuracy"] <= 1.0
    assert 2.9 < result["epsilon"] <= 3.0
    restored = keras.models.load_model(path)
    assert restored.privacy.epsilon(result["delta"]) == pytest.approx(result["epsilon"], abs=1e-4)
