"""DPModel / DPSequential end to end: training, errors, saving, export."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import recipes
from tfdp.data import load_digits
from tests.noiseless import NoiselessDPSGD


def small_model(method="auto"):
    return tfdp.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)],
        per_example_gradients=method,
    )


def small_data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, size=n)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("method", ["fast", "vectorized"])
def test_noiseless_full_batch_step_equals_plain_sgd(method):
    """Noise 0, huge C, q = 1: one DP step is exactly the plain mean-gradient step."""
    x, y = small_data()
    keras.utils.set_random_seed(3)
    model = small_model(method)
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    for plain_layer, dp_layer in zip(plain.layers, model.layers):
        plain_layer.set_weights(dp_layer.get_weights())
    model.compile(optimizer=NoiselessDPSGD(0.3, l2_norm_clip=1e9, noise_multiplier=1.0), loss=LOSS)
    model.fit(x, y, batch_size=len(x), epochs=1, steps_per_epoch=1, verbose=0)
    plain.compile(optimizer=keras.optimizers.SGD(0.3), loss=LOSS)
    plain.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.trainable_variables, plain.trainable_variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_plain_keras_model_with_dp_optimizer_is_refused():
    x, y = small_data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=LOSS)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="per-example"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_dp_model_refuses_a_non_private_optimizer():
    with pytest.raises(ValueError, match="Received: optimizer=SGD"):
        small_model().compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(l2_norm_clip=-1.0, noise_multiplier=1.0), "Received: l2_norm_clip=-1.0"),
        (dict(l2_norm_clip=1.0, noise_multiplier=0.0), "Received: noise_multiplier=0.0"),
        (dict(l2_norm_clip=float("nan"), noise_multiplier=1.0), "Received: l2_norm_clip=nan"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, weight_decay=-0.1), "Received: weight_decay=-0.1"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, weight_decay_placement="x"), "weight_decay_placement='x'"),
    ],
)
def test_bad_optimizer_settings_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfdp.optimizers.DPSGD(0.1, **kwargs)


def compiled_small_model():
    model = small_model()
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=LOSS)
    return model


def test_bad_training_data_is_refused_before_training():
    x, y = small_data()
    model = compiled_small_model()
    with pytest.raises(ValueError, match="Received: batch_size=41"):
        model.fit(x, y, batch_size=41, verbose=0)
    with pytest.raises(ValueError, match="0 examples"):
        model.fit(x[:0], y[:0], batch_size=1, verbose=0)
    with pytest.raises(ValueError, match="Received: y with 39 entries"):
        model.fit(x, y[:-1], batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"Labels must be class indices in \[0, 2\]"):
        model.fit(x, y + 5, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="Poisson"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), verbose=0)
    assert model.privacy.steps == 0


def test_budget_stops_training_before_it_is_exceeded():
    x, y = small_data(200)
    model = compiled_small_model()
    budget = tfdp.callbacks.PrivacyBudget(epsilon=10.0, delta=1e-5)
    history = model.fit(x, y, batch_size=20, epochs=50, callbacks=[budget], verbose=0)
    assert budget.stopped_for_budget
    assert model.privacy.epsilon(1e-5) <= 10.0
    assert model.privacy.epsilon(1e-5, extra_steps=1) > 10.0
    assert history.history["epsilon"][-1] == pytest.approx(model.privacy.epsilon(1e-5))
    with pytest.raises(ValueError, match="no room for another step"):
        model.fit(x, y, batch_size=20, epochs=1, callbacks=[budget], verbose=0)


@pytest.fixture(scope="module")
def three_epochs(tmp_path_factory):
    """A small model fitted 3 epochs at q = 0.1 (30 steps) with a CSV log,
    its data and the log's path: the tests below read it and do not train it
    further (they save, load or export it)."""
    x, y = small_data(100)
    model = compiled_small_model()
    path = tmp_path_factory.mktemp("three_epochs") / "log.csv"
    model.fit(x, y, batch_size=10, epochs=3, callbacks=[keras.callbacks.CSVLogger(str(path))],
              verbose=0)
    return model, x, y, path


@pytest.mark.xdist_group("dp_model_three_epochs")  # one worker: the fixture fits once
def test_ledger_counts_steps_with_the_poisson_event(three_epochs):
    model = three_epochs[0]
    assert model.privacy.steps == 30
    expected = tfdp.accounting.compute_epsilon(1.0, 0.1, 30, 1e-5)
    assert model.privacy.epsilon(1e-5) == pytest.approx(expected, rel=1e-12)


@pytest.mark.xdist_group("dp_model_three_epochs")
def test_save_load_resume_keeps_the_ledger(tmp_path, three_epochs):
    model, x, y, _ = three_epochs
    path = str(tmp_path / "m.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert isinstance(restored, tfdp.DPSequential)
    assert isinstance(restored.optimizer, tfdp.optimizers.DPSGD)
    assert restored.privacy.steps == 30
    assert restored.privacy.epsilon(1e-5) == pytest.approx(model.privacy.epsilon(1e-5))
    assert int(restored.optimizer.iterations.numpy()) == 30
    np.testing.assert_allclose(restored.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    restored.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert restored.privacy.steps == 40
    assert restored.privacy.epsilon(1e-5) == pytest.approx(
        tfdp.accounting.compute_epsilon(1.0, 0.1, 40, 1e-5), rel=1e-12
    )
    assert "_noise_key" not in str(restored.optimizer.get_config())


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: tfdp.optimizers.DPSGD(0.1, momentum=0.9, l2_norm_clip=1.0, noise_multiplier=1.0),
        lambda: tfdp.optimizers.DPOptimizer(keras.optimizers.Adam(0.01), 1.0, 1.0),
    ],
    ids=["dpsgd_momentum", "dp_adam"],
)
def test_save_load_keeps_the_inner_optimizers_slots(tmp_path, make_optimizer):
    x, y = small_data(100)
    model = small_model()
    model.compile(optimizer=make_optimizer(), loss=LOSS)
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    saved = [v.numpy() for v in model.optimizer.inner_optimizer.variables]
    # Non-vacuous: training left non-zero momentum / moment estimates.
    assert sum(np.count_nonzero(v) for v in saved[1:]) > 0
    path = str(tmp_path / "slots.keras")
    model.save(path)
    restored = keras.models.load_model(path).optimizer.inner_optimizer
    assert type(restored) is type(model.optimizer.inner_optimizer)
    assert [v.shape for v in restored.variables] == [v.shape for v in saved]
    for before, after in zip(saved, restored.variables):
        np.testing.assert_array_equal(after.numpy(), before)


def test_validation_split_trains_on_the_rest_and_accounts_for_it():
    x, y = small_data(100)
    model = compiled_small_model()
    history = model.fit(x, y, batch_size=10, epochs=2, validation_split=0.2, verbose=0)
    assert len(history.history["val_loss"]) == 2
    # 80 training records: 8 steps an epoch at q = 10 / 80.
    assert model.privacy.steps == 16
    expected = tfdp.accounting.compute_epsilon(1.0, 10 / 80, 16, 1e-5)
    assert model.privacy.epsilon(1e-5) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="validation_split"):
        model.fit(x, y, batch_size=10, validation_split=1.5, verbose=0)


@pytest.mark.xdist_group("dp_model_three_epochs")
def test_epsilon_reaches_the_other_loggers(three_epochs):
    path = three_epochs[3]
    rows = path.read_text().splitlines()
    column = rows[0].split(",").index("epsilon")
    logged = [float(row.split(",")[column]) for row in rows[1:]]
    expected = [tfdp.accounting.compute_epsilon(1.0, 0.1, 10 * e, 1e-5) for e in (1, 2, 3)]
    np.testing.assert_allclose(logged, expected, rtol=1e-9)


def test_batch_normalization_in_training_mode_is_refused_before_a_step():
    model = tfdp.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(5), keras.layers.BatchNormalization(),
         keras.layers.Dense(3)]
    )
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=LOSS
    )
    x = np.zeros((8, 4), "float32")
    with pytest.raises(ValueError, match="runs in training mode.*depends on the others"):
        model.fit(x, np.zeros(8, "int32"), batch_size=4, epochs=1, verbose=0)
    assert model.privacy.steps == 0


def test_weights_file_without_ledger_is_refused(tmp_path):
    plain = keras.Sequential([keras.Input((4,))] + small_model().layers)
    path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(path)
    with pytest.raises(ValueError, match="no tfdp privacy ledger"):
        small_model().load_weights(path)


def test_functional_dp_model_round_trip(tmp_path):
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(6, activation="relu")(inputs))
    model = tfdp.DPModel(inputs, outputs, per_example_gradients="vectorized")
    model.compile(optimizer=tfdp.optimizers.DPOptimizer(keras.optimizers.Adam(0.01), 1.0, 1.0), loss=LOSS)
    x, y = small_data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "f.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert isinstance(restored, tfdp.DPModel)
    assert restored.per_example_gradients == "vectorized"
    assert isinstance(restored.optimizer.inner_optimizer, keras.optimizers.Adam)
    assert restored.privacy.steps == model.privacy.steps


@pytest.mark.xdist_group("dp_model_three_epochs")
def test_export_predicts_the_same_and_holds_no_optimizer_state(tmp_path, three_epochs):
    model, x, _, _ = three_epochs
    path = str(tmp_path / "export")
    model.export(path, verbose=False)
    loaded = tf.saved_model.load(path)
    # predict runs batches of 32, serve the whole array: TensorFlow's own
    # CPU matmul (oneDNN off) rounds a row by the batch it is in.
    np.testing.assert_allclose(loaded.serve(tf.constant(x)).numpy(), model.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)
    names = [v.name for v in loaded.variables]
    assert not any("iteration" in n or "momentum" in n or "noise" in n for n in names), names
    assert len(loaded.variables) <= len(model.weights)


def test_weight_decay_before_clip_reaches_the_ridge_optimum():
    """Seed 003's toy: L = (theta - 3.8)^2 / 2, C = 1, lambda = 0.5, ~no noise.

    Classic decay (after noise) is pinned at C / lambda = 2; decay inside the
    per-example loss converges to the ridge optimum 3.8 / 1.5 = 2.533.
    """
    x = np.ones((8, 1), np.float32)
    y = np.full((8, 1), 3.8, np.float32)
    results = {}
    for placement in ("after_noise", "before_clip"):
        model = tfdp.DPSequential(
            [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
        )
        model.compile(
            optimizer=NoiselessDPSGD(
                0.2, l2_norm_clip=1.0, noise_multiplier=1.0, weight_decay=0.5,
                weight_decay_placement=placement,
            ),
            loss=lambda t, p: 0.5 * tf.reduce_sum(tf.square(t - p), -1),
        )
        # 300 steps in one epoch (not 300 epochs of one step: the same steps,
        # without 300 epochs' callbacks and data iterators).
        model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=300, verbose=0)
        assert model.privacy.steps == 300
        results[placement] = float(model.trainable_variables[0].numpy().squeeze())
    assert results["after_noise"] == pytest.approx(2.0, abs=1e-3)
    assert results["before_clip"] == pytest.approx(3.8 / 1.5, abs=1e-3)


def test_digits_reaches_90_percent_at_epsilon_3():
    (x_train, y_train), (x_test, y_test) = load_digits()
    defaults = recipes.DEFAULTS["digits"]
    steps = defaults["epochs"] * round(len(x_train) / defaults["batch_size"])
    sigma = tfdp.accounting.calibrate_noise_multiplier(3.0, 1e-5, defaults["batch_size"] / len(x_train), steps)
    keras.utils.set_random_seed(0)
    model = recipes.build_model("digits")
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(defaults["learning_rate"], l2_norm_clip=defaults["l2_norm_clip"],
                                        noise_multiplier=sigma, seed=0),
        loss=LOSS, metrics=["accuracy"],
    )
    model.fit(x_train, y_train, batch_size=defaults["batch_size"], epochs=defaults["epochs"],
              callbacks=[tfdp.callbacks.PrivacyBudget(3.0, 1e-5)], verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    assert model.privacy.epsilon(1e-5) <= 3.0
    assert accuracy >= 0.90


def test_seeded_sampling_does_not_replay_across_fit_calls():
    seeded = tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=7)
    assert seeded.sampling_seed(0) == seeded.sampling_seed(0)
    assert seeded.sampling_seed(0) != seeded.sampling_seed(20)
    unseeded = tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    assert unseeded.sampling_seed(0) is None


@pytest.mark.parametrize("jit_compile", [False, True])
def test_batches_are_padded_to_one_shape_only_under_xla(jit_compile):
    # Without XLA the step takes any length without retracing, so padding
    # rows (as costly as real ones) are dropped; XLA needs one shape.
    x, y = small_data(n=400)
    model = small_model()
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=3),
        loss=LOSS, jit_compile=jit_compile,
    )
    model._build_for((x, y))
    dataset, steps = model.optimizer.make_training_data(model, (x, y), 40)
    lengths, counts = [], []
    for (batch_x, _), info in dataset.take(steps):  # endless: one iterator a fit
        lengths.append(batch_x.shape[0])
        counts.append(int(info["mask"].numpy().sum()))
    assert steps == 10 and len(lengths) == 10
    if jit_compile:
        assert len(set(lengths)) == 1 and lengths[0] > max(counts)
    else:  # the smallest positive multiple of batch // 32 (here 1) that holds the draw
        assert lengths == [max(1, count) for count in counts]
        assert len(set(lengths)) > 1


def test_sample_weights_act_before_clipping():
    # A record weighted 1e6 moves the weights by at most lr * C / b, like any
    # other: the weight scales its loss, then its gradient is clipped.
    x, y = small_data(n=8)
    weights = np.ones(8, np.float32)
    weights[0] = 1e6

    def update(sample_weight, clip):
        keras.utils.set_random_seed(0)
        model = small_model()
        model.compile(optimizer=NoiselessDPSGD(1.0, l2_norm_clip=clip, noise_multiplier=1.0), loss=LOSS)
        start = [v.numpy() for v in model.trainable_variables]
        model.fit(x, y, sample_weight=sample_weight, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
        delta = [v.numpy() - s for v, s in zip(model.trainable_variables, start)]
        return np.sqrt(sum(float(np.sum(d**2)) for d in delta))

    assert update(weights, clip=0.1) <= 1.0 * 0.1 * 8 / 8 + 1e-6
    # Negative control: with clipping out of reach the weight dominates.
    assert update(weights, clip=1e9) > 100.0


def test_tfdp_train_hands_momentum_to_the_optimizer(tmp_path):
    from tfdp import training

    path = str(tmp_path / "digits.keras")
    result = training.train(dataset="digits", epochs=1, momentum=0.5, seed=0, output=path, verbose=0)
    assert result["momentum"] == 0.5
    assert keras.models.load_model(path).optimizer.inner_optimizer.momentum == 0.5
    assert training.train(dataset="digits", epochs=1, seed=0, verbose=0)["momentum"] == 0.0
    with pytest.raises(ValueError, match="AdaDP has its own update rule"):
        training.train(dataset="digits", mechanism="adadp", epochs=1, momentum=0.5, verbose=0)


@pytest.mark.parametrize("physical_batch_size", [None, 4])
def test_padding_rows_add_nothing_without_xla(physical_batch_size):
    """Without XLA a full-batch draw of 65 records is still padded to 66 rows
    (a multiple of `draw_multiple(65)` = 2; padding copies a record, mask 0).
    The step must be lr / b times the clipped sum over the 65 drawn rows,
    computed here one example at a time, and the logged loss their mean: the
    padding adds nothing to either."""
    assert tfdp.optimizers.dp_optimizer.draw_multiple(65) == 2
    x, y = small_data(n=65)
    keras.utils.set_random_seed(0)
    model = small_model()
    model.compile(optimizer=NoiselessDPSGD(1.0, l2_norm_clip=0.5, noise_multiplier=1.0), loss=LOSS)
    model(x[:1])
    start = [v.numpy() for v in model.trainable_variables]
    clipped_sum, losses = [np.zeros_like(s) for s in start], []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = LOSS(y[i:i + 1], model(x[i:i + 1]))
        grads = tape.gradient(loss, model.trainable_variables)
        norm = np.sqrt(sum(float(np.sum(g.numpy() ** 2)) for g in grads))
        clipped_sum = [s + g.numpy() * min(1.0, 0.5 / norm) for s, g in zip(clipped_sum, grads)]
        losses.append(float(loss))
    history = model.fit(x, y, batch_size=65, epochs=1, steps_per_epoch=1, verbose=0,
                        physical_batch_size=physical_batch_size)
    for variable, before, total in zip(model.trainable_variables, start, clipped_sum):
        np.testing.assert_allclose(variable.numpy(), before - 1.0 * total / 65, atol=1e-6)
    assert history.history["loss"][0] == pytest.approx(np.mean(losses), rel=1e-5)
