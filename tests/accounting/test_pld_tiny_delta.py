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


def _dpis(**overrides):
    from tfdp.optimizers import DPIS  # pylint: disable=import-outside-toplevel
    settings = dict(learning_rate=0.5, l2_norm_clip=1.0, target_epsilon=4.0, epochs=3,
                    sigma_n=5.0, seed=1, accountant="pld")
    settings.update(overrides)
    return DPIS(**settings)


@pytest.mark.parametrize("delta", [1e-13, 1e-30])
def test_dpis_with_pld_refuses_a_tiny_target_delta_when_built(delta):
    """It failed only in fit, after releasing N~ and K~ (epsilon 0.80 spent
    at 1e-5), with "target_epsilon=4 cannot be met: with sigma_G=16384 ...
    spend epsilon=inf. Plan fewer epochs or a larger target_epsilon"."""
    with pytest.raises(ValueError, match=rf"target_delta.*accountant='rdp'.*Received: target_delta={delta:g}"):
        _dpis(target_delta=delta)


def test_dpis_accepts_pld_at_its_precision_and_rdp_below_it():
    """Control for the refusal above."""
    assert _dpis(target_delta=PLD_MIN_DELTA).target_delta == PLD_MIN_DELTA
    assert _dpis(target_delta=1e-30, accountant="rdp").target_delta == 1e-30


def test_dpis_noise_allocation_refuses_a_tiny_delta_under_pld():
    """`allocate_noise_multiplier` turned the PLD refusal into epsilon=inf
    (as for a too small noise) and said the target cannot be met."""
    from tfdp.accounting import PrivacyLedger  # pylint: disable=import-outside-toplevel
    from tfdp.mechanisms import importance_sampling as isp  # pylint: disable=import-outside-toplevel
    settings = dict(batch_size=16.0, clip=1.0, n_tilde=240.0, k_tilde=100.0, steps_per_epoch=15,
                    epochs_left=3, accountant="pld")
    with pytest.raises(ValueError, match=r"accountant='rdp'.*Received: delta=1e-13"):
        isp.allocate_noise_multiplier(PrivacyLedger(), 4.0, 1e-13, **settings)
    sigma, spent = isp.allocate_noise_multiplier(PrivacyLedger(), 4.0, 1e-12, **settings)  # control
    assert 0 < spent <= 4.0 and sigma > 0


def test_dpis_refuses_a_pld_budget_at_a_tiny_delta_before_releasing_anything():
    """A `PrivacyBudget(..., accountant="pld")` at delta 1e-13 stopped DPIS
    with "releasing the noisy dataset size N~ would exceed the privacy
    budget ... epsilon=inf"; DPSGD names the delta. Control: the same fit
    with the budget at delta 1e-12 trains (64 records, 4 steps: the
    budget's PLD accounting over the steps was much of the time, and 240
    records' 15 steps checked nothing more)."""
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tfdp  # pylint: disable=import-outside-toplevel

    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)

    def fit(model, delta):
        budget = tfdp.callbacks.PrivacyBudget(10.0, delta, accountant="pld")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[budget])

    def make():
        keras.utils.set_random_seed(0)
        model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=_dpis(accountant="rdp", epochs=1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model = make()
    with pytest.raises(ValueError, match=r"accountant='rdp'.*Received: delta=1e-13"):
        fit(model, 1e-13)
    assert model.privacy.epsilon(1e-5) == 0.0  # N~ was not released
    control = make()
    fit(control, PLD_MIN_DELTA)
    assert control.privacy.steps > 0
