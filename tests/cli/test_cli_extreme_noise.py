"""`tfdp epsilon` at the extremes of the noise (issue 35, item 7): its output
is strict JSON or a one-line error, and dp_accounting's warnings about
rounding at huge noise do not reach the terminal. Each runs in a fresh
process, as a user runs the command."""

import json
import pathlib
import subprocess
import sys

import tfdp

ROOT = pathlib.Path(tfdp.__file__).resolve().parents[1]
ARGS = ["--num-examples", "60000", "--batch-size", "256", "--epochs", "3"]


def run(*argv):
    code = "import sys; from tfdp import cli; sys.exit(cli.main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def strict_json(text):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_vanishing_noise_is_a_one_line_error_not_infinity_in_the_json():
    """The old output: `"epsilon": Infinity`, which JSON parsers other than
    Python's refuse."""
    result = run("epsilon", *ARGS, "--noise-multiplier", "1e-300")
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfdp epsilon: error: epsilon is infinite")
    assert "noise_multiplier=1e-300" in lines[0]


def test_huge_noise_answers_zero_without_warnings():
    """The old stderr: 33 absl "Negative Renyi divergence" warnings."""
    result = run("epsilon", *ARGS, "--noise-multiplier", "1e300")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert strict_json(result.stdout)["epsilon"] == 0.0


def test_ordinary_noise_prints_strict_json():
    """Control."""
    result = run("epsilon", *ARGS, "--noise-multiplier", "1.1")
    assert result.returncode == 0 and result.stderr == ""
    assert 0 < strict_json(result.stdout)["epsilon"] < 10
