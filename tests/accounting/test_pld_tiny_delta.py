"""The PLD accountant at deltas below its precision (issue 25, item 7).

It returned the same epsilon (0.0787 at noise 48.29) for delta 1e-30, 1e-100
and 1e-300, and `tfdp epsilon --accountant pld` printed Infinity: epsilon
must grow as delta shrinks, so such deltas are refused with a pointer to RDP.
"""

import contextlib
import io

import pytest

from tfdp import cli
from tfdp.accounting import calibrate_noise_multiplier, compute_epsilon
from tfdp.accounting._engine import PLD_MIN_DELTA


def test_pld_epsilon_grows_as_delta_shrinks_down_to_its_precision():
    deltas = [1e-5, 1e-7, 1e-9, 1e-11, PLD_MIN_DELTA]
    values = [compute_epsilon(48.29, 0.01, 100, d, accountant="pld") for d in deltas]
    assert all(a < b for a, b in zip(values, values[1:])), values
    # Control: RDP, an upper bound, stays above PLD everywhere on that range.
    assert all(p <= compute_epsilon(48.29, 0.01, 100, d) for p, d in zip(values, deltas))


@pytest.mark.parametrize("delta", [1e-13, 1e-30, 1e-100, 1e-300])
def test_pld_refuses_a_delta_below_its_precision(delta):
    with pytest.raises(ValueError, match=r"accountant='rdp'.*Received: delta="):
        compute_epsilon(48.29, 0.01, 100, delta, accountant="pld")
    with pytest.raises(ValueError, match=r"accountant='rdp'.*Received: delta="):
        calibrate_noise_multiplier(1.0, delta, 0.01, 100, accountant="pld")
    # RDP answers the same question, growing as delta shrinks.
    assert compute_epsilon(48.29, 0.01, 100, delta) > compute_epsilon(48.29, 0.01, 100, 1e-12)


def test_the_epsilon_command_says_what_is_wrong_instead_of_printing_infinity():
    argv = ["epsilon", "--num-examples", "60000", "--batch-size", "256", "--noise-multiplier",
            "1.1", "--epochs", "1", "--delta", "1e-30", "--accountant", "pld"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code != 0
    assert "Infinity" not in out.getvalue()
    assert "accountant='rdp'" in err.getvalue()
