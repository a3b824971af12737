"""Allow-listed layers whose configuration mixes examples, and mixing losses.

The allow-list names layer classes; an `Activation(fn)` with an arbitrary
callable, `activation=fn` on a layer with a rule, or an axis argument that
names the batch axis makes the same class mix examples. Each case must take
the exact vectorized path (or be refused by "batched"); the built-in
configurations (the controls) keep the batched path. Losses that compare
rows of the batch are evaluated one row at a time.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from keras.src.losses.losses import LossFunctionWrapper

from tfdp.models.losses import per_example_loss
from tfdp.per_example import compute_per_example_gradients, plan_for


def _max_scale(t):
    return t / keras.ops.max(keras.ops.abs(t))


def _mixing(name):
    """A layer whose configuration reads other examples of the batch."""
    L = keras.layers
    return {
        "activation_layer": lambda: L.Activation(_max_scale),
        "dense_activation": lambda: L.Dense(4, activation=_max_scale),
        "softmax_axis_0": lambda: L.Softmax(axis=0),
        "unit_norm_axis_0": lambda: L.UnitNormalization(axis=0),
        "layer_norm_axis_0": lambda: L.LayerNormalization(axis=0, center=False, scale=False),
        "softmax_axis_minus_rank": lambda: L.Softmax(axis=-2),
    }[name]()


MIXING = ["activation_layer", "dense_activation", "softmax_axis_0", "unit_norm_axis_0",
          "layer_norm_axis_0", "softmax_axis_minus_rank"]


def _model(middle):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), middle, keras.layers.Dense(2)]
    )


def _first_example_grads(model, loss="mse", method="auto"):
    """Example 0's per-example gradient with example 1 ordinary, then an outlier."""
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    outlier = x.copy()
    outlier[1] = 1e3
    y = np.array([[0.5, -0.5], [1.0, 0.0], [0.0, 1.0]], np.float32)
    return [
        [g.numpy()[0] for g in compute_per_example_gradients(
            model, tf.constant(batch), tf.constant(y), tf.ones([3]), per_example_loss(loss), method
        )[0].materialize()]
        for batch in (x, outlier)
    ]


@pytest.mark.parametrize("name", MIXING)
def test_a_mixing_configuration_takes_the_exact_path(name):
    model = _model(_mixing(name))
    plan = plan_for(model)
    assert plan.path == "vectorized", plan.describe()
    assert type(_mixing(name)).__name__ in plan.reason
    before, after = _first_example_grads(model)
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", MIXING)
def test_batched_refuses_a_mixing_configuration_by_name(name):
    model = _model(_mixing(name))
    with pytest.raises(ValueError, match="batch axis|not a Keras built-in activation|equation"):
        _first_example_grads(model, method="batched")


def test_the_batched_pass_would_have_leaked(monkeypatch):
    """Negative control: forced through the batched pass (the old allow-list),
    the mixing activation moves example 0's gradient with example 1."""
    import tfdp.per_example.plan as plan_module

    monkeypatch.setattr(plan_module, "configuration_problem", lambda layer: None)
    model = _model(_mixing("activation_layer"))
    assert plan_for(model).path == "batched"
    before, after = _first_example_grads(model)
    assert max(np.abs(a - b).max() for a, b in zip(before, after)) > 1e-3


@pytest.mark.parametrize("middle", [
    lambda: keras.layers.Activation("gelu"),
    lambda: keras.layers.Dense(4, activation="tanh"),
    lambda: keras.layers.Softmax(axis=-1),
    lambda: keras.layers.UnitNormalization(axis=-1),
    lambda: keras.layers.LayerNormalization(axis=-1),
    lambda: keras.layers.EinsumDense("ab,bc->ac", output_shape=(4,)),
])
def test_built_in_configurations_keep_the_batched_path(middle):
    assert plan_for(_model(middle())).path == "batched"


def test_an_einsum_that_sums_over_the_batch_is_named():
    from tfdp.per_example.configuration import configuration_problem

    over_batch = keras.layers.EinsumDense("ab,bc->c", output_shape=(4,))
    over_batch.build((3, 4))
    assert "equation" in configuration_problem(over_batch, rank=2)
    keeps = keras.layers.EinsumDense("...b,bc->...c", output_shape=(4,))
    keeps.build((3, 4))
    assert configuration_problem(keeps, rank=2) is None


