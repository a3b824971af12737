"""`tfdp calibrate` and `tfdp epsilon` take the number of people for
user-level DP (`--num-users`, q = batch / U), as `calibrate_dpsgd` does;
exactly one of --num-examples and --num-users."""

import json

from tests.cli.test_cli_extreme_noise import run
from tfdp.accounting import calibrate_dpsgd, compute_dpsgd_epsilon


def test_calibrate_and_epsilon_take_the_number_of_people():
    result = run("calibrate", "--num-users", "2000", "--batch-size", "64", "--epochs", "10",
                 "--epsilon", "3")
    assert result.returncode == 0, result.stderr
    sigma = json.loads(result.stdout)["noise_multiplier"]
    assert sigma == calibrate_dpsgd(num_users=2000, batch_size=64, epochs=10,
                                    target_epsilon=3.0, delta=1e-5)
    result = run("epsilon", "--num-users", "2000", "--batch-size", "64", "--epochs", "10",
                 "--noise-multiplier", "1.1")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["epsilon"] == compute_dpsgd_epsilon(
        num_users=2000, batch_size=64, noise_multiplier=1.1, epochs=10, delta=1e-5)


def test_records_and_people_are_one_or_the_other():
    result = run("calibrate", "--num-users", "20", "--num-examples", "100", "--batch-size", "5",
                 "--epochs", "1", "--epsilon", "3")
    assert result.returncode == 2
    assert "not allowed with argument" in result.stderr and "--num-users" in result.stderr
