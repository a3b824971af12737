"""The private search's first-hour messages (issue 54): a fixed number of
trials, the search space, a failed trial's advice, the chosen model's
statement."""

import math

import dp_accounting
import keras
import pytest
from dp_accounting.dp_event import RepeatAndSelectDpEvent

pytest.importorskip("keras_tuner")

import tfdp  # noqa: E402
from tfdp.accounting.statement import describe_releases  # noqa: E402
from tfdp.tuning import PrivateRandomSearch, process  # noqa: E402


def build(hp):
    model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(hp.Choice("units", [2, 4]))])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(hp.Float("learning_rate", 0.05, 0.5, sampling="log"),
                                        l2_norm_clip=1.0, noise_multiplier=1.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_max_trials_alone_gets_the_tailored_message():
    with pytest.raises(ValueError, match=r"PrivateRandomSearch\(build, mean_trials=5\).*"
                                         r"Received: max_trials=5"):
        PrivateRandomSearch(build, max_trials=5)


def test_no_number_of_trials_at_all_names_mean_trials():
    with pytest.raises(ValueError, match="needs `mean_trials`"):
        PrivateRandomSearch(build)


def test_the_search_space_summary_lists_every_hyperparameter_and_the_law():
    summary = PrivateRandomSearch(build, mean_trials=3).search_space_summary()
    lines = summary.splitlines()
    assert "2 hyperparameters" in lines[0] and "geometric law with mean 3" in lines[0]
    assert lines[1].startswith("units (Choice): ") and "values=[2, 4]" in lines[1]
    assert lines[2].startswith("learning_rate (Float): ") and "sampling='log'" in lines[2]


def test_a_failed_trials_advice_names_a_custom_score_too():
    error = process._error_of({"error": ("builtins", "ValueError"), "message": None})
    assert "hypermodel" in str(error) and "custom `score`" in str(error)


def test_the_trials_noisy_score_reads_as_part_of_the_search():
    trial = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(1.5)), 10),
        dp_accounting.GaussianDpEvent(10.0)])
    text = describe_releases([(RepeatAndSelectDpEvent(trial, 4.0, math.inf), 1)])
    assert "each trial trained with 10 x Poisson-sampled Gaussian" in text
    assert "noisy validation score (Gaussian, noise multiplier 10) that picks the best" in text
    assert "not a release of its own" in text and "1 x Gaussian" not in text
