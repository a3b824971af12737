"""KerasHub task models wrapped in a DPModel save and load ready to train on.

A LoRA BERT (`backbone.enable_lora`, which freezes the whole backbone but
the LoRA factors) loads training the same variables with its optimizer's
state; a GPT-2 causal LM, whose output projection is the backbone's token
embedding, loads with the two still one layer.
"""

import keras
import numpy as np

import tfdp
from tests.models.test_save_load_training_state import assert_same_training_state, load_quietly
from tests.per_example import hub_models

keras_hub = hub_models.import_keras_hub()


def _trained(task, x, y):
    model = tfdp.DPModel(task.inputs, task.outputs)
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=0.5,
                                                  momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model


def test_lora_bert_loads_training_only_its_factors_and_head_with_its_optimizer_state(tmp_path):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    task = hub_models.bert(keras_hub, lora=2)
    x, y = hub_models.token_inputs(task, 16, rng), rng.integers(0, 2, 16)
    model = _trained(task, x, y)
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert trainable < model.count_params() // 4  # factors and the classifier head
    path = str(tmp_path / "lora_bert.keras")
    model.save(path)

    loaded, messages = load_quietly(path)

    assert not [m for m in messages if "Skipping variable loading" in m], messages
    assert sum(int(np.prod(v.shape)) for v in loaded.trainable_variables) == trainable
    assert_same_training_state(model, loaded)


def test_gpt2_causal_lm_loads_with_its_output_projection_tied_to_the_token_embedding(tmp_path):
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(1)
    task = hub_models.gpt2(keras_hub)
    x, y = hub_models.token_inputs(task, 16, rng), rng.integers(0, 40, (16, 8))
    model = _trained(task, x, y)
    path = str(tmp_path / "gpt2.keras")
    model.save(path)

    loaded, _ = load_quietly(path)

    # By type: Keras names it gpt2_backbone_<n> when other GPT-2 backbones were
    # built earlier in the process (a test order under xdist).
    (backbone,) = [layer for layer in loaded.layers
                   if isinstance(layer, keras_hub.models.GPT2Backbone)]
    assert loaded.get_layer("token_embedding") is backbone.token_embedding
    assert len(loaded.weights) == len(model.weights)
    assert_same_training_state(model, loaded)
    # The forward pass called directly: `predict` traced a function for each model.
    np.testing.assert_allclose(loaded(x, training=False), model(x, training=False),
                               rtol=1e-5, atol=1e-5)