def test_recurrent_activations_are_checked():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((3, 2)), keras.layers.LSTM(4, recurrent_activation=_max_scale), keras.layers.Dense(2)
    ])
    plan = plan_for(model)
    assert plan.path == "vectorized" and "recurrent_activation" in plan.reason


def test_a_declared_activation_keeps_the_batched_path():
    def doubled_tanh(t):
        return 2.0 * keras.ops.tanh(t)

    model = _model(keras.layers.Activation(doubled_tanh))
    assert plan_for(model).path == "vectorized"
    tfdp.per_example.declare_per_example_activation(doubled_tanh)
    assert plan_for(model).path == "batched"


def _fit_weights(x, y, middle, loss="mse"):
    model = tfdp.DPModel(*_functional(middle))
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=1e-6, seed=7),
        loss=loss,
    )
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
    return np.concatenate([w.numpy().ravel() for w in model.trainable_weights])


def _functional(middle):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2)(middle()(keras.layers.Dense(4)(inputs)))
    return inputs, outputs


def _neighbours():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.normal(size=(16, 2)).astype(np.float32)
    changed = x.copy()
    changed[3] = 1e3  # one record replaced by an outlier
    return x, changed, y


def test_one_record_moves_the_weights_at_most_lr_2c_over_b():
    """The review's measurement through fit: equal seeds, noise ~0, datasets
    differing in one record; the update may differ by lr * 2C / b = 0.25
    (the batched pass moved them 0.33)."""
    x, changed, y = _neighbours()
    middle = lambda: keras.layers.Activation(_max_scale)  # noqa: E731
    moved = np.linalg.norm(_fit_weights(x, y, middle) - _fit_weights(changed, y, middle))
    assert moved <= 1.0 * 2 * 1.0 / 8 * (1 + 1e-4)


def _pairwise(y_true, y_pred):
    """A custom loss that compares each row with the batch mean."""
    del y_true
    return keras.ops.sum((y_pred - keras.ops.mean(y_pred, axis=0)) ** 2, axis=-1)


class _CentredLoss(keras.losses.Loss):
    """A Loss subclass with its own call, comparing rows with the batch mean."""

    def call(self, y_true, y_pred):
        return _pairwise(y_true, y_pred)


MIXING_LOSSES = {
    "circle": lambda: "circle",
    "pairwise_function": lambda: _pairwise,
    "loss_subclass_own_call": _CentredLoss,
}


@pytest.mark.parametrize("name", sorted(MIXING_LOSSES))
def test_a_loss_that_mixes_examples_is_evaluated_row_by_row(name):
    loss = MIXING_LOSSES[name]()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    y = (np.array([0, 1, 0], np.int32) if loss == "circle"
         else np.array([[0.5, -1.0], [1.0, 2.0], [-1.5, 0.5]], np.float32))
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    outlier = x.copy()
    outlier[1] = 1e3
    loss_fn = per_example_loss(loss)
    grads = [
        [g.numpy()[0] for g in compute_per_example_gradients(
            model, tf.constant(batch), tf.constant(y), tf.ones([3]), loss_fn)[0].materialize()]
        for batch in (x, outlier)
    ]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Row by row: each example's loss is the loss of a batch of that row alone.
    resolved = keras.losses.get(loss) if isinstance(loss, str) else loss
    y_pred = model(x)
    alone = [float(tf.reshape(resolved(y[i:i + 1], y_pred[i:i + 1]), [-1])[0]) for i in range(3)]
    np.testing.assert_allclose(loss_fn(tf.constant(y), y_pred).numpy(), alone, rtol=1e-5)


