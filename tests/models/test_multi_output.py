"""Several outputs (`tfdp.models.multi_output`): each example's loss is the
weighted sum of its heads' losses, and its gradient over every head is
clipped as ONE unit (one clip per head would let a record move the update by
up to sqrt(2) C with two heads)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.auditing.neighbour_step import NeighbourStep
from tfdp.per_example import compute_per_example_gradients

L = keras.layers
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CLIP = 0.05


def two_heads(clip=CLIP, loss=None, loss_weights="default", outputs="list", seed=0, noise_seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    h = L.Dense(6, activation="tanh")(inputs)
    kind, size = L.Dense(3, name="kind")(h), L.Dense(1, name="size")(h)
    heads = [kind, size] if outputs == "list" else {"kind": kind, "size": size}
    model = tfdp.DPModel(inputs, heads)
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=clip, noise_multiplier=1.0,
                                        seed=noise_seed),
        loss={"kind": SCE, "size": "mse"} if loss is None else loss,
        loss_weights={"kind": 1.0, "size": 0.5} if loss_weights == "default" else loss_weights,
    )
    return model


def data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, rng.integers(0, 3, n), rng.normal(size=(n, 1)).astype("float32")


@pytest.fixture(scope="module")
def model():
    built = two_heads()
    built(np.zeros((1, 4), "float32"))
    return built


def per_example(model, x, y, loss_fn=None):
    grads, _, _ = compute_per_example_gradients(
        model, tf.constant(x), y, tf.ones([len(x)]), loss_fn or model._per_example_loss)
    return grads


def clipped_sum_norm(model, grads):
    sums, _ = model.optimizer.clipped_sum(
        grads, {"mask": tf.ones([grads.sq_norms().shape[0]]), "expected_batch_size": tf.constant(1.0)})
    return float(tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(s)) for s in sums])))


def test_the_per_example_loss_is_the_weighted_sum_of_the_heads_losses(model):
    x, kind, size = data(6)
    predictions = model(x)
    joint = model._per_example_loss((kind, size), predictions).numpy()
    by_hand = (1.0 * keras.losses.sparse_categorical_crossentropy(kind, predictions[0], from_logits=True)
               + 0.5 * np.mean(np.square(size - predictions[1].numpy()), axis=-1))
    np.testing.assert_allclose(joint, by_hand, rtol=1e-5)
    by_name = model._per_example_loss({"size": size, "kind": kind}, predictions).numpy()
    np.testing.assert_array_equal(joint, by_name)


@pytest.mark.parametrize("method", ["batched", "vectorized"])
def test_each_example_gradient_is_the_tape_gradient_of_its_weighted_sum(model, method):
    x, kind, size = data(3)
    grads, _, _ = compute_per_example_gradients(
        model, tf.constant(x), (tf.constant(kind), tf.constant(size)), tf.ones([3]),
        model._per_example_loss, method)
    materialized = grads.materialize()
    for i in range(3):
        with tf.GradientTape() as tape:
            kind_pred, size_pred = model(x[i:i + 1], training=True)
            total = (1.0 * SCE(kind[i:i + 1], kind_pred)
                     + 0.5 * tf.reduce_mean(tf.square(size[i:i + 1] - size_pred)))
        expected = tape.gradient(total, model.trainable_variables)
        for got, want in zip(materialized, expected):
            np.testing.assert_allclose(got[i].numpy(), want.numpy(), rtol=1e-4, atol=1e-6)


def crafted_record():
    """Both heads' gradients far above C: the size target far out, the kind
    label wrong with a confident input."""
    x = np.full((1, 4), 3.0, "float32")
    return x, (np.array([2]), np.array([[1e4]], "float32"))


def test_the_joint_gradient_is_clipped_as_one_unit_not_once_per_head(model):
    x, y = crafted_record()
    joint = clipped_sum_norm(model, per_example(model, x, y))
    assert joint <= CLIP * (1 + 1e-6)
    assert joint >= CLIP * (1 - 1e-4)  # the record's gradient is far above C: clipped to C
    # Negative control: each head's gradient clipped to C on its own, then summed,
    # moves the update by up to sqrt(2) C: the check above would catch it.
    from tfdp.models.multi_output import OutputLosses

    losses = model._per_example_loss
    per_head = []
    for keep in ("kind", "size"):
        one = OutputLosses(losses.names, [f if n == keep else None for n, f in
                                          zip(losses.names, losses.losses)], losses.weights)
        sums, _ = model.optimizer.clipped_sum(
            per_example(model, x, y, one), {"mask": tf.ones([1]), "expected_batch_size": tf.constant(1.0)})
        per_head.append(sums)
    summed = [a + b for a, b in zip(*per_head)]
    per_head_norm = float(tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(s)) for s in summed])))
    assert per_head_norm > 1.3 * CLIP


def test_the_train_step_moves_the_update_by_at_most_the_bound_for_a_crafted_record(model):
    """The model's own train function, on neighbouring batches (the
    sensitivity search's step), with a record whose size target is far out."""
    x, kind, size = data(4)
    step = NeighbourStep(model, (x, (kind, size)), records=3, batch_size=4, physical_batch_size=None)
    with step:
        ratio = step.ratio((np.full(4, 3.0, "float32"), (np.int64(2), np.array([1e4], "float32"))))
    assert 0.99 < ratio <= 1 + 1e-5


