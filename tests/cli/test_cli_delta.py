"""`tfdp epsilon` / `tfdp calibrate` with a delta that protects no one: the
answer is printed with a one-line warning (delta > 1/N) or refused
(delta >= 1). Before, `--delta 0.5` printed "epsilon": 0.0 without a word.
Each runs in a fresh process, as a user runs the command."""

import json

import pytest

from tests.cli.test_cli_extreme_noise import run

SETTINGS = ["--num-examples", "100", "--batch-size", "25", "--epochs", "2"]
COMMANDS = {
    "epsilon": ["epsilon", *SETTINGS, "--noise-multiplier", "1"],
    "calibrate": ["calibrate", *SETTINGS, "--epsilon", "8"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_delta_above_one_over_n_is_answered_with_a_warning(command):
    result = run(*COMMANDS[command], "--delta", "0.5")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["delta"] == 0.5
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"tfdp {command}: warning: delta=0.5 is larger than 1/N = 0.01")


@pytest.mark.parametrize("command", COMMANDS)
def test_delta_of_one_is_refused_and_a_small_delta_is_quiet(command):
    refused = run(*COMMANDS[command], "--delta", "1")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "--delta: expected a number in (0, 1), got '1'" in refused.stderr
    quiet = run(*COMMANDS[command], "--delta", "0.01")  # 1/N itself: no warning
    assert quiet.returncode == 0 and quiet.stderr == ""
