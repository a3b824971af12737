"""Weight averaging (EMA) through tfdp's optimizers: post-processing.

Keras's `use_ema=True` keeps an exponential moving average of the weights
after each (noisy) update and swaps it into the model at the end of `fit`
(`finalize_variable_values`). Through DPSGD and DPOptimizer it must average
the weights the private steps produced, be what `evaluate` uses after fit
(and during fit with `keras.callbacks.SwapEMAWeights`), and leave the
ledger as plain DP-SGD's.
"""

import keras
import numpy as np
import pytest

import tfdp


def make_model(optimizer):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(40, 4)).astype("float32"), rng.integers(0, 3, 40)


class RawWeights(keras.callbacks.Callback):
    """The model's weights after each step, before any swap."""

    def on_train_begin(self, logs=None):
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append([v.numpy().copy() for v in self.model.trainable_variables])


@pytest.mark.parametrize("make_optimizer", [
    lambda: tfdp.optimizers.DPSGD(0.5, noise_multiplier=1.0, seed=0, use_ema=True,
                                  ema_momentum=0.5),
    lambda: tfdp.optimizers.DPOptimizer(
        keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.5), l2_norm_clip=1.0,
        noise_multiplier=1.0, seed=0),
])
def test_fit_ends_with_the_average_of_the_private_steps_weights(make_optimizer):
    x, y = data()
    model = make_model(make_optimizer())
    raw = RawWeights()
    model.fit(x, y, batch_size=10, epochs=2, verbose=0, callbacks=[raw])
    average = raw.steps[0]  # Keras: the first step's average is its weights
    for step in raw.steps[1:]:
        average = [0.5 * a + 0.5 * w for a, w in zip(average, step)]
    final = [v.numpy() for v in model.trainable_variables]
    for f, a in zip(final, average):
        np.testing.assert_allclose(f, a, rtol=1e-5, atol=1e-6)
    assert not np.allclose(final[0], raw.steps[-1][0])  # not the last step's weights
    # evaluate() reads the averaged weights now in the model.
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    assert model.evaluate(x, y, verbose=0) == pytest.approx(float(loss(y, model(x))), rel=1e-5)


def test_the_ledger_is_plain_dp_sgds_and_validation_can_use_the_average():
    x, y = data()
    plain = make_model(tfdp.optimizers.DPSGD(0.5, noise_multiplier=1.0, seed=0))
    averaged = make_model(tfdp.optimizers.DPSGD(0.5, noise_multiplier=1.0, seed=0,
                                                use_ema=True, ema_momentum=0.5))
    plain.fit(x, y, batch_size=10, epochs=2, verbose=0)
    history = averaged.fit(x, y, batch_size=10, epochs=2, verbose=0, validation_data=(x, y),
                           callbacks=[keras.callbacks.SwapEMAWeights()])
    assert averaged.privacy.steps == plain.privacy.steps == 8
    assert averaged.privacy.epsilon(1e-5) == plain.privacy.epsilon(1e-5)
    # The last validation ran on the average, which is what fit leaves in the model.
    assert history.history["val_loss"][-1] == pytest.approx(
        averaged.evaluate(x, y, verbose=0), rel=1e-5)
    config = averaged.optimizer.get_config()
    assert (config["use_ema"], config["ema_momentum"]) == (True, 0.5)
    assert tfdp.optimizers.DPSGD.from_config(config).inner_optimizer.use_ema