def test_the_sensitivity_search_covers_a_two_head_model(model):
    x, kind, size = data(6)
    result = tfdp.auditing.sensitivity_search(model, x, {"kind": kind, "size": size}, records=4,
                                              search_steps=2)
    assert result.worst_ratio <= 1 + 1e-5, result.summary()


def test_loss_weights_change_the_clipped_sum_as_expected():
    x, kind, size = data(4)
    y = (kind, size)
    sums = {}
    for name, weights in [("both", [1.0, 0.5]), ("kind", [1.0, 0.0]), ("double", [1.0, 1.0])]:
        model = two_heads(clip=1e6, loss=[SCE, "mse"], loss_weights=weights)
        grads = per_example(model, x, y)
        sums[name], _ = model.optimizer.clipped_sum(
            grads, {"mask": tf.ones([4]), "expected_batch_size": tf.constant(1.0)})
    size_part = [b - k for b, k in zip(sums["both"], sums["kind"])]  # 0.5 x the size loss's
    for doubled, half, kind_only in zip(sums["double"], size_part, sums["kind"]):
        np.testing.assert_allclose(doubled.numpy(), (kind_only + 2 * half).numpy(),
                                   rtol=1e-4, atol=1e-6)
    assert any(float(tf.reduce_max(tf.abs(h))) > 1e-3 for h in size_part)


@pytest.mark.parametrize("loss, y_form", [([SCE, "mse"], "dict"), ({"kind": SCE, "size": "mse"}, "list")])
def test_list_and_dict_losses_train_with_list_or_dict_targets(loss, y_form):
    model = two_heads(clip=1.0, loss=loss, loss_weights=[1.0, 0.5])
    x, kind, size = data()
    y = [kind, size] if y_form == "list" else {"size": size, "kind": kind}
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.privacy.steps == 4
    logs = {k: v[-1] for k, v in history.history.items()}
    assert np.isfinite(logs["loss"]) and logs["kind_loss"] > 0 and logs["size_loss"] > 0
    # The logged loss is the weighted sum of the heads' (their means over drawn examples).
    assert logs["loss"] == pytest.approx(logs["kind_loss"] + 0.5 * logs["size_loss"], rel=1e-4)


