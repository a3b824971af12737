"""Tiny random-init KerasHub task models for the tests.

One transformer layer each: a layer's batched rule, and the backward pass
through it to the embeddings below, are the same code at any depth (two
layers doubled the tracing time). keras_hub is imported here: a test module
that needs it skips without it, and fails under CI=true."""

import os

import numpy as np
import pytest


def import_keras_hub():
    """keras_hub, or a skip (a failure under CI=true) when it is missing."""
    try:
        import keras_hub
    except ImportError:
        message = ('keras_hub is not installed; install it in the tfdp repository with: '
                   'pip install -e ".[hub]"')
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true and an install step did not run: {message}", pytrace=False)
        pytest.skip(message, allow_module_level=True)
    return keras_hub


def bert(keras_hub, lora=None, **kw):
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=40, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=8, **kw)
    if lora:
        backbone.enable_lora(lora)
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None)


def gpt2(keras_hub, lora=None):
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=40, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=8)
    if lora:
        backbone.enable_lora(lora)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def gemma(keras_hub, lora=None):
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=40, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8)
    if lora:
        backbone.enable_lora(lora)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def fnet(keras_hub, lora=None):
    backbone = keras_hub.models.FNetBackbone(
        vocabulary_size=40, num_layers=1, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=8)
    if lora:
        backbone.enable_lora(lora)
    return keras_hub.models.FNetTextClassifier(backbone=backbone, num_classes=2, preprocessor=None)


def llama(keras_hub, lora=None):
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=40, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32)
    if lora:
        backbone.enable_lora(lora)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def token_inputs(model, batch, rng, length=8):
    """Token ids, segment ids and padding masks (example k keeps 8 - k tokens)."""
    names = [t.name.split(":")[0] for t in model.inputs]
    lengths = [max(length - k, 2) for k in range(batch)]
    mask = np.arange(length)[None] < np.array(lengths)[:, None]
    values = {
        "token_ids": rng.integers(1, 40, (batch, length)) * mask,
        "segment_ids": (rng.random((batch, length)) < 0.3) * mask,
        "padding_mask": mask,
    }
    return {n: values[n].astype("bool" if n == "padding_mask" else "int32") for n in names}


def vit(keras_hub, lora=None):
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32)
    if lora:
        backbone.enable_lora(lora)
    return keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=2, preprocessor=None)