def test_circle_through_fit_moves_the_weights_at_most_lr_2c_over_b():
    """As above with Keras's pairwise `circle` loss (batched: 0.41)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    labels = rng.integers(0, 2, size=16).astype(np.int32)
    changed = x.copy()
    changed[3] = 1e3
    middle = lambda: keras.layers.Dense(4)  # noqa: E731
    moved = np.linalg.norm(
        _fit_weights(x, labels, middle, "circle") - _fit_weights(changed, labels, middle, "circle")
    )
    assert moved <= 1.0 * 2 * 1.0 / 8 * (1 + 1e-4)


def test_row_wise_keras_losses_are_not_wrapped():
    """Control: the usual losses run batched, as before (no per-row map);
    the same classes configured to reduce over the batch are wrapped."""
    from tfdp.models.losses import unreduced_loss

    assert unreduced_loss("mse") is keras.losses.mean_squared_error
    crossentropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    assert unreduced_loss(crossentropy) == crossentropy.call
    over_batch = keras.losses.CategoricalCrossentropy(axis=0)
    assert unreduced_loss(over_batch) != over_batch.call
    along_rows = keras.losses.CategoricalCrossentropy(axis=-1)
    assert unreduced_loss(along_rows) == along_rows.call
    own_call = _CentredLoss()
    assert unreduced_loss(own_call) != own_call.call
    wrapped = LossFunctionWrapper(keras.losses.cosine_similarity, axis=0)
    assert unreduced_loss(wrapped) != wrapped.call


@pytest.mark.parametrize("activation", ["softmax", "log_softmax", "sparsemax"])
def test_a_softmax_activation_over_a_batch_of_scalars_is_named(activation):
    """`Activation("softmax")` normalizes over the last axis, which for a
    rank-1 tensor (one scalar per example) is the batch: one example moved
    another's gradient by 100% on the batched path (sparsemax: a review
    moved a neighbouring step 2.4x its bound)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    scores = keras.layers.Dense(1)(inputs)[:, 0]                  # [B]
    weights = keras.layers.Activation(activation)(scores)[:, None]
    model = keras.Model(inputs, keras.layers.Dense(2)(weights))
    plan = plan_for(model)
    assert plan.path == "vectorized" and "Activation" in plan.reason, plan.describe()
    before, after = _first_example_grads(model)
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_softmax_activation_over_features_keeps_the_batched_path():
    assert plan_for(_model(keras.layers.Activation("softmax"))).path == "batched"