def test_dict_outputs_physical_batches_per_output_weights_and_user_level_train():
    model = two_heads(clip=1.0, outputs="dict")
    x, kind, size = data()
    model.fit(x, {"kind": kind, "size": size}, batch_size=8, physical_batch_size=4,
              sample_weight={"size": np.full(32, 2.0)}, validation_split=0.25, verbose=0)
    users = np.repeat(np.arange(8), 4)
    model = two_heads(clip=1.0, outputs="dict")  # user-level from its first step
    model.fit(x, {"kind": kind, "size": size}, batch_size=4, user_ids=users,
              examples_per_user=2, verbose=0)
    assert model.privacy.steps > 0
    result = model.evaluate(x, {"kind": kind, "size": size}, verbose=0, return_dict=True)
    assert set(result) >= {"loss", "kind_loss", "size_loss"}


def test_keras_evaluate_loss_is_the_mean_of_the_per_example_losses(model):
    x, kind, size = data(8)
    per_example_losses = model._per_example_loss((kind, size), model(x)).numpy()
    evaluated = model.evaluate(x, [kind, size], batch_size=8, verbose=0, return_dict=True)
    assert evaluated["loss"] == pytest.approx(float(np.mean(per_example_losses)), rel=1e-5)


@pytest.mark.parametrize("outputs, loss", [("dict", {"kind": SCE}), ("list", [SCE, None])])
def test_an_output_without_a_loss_gets_no_gradient_from_it(outputs, loss):
    model = two_heads(clip=1e6, loss=loss, loss_weights=None, outputs=outputs)
    x, kind, size = data(4)
    y = {"kind": kind} if outputs == "dict" else [kind, size]  # a dict may leave it out
    grads = per_example(model, x, y).materialize()
    size_head = [g for g, v in zip(grads, model.trainable_variables) if "size" in v.path]
    assert size_head and all(float(tf.reduce_max(tf.abs(g))) == 0.0 for g in size_head)
    if outputs == "dict":
        model.fit(x, y, batch_size=2, verbose=0)
        assert model.privacy.steps == 2


def test_per_output_sample_weights_weigh_their_output_inside_each_example(model):
    x, kind, size = data(8)
    weights = np.linspace(0.0, 2.0, 8).astype("float32")
    predictions = model(x)
    losses = model._per_example_loss
    weighted = losses.weighted_by_output(((kind, size), {"size": weights}), predictions).numpy()
    kind_loss = keras.losses.sparse_categorical_crossentropy(kind, predictions[0], from_logits=True)
    size_loss = np.mean(np.square(size - predictions[1].numpy()), axis=-1)
    np.testing.assert_allclose(weighted, kind_loss + 0.5 * weights * size_loss, rtol=1e-5)
    # Keras's own loss with the same per-output weights: the mean of these.
    evaluated = model.evaluate(x, [kind, size], sample_weight=[np.ones(8), weights], batch_size=8,
                               verbose=0, return_dict=True)
    assert evaluated["loss"] == pytest.approx(float(np.mean(weighted)), rel=1e-5)


def test_save_and_load_keep_the_losses_weights_and_ledger(tmp_path):
    model = two_heads(clip=1.0)
    x, kind, size = data()
    model.fit(x, [kind, size], batch_size=8, steps_per_epoch=1, verbose=0)
    path = tmp_path / "two_heads.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.privacy.steps == model.privacy.steps
    for got, want in zip(loaded.predict(x, verbose=0), model.predict(x, verbose=0)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert loaded._per_example_loss.names == ["kind", "size"]
    assert loaded._per_example_loss.weights == [1.0, 0.5]
    np.testing.assert_allclose(loaded._per_example_loss((kind, size), loaded(x)),
                               model._per_example_loss((kind, size), model(x)), rtol=1e-6)
    loaded.fit(x, [kind, size], batch_size=8, steps_per_epoch=1, verbose=0)
    assert loaded.privacy.steps == 2


@pytest.mark.parametrize("compile_args, match", [
    (dict(loss={"kind": SCE, "colour": "mse"}), r"outputs the model does not have: \['colour'\]"),
    (dict(loss=[SCE]), r"one `loss` entry per output \(2: \['kind', 'size'\]\)"),
    (dict(loss={"kind": None, "size": None}), r"No output of \['kind', 'size'\] has a loss"),
    (dict(loss={"kind": SCE}), r"names every output: \['size'\] missing. Give an output"),
    (dict(loss=[SCE, "mse"], loss_weights=0.5), r"takes `loss_weights` as a list"),
    (dict(loss=[SCE, "mse"], loss_weights=[1.0, float("nan")]), r"loss weight of output 'size'"),
    (dict(loss=[SCE, None, "mse"]), r"one `loss` entry per output"),
])
def test_compile_refuses_losses_that_do_not_match_the_outputs(compile_args, match):
    inputs = keras.Input((4,))
    model = tfdp.DPModel(inputs, [L.Dense(3, name="kind")(inputs), L.Dense(1, name="size")(inputs)])
    with pytest.raises(ValueError, match=match):
        model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                      **compile_args)


