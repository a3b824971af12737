"""`tfdp train` (tfdp.training.train): settings checked before any step, a
clean test hold-out, and a result that tells the truth about a budget stop."""

import re

import numpy as np
import pytest

from tfdp import accounting, recipes, training
from tfdp.data import load_dataset
from tfdp.models import DPSequential


@pytest.fixture
def built_models(monkeypatch):
    """Every model `train` builds (to read their ledgers afterwards)."""
    models = []
    build = recipes.build_model

    def spy(*args, **kwargs):
        models.append(build(*args, **kwargs))
        return models[-1]

    monkeypatch.setattr(recipes, "build_model", spy)
    return models


@pytest.mark.parametrize("name, message", [
    ("missing/m.keras", "folder .* does not exist"),
    ("m.txt", "to name a .keras file"),
])
def test_bad_output_is_refused_before_any_step(tmp_path, built_models, name, message):
    output = str(tmp_path / name)
    with pytest.raises(ValueError, match=rf"\(--output\).*{message}.*Received: output="):
        training.train(dataset="digits", epochs=1, batch_size=256, output=output, verbose=0)
    assert all(model.privacy.steps == 0 for model in built_models)  # before: 5 steps spent
    assert not list(tmp_path.iterdir())


def test_batch_larger_than_the_data_set_is_named_in_the_users_terms(built_models):
    with pytest.raises(ValueError, match=r"--batch-size.*training examples of digits \(1293,.*"
                                         r"Received: batch_size=5000"):
        training.train(dataset="digits", epochs=1, batch_size=5000, verbose=0)
    assert built_models == []


def test_validation_comes_from_the_training_split(monkeypatch):
    seen = {}
    fit = DPSequential.fit

    def spy(self, x, y, **kwargs):
        seen.update(x=x, validation_data=kwargs["validation_data"])
        return fit(self, x, y, **kwargs)

    monkeypatch.setattr(DPSequential, "fit", spy)
    result = training.train(dataset="digits", epochs=1, batch_size=256, seed=0, verbose=0)
    (x_train, _), (x_test, _) = load_dataset("digits")
    rows = lambda a: {r.tobytes() for r in np.asarray(a)}  # noqa: E731
    validation = rows(seen["validation_data"][0])
    assert len(validation) > 0
    assert validation <= rows(x_train)  # before: the test split itself
    assert not validation & rows(x_test)
    assert not validation & rows(seen["x"])  # never trained on
    assert result["nonfinite_examples"] == 0  # the count stays available


def test_a_budget_stop_mid_epoch_is_reported_as_such(capsys):
    # Fixed noise and a budget with room for 7 steps of 5 an epoch (batch 256 of 1293).
    sigma, q = 1.0, 256 / 1293
    budget = accounting.compute_epsilon(sigma, q, 7, 1e-5)
    result = training.train(dataset="digits", epochs=3, batch_size=256, noise_multiplier=sigma,
                            epsilon=budget, seed=0, verbose=2)
    assert result["steps"] == 7 and result["stopped_for_budget"] is True
    assert result["epsilon"] <= round(budget, 4)
    counts = re.findall(r"^(\d+/\d+) - ", capsys.readouterr().out, flags=re.M)
    assert counts == ["5/5", "2/5"]  # before: "5/5", "5/5"


def test_an_output_that_cannot_be_written_is_refused_before_any_step(built_models):
    """/proc passes the folder and permission checks but takes no new file."""
    with pytest.raises(ValueError, match=r"\(--output\).*writing in /proc failed.*Received"):
        training.train(dataset="digits", epochs=1, batch_size=256, output="/proc/nope.keras",
                       verbose=0)
    assert built_models == []  # before: the whole budget spent, then a traceback


def test_a_final_save_that_fails_still_reports_the_result(tmp_path, monkeypatch, capsys):
    """A disk that fills during training: the JSON result is printed, the error
    names the path, the exit code is 1, and no 0-byte file is left."""
    import errno
    import json

    from tfdp import cli

    def disk_full(self, filepath, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DPSequential, "save", disk_full)
    output = tmp_path / "m.keras"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--dataset", "digits", "--epochs", "1", "--batch-size", "256",
                  "--output", str(output), "--verbose", "0"])
    assert exit_.value.code == 1
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["epsilon"] > 0 and 0 <= result["test_accuracy"] <= 1
    assert str(output) in result["output_error"] and "No space left" in err
    assert not output.exists()
