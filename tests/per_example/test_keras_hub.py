"""KerasHub task models on the batched path: every per-example gradient
equals that example's batch-of-1 gradient, and one example's gradient does
not move when another example changes (tiny random-init configs)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.noiseless import NoiselessDPSGD
from tests.per_example import hub_models
from tfdp.per_example import compute_per_example_gradients, plan_for

keras_hub = hub_models.import_keras_hub()

import tfdp  # noqa: E402


def _classifier_loss(y, logits):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def _lm_loss(y, logits):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True), -1)


TASKS = {
    "bert": (hub_models.bert, _classifier_loss),
    "gpt2": (hub_models.gpt2, _lm_loss),
    "gemma": (hub_models.gemma, _lm_loss),
    "fnet": (hub_models.fnet, _classifier_loss),
    "llama": (hub_models.llama, _lm_loss),
    "vit": (hub_models.vit, _classifier_loss),
}


def _task(name):
    keras.utils.set_random_seed(4)
    if name == "layers":
        return _layers_model(tie_weights=True), _lm_loss
    base, _, lora = name.partition("_")
    build, loss = TASKS[base]
    task = build(keras_hub, lora=4 if lora else None)
    model = tfdp.DPModel(task.inputs, task.outputs)
    for v in model.trainable_variables:
        if "lora_kernel_b" in v.path:  # B starts at zero: A's gradient would be zero
            v.assign(tf.random.normal(v.shape, stddev=0.3, seed=len(v.path)))
    return model, loss


def _inputs(model, batch, rng):
    if len(model.inputs) == 1:  # images
        return tf.constant(rng.normal(size=(batch, 16, 16, 3)), tf.float32)
    return hub_models.token_inputs(model, batch, rng)


def _targets(name, x, rng):
    if name.startswith("vit"):
        return tf.constant(rng.integers(0, 2, len(x)), tf.int32)
    if name.startswith(("bert", "fnet")):
        return tf.constant(rng.integers(0, 2, len(x["token_ids"])), tf.int32)
    return tf.constant(np.roll(x["token_ids"], -1, axis=1), tf.int32)


LORA = ["bert_lora", "gpt2_lora"]


@pytest.mark.parametrize("name", sorted(TASKS) + LORA)
def test_task_matches_one_example_at_a_time(name, reference_gradients, assert_matches_reference):
    model, loss = _task(name)
    plan = plan_for(model)
    assert plan.path == "batched", plan.reason
    assert not plan.fallback_layers or name.startswith(("gemma", "vit", "llama"))
    rng = np.random.default_rng(0)
    x = _inputs(model, 5, rng)
    y = _targets(name, x, rng)
    weights = tf.constant([1.0, 0.5, 2.0, 1.0, 0.0])
    grads, _, _ = compute_per_example_gradients(model, x, y, weights, loss, "batched", training=False)
    reference = reference_gradients(model, x, y, weights.numpy(), loss)
    assert_matches_reference(grads, reference, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(TASKS) + LORA + ["layers"])
def test_outlier_leaves_other_examples_unchanged(name):
    model, loss = _task(name)
    rng = np.random.default_rng(1)
    x = _inputs(model, 3, rng)
    y = _targets(name, x, rng)
    if isinstance(x, dict):
        changed = {k: v.copy() for k, v in x.items()}
        changed["token_ids"][1] = 39
        if "padding_mask" in changed:
            changed["padding_mask"][1] = True
    else:
        changed = tf.tensor_scatter_nd_update(x, [[1]], [tf.fill(x.shape[1:], 50.0)])
    firsts = []
    for batch in (x, changed):
        grads, _, _ = compute_per_example_gradients(model, batch, y, tf.ones([3]), loss, "batched",
                                                    training=False)
        firsts.append([g.numpy() for g in grads.materialize()])
    moved = 0.0
    for a, b in zip(*firsts):
        np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a[2], b[2], rtol=1e-5, atol=1e-6)
        moved = max(moved, float(np.abs(a[1] - b[1]).max()))
    assert moved > 1e-3  # negative control: the changed example's own gradient moved


def _layers_model(tie_weights):
    ids = keras.Input((8,), dtype="int32", name="token_ids")
    mask = keras.Input((8,), dtype="bool", name="padding_mask")
    h = keras_hub.layers.TokenAndPositionEmbedding(40, 8, 16)(ids)
    h = keras_hub.layers.TransformerEncoder(16, 2, normalize_first=True)(h, padding_mask=mask)
    h = keras_hub.layers.TransformerDecoder(16, 2)(h, h, decoder_padding_mask=mask)
    h = keras_hub.layers.RMSNormalization(16)(h)
    h = keras_hub.layers.RotaryEmbedding()(h)
    table = keras_hub.layers.ReversibleEmbedding(40, 16, tie_weights=tie_weights, logit_soft_cap=5.0)
    logits = table(table(ids) + h, reverse=True)
    return tfdp.DPModel([ids, mask], logits)


@pytest.mark.parametrize("tie_weights", [True, False])
def test_keras_hub_layers_match_one_example_at_a_time(tie_weights, reference_gradients,
                                                      assert_matches_reference):
    keras.utils.set_random_seed(5)
    model = _layers_model(tie_weights)
    plan = plan_for(model)
    assert plan.path == "batched", plan.reason
    assert [l.name for l, _ in plan.handlers if "rms" in l.name] == plan.fallback_layers
    rng = np.random.default_rng(2)
    x = hub_models.token_inputs(model, 5, rng)
    y = tf.constant(rng.integers(0, 40, (5, 8)), tf.int32)
    weights = tf.constant([1.0, 0.5, 2.0, 1.0, 0.0])
    grads, _, _ = compute_per_example_gradients(model, x, y, weights, _lm_loss, "batched", training=False)
    assert_matches_reference(grads, reference_gradients(model, x, y, weights.numpy(), _lm_loss), rtol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "fnet", "llama"])
def test_task_fits_privately_on_the_batched_path(name):
    """FNet and Llama raised `'str' object has no attribute '_type_enum'`
    from tape.gradient (or oneDNN's refusal) on the vectorized path."""
    model, _ = _task(name)
    rng = np.random.default_rng(3)
    x = hub_models.token_inputs(model, 32, rng)
    y = np.asarray(_targets(name, x, rng))
    before = [v.numpy().copy() for v in model.trainable_variables]
    model.compile(optimizer=tfdp.optimizers.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert "batched" in model.per_example_path
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert any(not np.allclose(b, v.numpy()) for b, v in zip(before, model.trainable_variables))
    # The ledger holds the 4 Poisson steps that ran (q = 8 / 32, noise 1).
    assert model.privacy.epsilon(1e-5) == pytest.approx(
        tfdp.accounting.compute_epsilon(1.0, 8 / 32, 4, 1e-5), rel=1e-9)


def test_causal_lm_sequence_loss_ignores_padded_tokens():
    from tfdp.models.sequence_loss import token_weighted_loss

    model, _ = _task("gpt2")
    rng = np.random.default_rng(6)
    x = hub_models.token_inputs(model, 4, rng)
    y = np.roll(x["token_ids"], -1, axis=1)
    token_weights = x["padding_mask"].astype("float32")
    loss_fn = token_weighted_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    other = np.where(token_weights > 0, y, (y + 7) % 40)  # labels changed at padding only
    changed = np.where(token_weights > 0, (y + 7) % 40, y)  # control: changed at real tokens
    grads = [
        compute_per_example_gradients(model, x, (tf.constant(t), tf.constant(token_weights)),
                                      tf.ones([4]), loss_fn, "batched", training=False)[0].sq_norms().numpy()
        for t in (y, other, changed)
    ]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6)
    assert np.abs(grads[0] - grads[2]).max() > 1e-4


@pytest.mark.parametrize("physical_batch_size", [None, 4])
def test_causal_lm_fits_with_keras_hub_per_token_sample_weight(physical_batch_size):
    model, _ = _task("gpt2_lora")
    rng = np.random.default_rng(3)
    x = hub_models.token_inputs(model, 32, rng)
    y = np.roll(x["token_ids"], -1, axis=1)
    model.compile(optimizer=tfdp.optimizers.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, sample_weight=x["padding_mask"].astype("float32"), batch_size=8, epochs=1,
                        verbose=0, physical_batch_size=physical_batch_size)
    assert np.isfinite(history.history["loss"]).all()
    # The ledger holds the 4 Poisson steps that ran (q = 8 / 32, noise 1).
    assert model.privacy.epsilon(1e-5) == pytest.approx(
        tfdp.accounting.compute_epsilon(1.0, 8 / 32, 4, 1e-5), rel=1e-9)


@pytest.mark.parametrize("name", ["gemma_lora", "vit_lora"])  # no dropout: one result per step
def test_lora_fine_tuning_under_xla_equals_the_eager_step(name, monkeypatch):
    """jit_compile="auto" is XLA on a GPU: there a LoRA fine-tune in physical
    batches must take the same steps as without XLA (run here on CPU)."""
    from tests.forced_draws import force_draws

    force_draws(monkeypatch, [np.arange(0, 32, 3), np.arange(1, 32, 4)])

    def run(jit_compile):
        model, _ = _task(name)
        start = [v.numpy() for v in model.trainable_variables]
        rng = np.random.default_rng(3)
        x = _inputs(model, 32, rng)
        y = np.asarray(_targets(name, x, rng))
        model.compile(optimizer=NoiselessDPSGD(0.1, l2_norm_clip=0.5, noise_multiplier=1.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit_compile)
        assert model.jit_compile is jit_compile
        model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, physical_batch_size=4, verbose=0)
        assert model.privacy.steps == 2
        return start, [v.numpy() for v in model.trainable_variables]

    start, eager = run(False)
    _, xla = run(True)
    assert max(np.abs(a - b).max() for a, b in zip(eager, start)) > 1e-3  # the steps moved the weights
    for a, b in zip(xla, eager):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