@pytest.mark.parametrize("fit_args, match", [
    (dict(y="one"), r"2 outputs \['kind', 'size'\]: give `y` as a list"),
    (dict(y="missing"), r"missing: \['size'\]"),
    (dict(sample_weight="per_output"), r"one `sample_weight` entry per output"),
    (dict(sample_weight="per_token"), r"one sample weight per example \(shape \[N\]\)"),
    (dict(class_weight={0: 1.0, 1: 1.0, 2: 1.0}), r"`class_weight` is not supported"),
    (dict(y="short"), r"target in `y` to have one row per example. Received: y with \[5, 32\] rows"),
])
def test_fit_refuses_what_it_cannot_train_before_the_first_step(fit_args, match):
    model = two_heads(clip=1.0)
    x, kind, size = data()
    y = {"one": kind, "missing": {"kind": kind}, "short": [kind, size[:5]]}.get(
        fit_args.pop("y", None), [kind, size])
    weights = {"per_output": [np.ones(32)] * 3, "per_token": np.ones((32, 3))}
    if "sample_weight" in fit_args:
        fit_args["sample_weight"] = weights[fit_args["sample_weight"]]
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=8, verbose=0, **fit_args)
    assert model.privacy.steps == 0


def test_label_ranges_are_checked_per_output():
    model = two_heads(clip=1.0)
    x, kind, size = data()
    kind[3] = 7
    with pytest.raises(ValueError, match=r"class indices in \[0, 2\].*y\[0\].*index 3"):
        model.fit(x, [kind, size], batch_size=8, verbose=0)
    assert model.privacy.steps == 0


def test_the_private_search_refuses_several_outputs_before_its_draw(monkeypatch):
    pytest.importorskip("keras_tuner")
    from tfdp.tuning import PrivateRandomSearch
    from tfdp.tuning import search as search_module

    monkeypatch.setattr(search_module, "_IN_PROCESS", True)  # no child process: fast

    def build(hp):
        return two_heads(clip=hp.Float("clip", 0.5, 1.0), noise_seed=None)

    x, kind, size = data()
    search = PrivateRandomSearch(build, mean_trials=2)
    with pytest.raises(ValueError, match=r"does not search models with several outputs.*"
                                         r"Received: a model with 2 outputs \['kind', 'size'\]"):
        search.search(x, kind, batch_size=8, validation_split=0.25)
    with pytest.raises(ValueError, match=r"several outputs.* Received: y as a dict"):
        search.search(x, {"kind": kind, "size": size}, batch_size=8, validation_split=0.25)


class TwoHeadsModel(tfdp.DPModel):
    def __init__(self):
        super().__init__()
        self.hidden, self.kind, self.size = L.Dense(6), L.Dense(3), L.Dense(1)

    def call(self, x):
        h = self.hidden(x)
        return [self.kind(h), self.size(h)]


def test_a_subclassed_model_with_several_outputs_trains_with_a_list_of_losses():
    model = TwoHeadsModel()
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=[SCE, "mse"], loss_weights=[1.0, 0.5])
    x, kind, size = data()
    model.fit(x, [kind, size], batch_size=8, verbose=0)
    assert model.privacy.steps == 4 and model._per_example_loss.names == ["output_0", "output_1"]
