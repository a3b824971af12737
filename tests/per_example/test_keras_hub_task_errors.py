"""Wrapping a KerasHub task the wrong way gets an error naming the right way.

`tfdp.DPModel(task)` (Keras's `Layer.__init__` TypeError before) and raw
text into `DPModel(task.inputs, task.outputs).fit` ("Invalid dtype: str256"
before) both say: wrap `task.inputs` and `task.outputs`, and run
`task.preprocessor` on the texts first (the wrapped graph starts at token
ids). Both are refused before any step is charged.
"""

import keras
import numpy as np
import pytest

import tfdp
from tests.per_example import hub_models

keras_hub = hub_models.import_keras_hub()


def _compiled(task):
    model = tfdp.DPModel(task.inputs, task.outputs)
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_task_passed_whole_names_inputs_outputs_and_the_preprocessor():
    task = hub_models.bert(keras_hub)
    with pytest.raises(ValueError) as error:
        tfdp.DPModel(task)
    message = str(error.value)
    assert "tfdp.DPModel(task.inputs, task.outputs)" in message
    assert "task.preprocessor" in message and "BertTextClassifier" in message
    with pytest.raises(ValueError, match=r"DPModel\(task.inputs, task.outputs\)"):
        tfdp.DPModel(inputs=task)


def test_a_keras_model_passed_whole_names_inputs_and_outputs():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"DPModel\(model.inputs, model.outputs\)") as error:
        tfdp.DPModel(model)
    assert "preprocessor" not in str(error.value)


@pytest.mark.parametrize("as_dict", [False, True])
def test_text_into_fit_says_to_run_the_preprocessor_first(as_dict):
    task = hub_models.bert(keras_hub)
    model = _compiled(task)
    texts = np.array(["a great movie", "bad"] * 8)
    x = {"token_ids": texts, "segment_ids": texts, "padding_mask": texts} if as_dict else texts
    with pytest.raises(ValueError, match=r"task\.preprocessor") as error:
        model.fit(x, np.array([1, 0] * 8), batch_size=4, verbose=0)
    assert "dtype text" in str(error.value) and "<U13" not in str(error.value)  # no length
    assert model.privacy.steps == 0


def test_token_ids_train():
    """Control: the preprocessed form trains."""
    task = hub_models.bert(keras_hub)
    model = _compiled(task)
    rng = np.random.default_rng(0)
    model.fit(hub_models.token_inputs(task, 16, rng), rng.integers(0, 2, 16), batch_size=4,
              verbose=0)
    assert model.privacy.steps == 4
