"""One complete DP training run on a built-in dataset (`tfdp train`).

Example:

>>> from tfdp import training
>>> result = training.train(dataset="digits", epochs=1, verbose=0)  # doctest: +SKIP
>>> sorted(result)                                                  # doctest: +SKIP
['dataset', 'delta', 'epochs_run', 'epsilon', ...]
"""

import math

import keras

from tfdp import accounting, callbacks, optimizers, recipes
from tfdp.data import load_dataset


def make_optimizer(mechanism, learning_rate, l2_norm_clip, noise_multiplier, momentum=0.0, seed=None):
    """The tfdp optimizer for `mechanism` with the given settings."""
    if mechanism == "dpsgd":
        return optimizers.DPSGD(
            learning_rate=learning_rate, momentum=momentum, l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier, seed=seed,
        )
    raise ValueError(f"Unknown mechanism. Received: mechanism={mechanism!r}")


def train(
    dataset="digits",
    mechanism="dpsgd",
    epochs=None,
    batch_size=None,
    learning_rate=None,
    l2_norm_clip=None,
    epsilon=None,
    noise_multiplier=None,
    delta=None,
    seed=None,
    data_dir=None,
    output=None,
    verbose=2,
):
    """Trains the built-in model of `dataset` privately and evaluates it.

    Unset settings take `tfdp.recipes.DEFAULTS[dataset]`. With `epsilon`
    (the default) the noise multiplier is calibrated so that the planned
    epochs spend at most epsilon; `PrivacyBudget` also stops training there.

    Returns:
        dict with test accuracy, epsilon spent, delta and the settings used.
    """
    defaults = recipes.DEFAULTS[dataset]
    epochs = epochs or defaults["epochs"]
    batch_size = batch_size or defaults["batch_size"]
    learning_rate = learning_rate or defaults["learning_rate"]
    l2_norm_clip = l2_norm_clip or defaults["l2_norm_clip"]
    delta = delta or defaults["delta"]
    (x_train, y_train), (x_test, y_test) = load_dataset(dataset, data_dir=data_dir)
    num_examples = len(x_train)
    steps_per_epoch = max(1, round(num_examples / batch_size))
    if noise_multiplier is None:
        epsilon = epsilon or defaults["epsilon"]
        noise_multiplier = accounting.calibrate_noise_multiplier(
            epsilon, delta, batch_size / num_examples, epochs * steps_per_epoch
        )
    if seed is not None:
        keras.utils.set_random_seed(seed)
    model = recipes.build_model(dataset)
    model.compile(
        optimizer=make_optimizer(mechanism, learning_rate, l2_norm_clip, noise_multiplier,
                                 momentum=defaults["momentum"], seed=seed),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    budget = callbacks.PrivacyBudget(epsilon=epsilon, delta=delta)
    history = model.fit(
        x_train, y_train, batch_size=batch_size, epochs=epochs,
        validation_data=(x_test, y_test), callbacks=[budget], verbose=verbose,
    )
    _, test_accuracy = model.evaluate(x_test, y_test, verbose=0)
    if output:
        model.save(output)
    spent = model.privacy.epsilon(delta)
    return {
        "dataset": dataset,
        "mechanism": mechanism,
        "test_accuracy": round(float(test_accuracy), 4),
        "epsilon": round(spent, 4) if math.isfinite(spent) else spent,
        "delta": delta,
        "noise_multiplier": round(noise_multiplier, 4),
        "epochs_run": len(history.epoch),
        "steps": model.privacy.steps,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "l2_norm_clip": l2_norm_clip,
        "stopped_for_budget": budget.stopped_for_budget,
    }
