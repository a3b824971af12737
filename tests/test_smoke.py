"""The smoke tests: does this install work? (`python -m pytest -q -m smoke`,
a minute or two; README and docs/development.md.)

One test each for the install, a DP fit, its privacy ledger, save and load
with the ledger, and the command line. The full suite tests each in depth.
"""

import importlib.metadata
import json
import pathlib

import numpy as np
import pytest

import tfdp

pytestmark = pytest.mark.smoke

N, BATCH, SIGMA, EPOCHS = 1437, 64, 1.1, 2


def test_install_imports_this_package():
    assert pathlib.Path(tfdp.__file__).parts[-2:] == ("tfdp", "__init__.py")
    assert importlib.metadata.version("tfdp") == tfdp.__version__
    assert {"DPSequential", "DPModel", "optimizers", "accounting"} <= set(dir(tfdp))


@pytest.fixture(scope="module")
def trained():
    import keras

    from tfdp.data import load_digits

    (x_train, y_train), (x_test, y_test) = load_digits()
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((64,)), keras.layers.Dense(32, activation="tanh"),
                               keras.layers.Dense(10)])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=SIGMA, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=BATCH, epochs=EPOCHS, verbose=0)
    return model, x_test, y_test


def test_a_dp_fit_trains(trained):
    model, x_test, y_test = trained
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    assert accuracy > 0.5  # chance is 0.1


def test_the_ledger_counts_the_fit(trained):
    model, _, _ = trained
    assert model.privacy.steps == EPOCHS * round(N / BATCH)
    expected = tfdp.accounting.compute_dpsgd_epsilon(N, BATCH, SIGMA, EPOCHS, 1e-5)
    assert model.privacy.epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
    assert "differential privacy" in model.privacy.statement(delta=1e-5)


def test_save_and_load_keep_weights_and_ledger(trained, tmp_path):
    import keras

    model, x_test, _ = trained
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded) is tfdp.DPSequential
    assert loaded.privacy.steps == model.privacy.steps
    np.testing.assert_allclose(loaded.predict(x_test, verbose=0), model.predict(x_test, verbose=0),
                               rtol=1e-6)


def test_the_command_line(capsys):
    from tfdp import cli

    assert cli.main(["epsilon", "--num-examples", str(N), "--batch-size", str(BATCH),
                     "--noise-multiplier", str(SIGMA), "--epochs", str(EPOCHS)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["epsilon"] == pytest.approx(
        tfdp.accounting.compute_dpsgd_epsilon(N, BATCH, SIGMA, EPOCHS, 1e-5), rel=1e-9)
