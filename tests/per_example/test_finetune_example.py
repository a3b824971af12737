"""examples/dp_finetune_keras_hub.py offline: random-init BERT, LoRA, a tiny
generated set, one private epoch; it reports accuracy and epsilon."""

import numpy as np
import pytest

import tfdp
from tests.example_scripts import load_example
from tests.per_example import hub_models

hub_models.import_keras_hub()


def _example():
    return load_example("dp_finetune_keras_hub")


def test_generated_task_marks_positive_examples_only():
    x, y = _example().generated_texts(50, 12, 100, seed=0)
    has_marker = (x["token_ids"] == 7).any(1)
    np.testing.assert_array_equal(has_marker, y == 1)
    assert (x["token_ids"][~x["padding_mask"]] == 0).all()


def test_offline_lora_fine_tuning_reports_accuracy_and_epsilon(capsys):
    accuracy, epsilon = _example().main(
        ["--examples", "64", "--epochs", "1", "--batch-size", "16", "--sequence-length", "12",
         "--hidden-dim", "16"])
    out = capsys.readouterr().out
    assert "batched pass" in out and "test accuracy" in out and "epsilon" in out
    assert 0.0 <= accuracy <= 1.0
    # The ledger charges what ran: 4 Poisson steps (q = 16 / 64) at noise 1.0.
    assert epsilon == pytest.approx(tfdp.accounting.compute_epsilon(1.0, 16 / 64, 4, 1e-5), rel=1e-9)
