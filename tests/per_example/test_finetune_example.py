"""examples/dp_finetune_keras_hub.py offline: random-init BERT, LoRA, the
generated task (label 1 iff a text holds token 5), two private epochs; it
learns the task well above chance and reports the epsilon the ledger charged.

Before, the offline run stayed at chance (49.4% at epsilon 2.63) and its
test asserted only 0 <= accuracy <= 1.
"""

import numpy as np
import pytest

import tfdp
from tests.example_scripts import load_example
from tests.per_example import hub_models

hub_models.import_keras_hub()

# 512 texts of at most 16 tokens, hidden 64: about 5 s of training on 2 cores.
SMALL = ["--examples", "512", "--sequence-length", "16", "--hidden-dim", "64",
         "--batch-size", "32", "--seed", "0"]


def _example():
    return load_example("dp_finetune_keras_hub")


def test_generated_texts_hold_their_class_word_only():
    example = _example()
    x, y = example.generated_texts(200, 12, 100, seed=0)
    tokens, mask = x["token_ids"], x["padding_mask"]
    holds_positive = ((tokens == example.POSITIVE) & mask).any(1)
    holds_negative = ((tokens == example.NEGATIVE) & mask).any(1)
    np.testing.assert_array_equal(holds_positive, y == 1)
    np.testing.assert_array_equal(holds_negative, y == 0)
    assert (tokens[~mask] == 0).all()
    assert 0.4 < y.mean() < 0.6


def test_offline_lora_fine_tuning_learns_the_task_and_reports_epsilon(capsys):
    accuracy, epsilon = _example().main(SMALL + ["--epochs", "2"])
    out = capsys.readouterr().out
    assert "batched pass" in out and "test accuracy" in out and "with real weights" in out.lower()
    # 128 test texts: chance is 0.5 +- 0.044 (one standard deviation); this
    # run measured 0.92 to 0.95 over seeds 0, 1, 2.
    assert accuracy > 0.75
    # The ledger charges what ran: 2 epochs of 16 Poisson steps (q = 32 / 512) at noise 1.0.
    assert epsilon == pytest.approx(tfdp.accounting.compute_epsilon(1.0, 32 / 512, 32, 1e-5),
                                    rel=1e-9)


def test_without_training_the_model_is_at_chance():
    """Negative control: the same pipeline, 0 epochs (measured 0.43)."""
    accuracy, epsilon = _example().main(SMALL + ["--epochs", "0"])
    assert accuracy < 0.65 and epsilon == 0.0
