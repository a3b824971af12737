"""The `tfdp` command starts fast and quiet.

`tfdp --help`, `tfdp epsilon` and `tfdp calibrate` never import TensorFlow or
Keras (neither does `import tfdp` followed by `tfdp.accounting`), and no
command prints TensorFlow's native start-up lines or dp_accounting's
unconverged-order warnings. Each check runs in a fresh process.
"""

import pathlib
import subprocess
import sys
import textwrap

import tfdp
from tfdp import cli

# The subprocesses import the tfdp this process imported.
ROOT = pathlib.Path(tfdp.__file__).resolve().parents[1]

# q = 25 / 100: dp_accounting warns about unconverged orders at sigma = 1.
EPSILON = ["epsilon", "--num-examples", "100", "--batch-size", "25", "--noise-multiplier", "1",
           "--epochs", "2"]
CALIBRATE = ["calibrate", "--num-examples", "100", "--batch-size", "25", "--epochs", "2",
             "--epsilon", "8"]


def run_python(code, *args):
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_accountant_commands_and_help_do_not_import_tensorflow():
    code = textwrap.dedent(
        f"""
        import contextlib, io, sys
        from tfdp import cli
        for argv in (["--help"], {EPSILON!r}, {CALIBRATE!r}):
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    cli.main(argv)
                except SystemExit as exit_:
                    assert exit_.code == 0, (argv, exit_.code)
        import tfdp
        assert tfdp.accounting.compute_epsilon(1.0, 0.1, 10, 1e-5) > 0
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras", "tf_keras"))
        print(",".join(heavy))
        """
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"imported: {result.stdout.strip()[:300]}"


def test_training_names_still_load_on_first_use():
    code = "import tfdp; print(tfdp.DPSequential.__name__, tfdp.optimizers.DPSGD.__name__, 'keras' in dir(tfdp))"
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["DPSequential", "DPSGD", "False"]


def test_accountant_commands_print_only_their_answer():
    for argv in (EPSILON, CALIBRATE):
        result = run_python("import sys; from tfdp import cli; sys.exit(cli.main(sys.argv[1:]))", *argv)
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""  # before: a dozen "WARNING:absl:_compute_log_a_frac ..." lines
        assert '"epsilon"' in result.stdout


def test_train_start_up_is_quiet_and_a_bad_output_is_refused(tmp_path):
    # Imports TensorFlow (so its start-up lines would show) and stops before training.
    result = run_python(
        "import sys; from tfdp import cli; sys.exit(cli.main(sys.argv[1:]))",
        "train", "--epochs", "1", "--output", str(tmp_path / "missing" / "m.keras"),
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "tfdp train: error: Cannot save to `output` (--output): the folder "
        f"{tmp_path / 'missing'} does not exist. Received: output="
        f"{str(tmp_path / 'missing' / 'm.keras')!r}"
    ]
    assert result.stdout == ""


def test_start_up_filter_keeps_other_lines():
    noise = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "I0000 00:00:1795465782.438549    5566 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.",
        "E0000 00:00:1795466595.008255   17266 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
        "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the appropriate compiler flags.",
    ]
    kept = [
        "E0000 00:00:1795466595.008255   17266 op_kernel.cc:1830] OP_REQUIRES failed",
        "Traceback (most recent call last):",
        "UserWarning: something the user must see",
    ]
    assert all(cli.STARTUP_NOISE.match(line) for line in noise)
    assert not any(cli.STARTUP_NOISE.match(line) for line in kept)