ATTENTIONS = {"dot": lambda: keras.layers.Attention(),
              "concat": lambda: keras.layers.Attention(score_mode="concat"),
              "additive": lambda: keras.layers.AdditiveAttention()}


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
def test_attention_over_rank_2_inputs_is_named(kind):
    """[B, D] queries and keys give [B, B] scores: every example attends over
    the batch (a review moved a neighbouring step 5.6x to 7.4x its bound on
    the batched path); the vectorized path keeps each example alone."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    q = keras.layers.Dense(4)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(ATTENTIONS[kind]()([q, q])))
    plan = plan_for(model)
    assert plan.path == "vectorized" and "attends over the batch" in plan.reason, plan.describe()
    before, after = _first_example_grads(model)
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
def test_attention_over_sequences_keeps_the_batched_path(kind):
    inputs = keras.Input((5, 4))
    q = keras.layers.Dense(4)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(ATTENTIONS[kind]()([q, q]))
    assert plan_for(keras.Model(inputs, keras.layers.Dense(2)(h))).path == "batched"


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
def test_attention_of_rank_3_queries_over_rank_2_values_is_named(kind):
    """[B, 1, D] queries over [B, D] values: scores [B, 1, B] (a review moved
    a neighbouring step 4.5x to 4.7x its bound when only the query's rank
    was read)."""
    inputs = keras.Input((4,))
    v = keras.layers.Dense(4)(inputs)
    q = keras.layers.Reshape((1, 4))(v)
    h = keras.layers.Flatten()(ATTENTIONS[kind]()([q, v]))
    plan = plan_for(keras.Model(inputs, keras.layers.Dense(2)(h)))
    assert plan.path == "vectorized" and "attends over the batch" in plan.reason


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
def test_attention_of_rank_4_queries_over_rank_3_values_is_named(kind):
    """Attention lines up the axes before the last two from the right: a
    [B, 1, T, D] query over [B, T, D] values scores [B, B, T, T] (a review
    moved a neighbouring step 7.3x its bound)."""
    inputs = keras.Input((3, 4))
    v = keras.layers.Dense(4)(inputs)
    q = keras.layers.Reshape((1, 3, 4))(v)
    h = keras.layers.GlobalAveragePooling2D()(ATTENTIONS[kind]()([q, v]))
    plan = plan_for(keras.Model(inputs, keras.layers.Dense(2)(h)))
    assert plan.path == "vectorized" and "attends over the batch" in plan.reason


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
def test_masked_attention_over_sequences_keeps_the_batched_path(kind):
    """Its [B, T] masks are one rank below its inputs, as Keras expects
    (refused on ccf6aa7, which read the masks' ranks as inputs')."""
    from tfdp.per_example.configuration import configuration_problem

    inputs = keras.Input((5, 4))
    mask = keras.Input((5,), dtype="bool")
    q = keras.layers.Dense(4)(inputs)
    attention = ATTENTIONS[kind]()
    attention([q, q], mask=[mask, mask])
    assert configuration_problem(attention) is None


def _masked_attention_classifier(kind):
    """Token ids, an Embedding with mask_zero, masked attention given its
    masks as a list, masked pooling: Keras adds a ConvertToTensor node where
    the pooling converts the attention's output mask."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 4, mask_zero=True)(tokens)
    mask = keras.ops.not_equal(tokens, 0)
    h = ATTENTIONS[kind]()([h, h], mask=[mask, mask])
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(2)(h))


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
def test_a_masked_attention_classifier_keeps_the_batched_path(kind):
    """Its ConvertToTensor node converts a mask entry by entry (it sent the
    model to the vectorized path before ConvertToTensor was allowed); each
    example's gradients equal the exact path's, and an outlier and a padded
    example beside it move none of them."""
    model = _masked_attention_classifier(kind)
    assert any(type(op).__name__ == "ConvertToTensor" for op in model.operations)
    assert plan_for(model).path == "batched", plan_for(model).describe()
    ids = np.array([[3, 5, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6], [7, 0, 0, 0, 0, 0]], np.int32)
    crafted = ids.copy()
    crafted[1] = [19, 19, 19, 19, 19, 0]
    y = np.array([0, 1, 1])
    grads = {}
    for method in ("batched", "vectorized"):
        for name, batch in (("ordinary", ids), ("crafted", crafted)):
            parts = compute_per_example_gradients(
                model, tf.constant(batch), tf.constant(y), tf.ones([3]),
                per_example_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
                method)[0]
            grads[method, name] = [g.numpy() for g in parts.materialize()]
    for a, b in zip(grads["batched", "ordinary"], grads["vectorized", "ordinary"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads["batched", "ordinary"], grads["batched", "crafted"]):
        np.testing.assert_allclose(a[[0, 2]], b[[0, 2]], rtol=1e-5, atol=1e-6)


def _mha_model(mask_shape):
    sequence = keras.Input((5, 4))
    mask = keras.Input(mask_shape, dtype="bool")
    query = keras.layers.Reshape((1, 4))(keras.layers.GlobalAveragePooling1D()(sequence))
    h = keras.layers.MultiHeadAttention(1, 4)(query, sequence, attention_mask=mask)
    return keras.Model([sequence, mask], keras.layers.Dense(2)(keras.layers.Flatten()(h)))


def test_multi_head_attention_with_a_mask_missing_the_query_axis_is_named():
    """A [B, S] attention mask is padded in front to [1, 1, B, S]: with one
    query position every example is masked by every other's (a review moved
    a neighbouring step 1.7x its bound)."""
    plan = plan_for(_mha_model((5,)))
    assert plan.path == "vectorized" and "attention mask of rank 2" in plan.reason


def test_multi_head_attention_with_a_full_mask_keeps_the_batched_path():
    assert plan_for(_mha_model((1, 5))).path == "batched"


def test_multi_head_attention_over_two_axes_with_query_and_value_masks_is_named():
    """With attention_axes=(1, 2) Keras builds a rank-4 mask from [B, H, W]
    masks for rank-5 scores and pads it in front: with B == H == W it runs,
    every example masked by the others' (a review moved a neighbouring step
    1.26x its bound)."""
    inputs = keras.Input((4, 4, 2))
    mask = keras.Input((4, 4), dtype="bool")
    h = keras.layers.MultiHeadAttention(1, 2, attention_axes=(1, 2))(
        inputs, inputs, query_mask=mask, value_mask=mask)
    model = keras.Model([inputs, mask], keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    plan = plan_for(model)
    assert plan.path == "vectorized" and "2 attention axes" in plan.reason


def test_multi_head_attention_over_two_axes_with_a_full_mask_keeps_the_batched_path():
    inputs = keras.Input((4, 4, 2))
    mask = keras.Input((4, 4, 4, 4), dtype="bool")
    h = keras.layers.MultiHeadAttention(1, 2, attention_axes=(1, 2))(
        inputs, inputs, attention_mask=mask)
    model = keras.Model([inputs, mask], keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    assert plan_for(model).path == "batched", plan_for(model).reason


@pytest.mark.parametrize("attention", ["MultiHeadAttention", "GroupQueryAttention"])
def test_a_static_batch_size_keeps_the_attention_mask_checks(attention):
    """Inputs with batch_size=4 give every graph tensor a first axis of 4:
    read as a length, it looked like no batch, and a [B, S] attention mask
    passed (a review moved a neighbouring step 3.4x its bound with
    MultiHeadAttention, 3.16x with GroupQueryAttention). Every KerasTensor
    of a recorded call leads with the batch, whatever its length."""
    sequence = keras.Input((4, 2), batch_size=4)
    mask = keras.Input((4,), dtype="bool", batch_size=4)
    layer = (keras.layers.MultiHeadAttention(1, 2) if attention == "MultiHeadAttention"
             else keras.layers.GroupQueryAttention(2, 2, 1))
    h = layer(sequence, sequence, attention_mask=mask)
    plan = plan_for(keras.Model([sequence, mask], keras.layers.Dense(2)(keras.layers.Flatten()(h))))
    assert plan.path == "vectorized" and "attention mask of rank 2" in plan.reason, plan.describe()


@pytest.mark.parametrize("passed", ["array", "nested lists"])
def test_a_constant_attention_mask_keeps_the_batched_path(passed):
    """A mask that is not a graph tensor (a causal [T, T] array), which
    MultiHeadAttention pads in front, holds no batch."""
    sequence = keras.Input((5, 4))
    causal = np.tril(np.ones((5, 5), bool))
    h = keras.layers.MultiHeadAttention(1, 4)(
        sequence, sequence, attention_mask=causal.tolist() if passed == "nested lists" else causal)
    model = keras.Model(sequence, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    assert plan_for(model).path == "batched", plan_for(model).describe()


def _implicitly_masked_attention(masking):
    """MultiHeadAttention over both axes of rank-4 inputs (its default for
    them), its query and value masks carried by the input tensor (from an
    Embedding with mask_zero, or Masking), not passed as arguments."""
    keras.utils.set_random_seed(0)
    if masking == "embedding":
        tokens = keras.Input((4, 4), dtype="int32")
        h = keras.layers.Embedding(5, 2, mask_zero=True, embeddings_initializer=(
            keras.initializers.RandomNormal(stddev=3.0, seed=0)))(tokens)
    else:
        tokens = keras.Input((4, 4, 2))
        h = keras.layers.Masking(0.0)(tokens)
    h = keras.layers.MultiHeadAttention(1, 2, attention_axes=(1, 2))(h, h)
    return tfdp.DPModel(tokens, keras.layers.Dense(1)(keras.layers.Flatten()(h)))


@pytest.mark.parametrize("masking", ["embedding", "masking"])
def test_masks_carried_by_the_inputs_are_read(masking):
    """Keras passes a tensor's own mask to an attention's empty mask
    arguments; only the arguments were read (a review moved a neighbouring
    step 2.81x its bound through Embedding(mask_zero=True), 1.56x through
    Masking)."""
    plan = plan_for(_implicitly_masked_attention(masking))
    assert plan.path == "vectorized" and "query mask with 2 attention axes" in plan.reason, \
        plan.describe()


def test_masks_carried_by_the_inputs_keep_the_step_bound():
    """The compiled step (noise 0) on records of random tokens, the batch as
    long as each attention axis."""
    from tfdp.auditing.neighbour_step import NeighbourStep

    model = _implicitly_masked_attention("embedding")
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=0.01, noise_multiplier=1.0),
                  loss="mse", jit_compile=True)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 5, (3, 4, 4)).astype("int32")
    targets = (0.3 * rng.normal(size=(3, 1))).astype("float32")
    ratios = []
    with NeighbourStep(model, (tokens, targets), records=3, batch_size=4,
                       physical_batch_size=4) as step:
        for _ in range(6):
            record = (rng.integers(0, 5, (4, 4)).astype("int32"), np.zeros(1, "float32"))
            ratios += [step.ratio(record, relation)
                       for relation in ("add", "add, record first", "replace")]
    assert max(ratios) <= 1.0 + 1e-5, max(ratios)
