"""One complete DP training run on a built-in dataset (`tfdp train`).

The test split is a clean hold-out: the per-epoch validation (val_loss,
val_accuracy) reads a slice of the training split that training never
samples, and the test split is read once, after training. Like the training
metrics, validation metrics are computed from private data and are not
covered by epsilon (they are for the data holder's eyes); the returned
result holds only test accuracy and the privacy figures.

Example:

>>> from tfdp import training
>>> result = training.train(dataset="digits", epochs=1, verbose=0)  # doctest: +SKIP
>>> sorted(result)                                                  # doctest: +SKIP
['dataset', 'delta', 'epochs_run', 'epsilon', ...]
"""

import math
import os
import tempfile

import keras
import numpy as np

from tfdp import accounting, callbacks, optimizers, recipes
from tfdp.data import load_dataset

# The fraction of the training split held out for per-epoch validation.
VALIDATION_FRACTION = 0.1
# The held-out slice is chosen by this fixed seed: data-independent, reproducible.
VALIDATION_SEED = 0


def check_output_path(output):
    """Raises ValueError unless the model can be saved to `output`.

    Called before training, so that no privacy budget is spent on a run
    whose model cannot be saved: `output` must name a `.keras` file in an
    existing, writable folder (an existing file is overwritten).

    Example:

    >>> check_output_path("/nonexistent/folder/model.keras")
    Traceback (most recent call last):
        ...
    ValueError: Cannot save to `output` (--output): the folder /nonexistent/folder does not exist. Received: output='/nonexistent/folder/model.keras'
    """
    if output is None:
        return
    path = os.fspath(output)
    received = f"Received: output={output!r}"
    if not str(path).endswith(".keras"):
        raise ValueError(f"Expected `output` (--output) to name a .keras file. {received}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(
            f"Cannot save to `output` (--output): the folder {folder} does not exist. {received}"
        )
    if os.path.isdir(path):
        raise ValueError(f"Cannot save to `output` (--output): it is a folder. {received}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"Cannot save to `output` (--output): permission denied. {received}")
    try:  # a real write: /proc, read-only mounts and full disks pass os.access
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tfdp-write-check-") as probe:
            probe.write(b"\0" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        raise ValueError(
            f"Cannot save to `output` (--output): writing in {folder} failed ({error}). {received}"
        ) from None


def split_validation(x, y, fraction=VALIDATION_FRACTION, seed=VALIDATION_SEED):
    """Splits (x, y) into training and validation parts by a fixed random permutation.

    Example:

    >>> (x_fit, y_fit), (x_val, y_val) = split_validation(np.arange(20), np.arange(20))
    >>> len(x_fit), len(x_val), sorted(set(x_fit) & set(x_val))
    (18, 2, [])
    """
    order = np.random.default_rng(seed).permutation(len(x))
    held = max(1, round(fraction * len(x)))
    fit, val = order[held:], order[:held]
    return (x[fit], y[fit]), (x[val], y[val])


def check_batch_size(batch_size, num_examples, dataset):
    """Raises ValueError when the expected batch exceeds the training examples."""
    if batch_size > num_examples:
        raise ValueError(
            f"Expected `batch_size` (--batch-size) <= the number of training examples of "
            f"{dataset} ({num_examples}, after holding out {VALIDATION_FRACTION:.0%} for "
            f"validation). Received: batch_size={batch_size}"
        )


def make_optimizer(mechanism, learning_rate, l2_norm_clip, noise_multiplier, momentum=0.0, seed=None,
                   public_energy_data=None, target_epsilon=None, target_delta=None, epochs=None,
                   num_examples=None):
    """The tfdp optimizer for `mechanism` with the given settings.

    "sadpsgd" needs `public_energy_data`, a public (x, y) pair (never training data).
    """
    if mechanism == "dpsgd":
        return optimizers.DPSGD(
            learning_rate=learning_rate, momentum=momentum, l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier, seed=seed,
        )
    if mechanism == "sadpsgd":
        return optimizers.SADPSGD(
            learning_rate=learning_rate, momentum=momentum, l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier, seed=seed, public_energy_data=public_energy_data,
        )
    if mechanism == "dpis":
        # DPIS picks sigma_G per epoch from the target (noise_multiplier unused);
        # sigma_N = 0.02 * N is the paper's, fine here: built-in datasets' sizes are public.
        return optimizers.DPIS(
            learning_rate=learning_rate, momentum=momentum, l2_norm_clip=l2_norm_clip,
            target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs,
            sigma_n=0.02 * num_examples, seed=seed,
        )
    if mechanism == "adadp":
        return optimizers.AdaDP(
            learning_rate=learning_rate, l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier, seed=seed,
        )
    raise ValueError(f"Unknown mechanism. Received: mechanism={mechanism!r}")


def train(
    dataset="digits",
    mechanism="dpsgd",
    epochs=None,
    batch_size=None,
    learning_rate=None,
    momentum=None,
    l2_norm_clip=None,
    epsilon=None,
    noise_multiplier=None,
    delta=None,
    seed=None,
    data_dir=None,
    output=None,
    verbose=2,
    features="none",
):
    """Trains the built-in model of `dataset` privately and evaluates it.

    Unset settings take `tfdp.recipes.defaults(dataset, features)`; with
    features="scatternet" (or "scatternet_cnn") the model trains on the
    ScatterNet features of the images, computed once. With `epsilon`
    (the default) the noise multiplier is calibrated so that the planned
    epochs spend at most epsilon; `PrivacyBudget` also stops training there.
    Training data are the training split minus a held-out 10% used for
    validation after each epoch; test accuracy is measured once, at the end.
    `output` is checked before anything else, so no budget is spent on a
    run whose model cannot be saved.

    Returns:
        dict with test accuracy, epsilon spent, delta and the settings used.
    """
    check_output_path(output)
    defaults = recipes.defaults(dataset, features)
    epochs = epochs or defaults["epochs"]
    if mechanism == "adadp":  # RMSprop-style step: its own learning rate (and batch)
        batch_size = batch_size or optimizers.adadp.RECIPE_DEFAULTS[dataset]["batch_size"]
        learning_rate = learning_rate or optimizers.adadp.RECIPE_DEFAULTS[dataset]["learning_rate"]
    batch_size = batch_size or defaults["batch_size"]
    learning_rate = learning_rate or defaults["learning_rate"]
    if mechanism == "adadp":
        if momentum:
            raise ValueError(f"AdaDP has its own update rule: no momentum. Received: momentum={momentum}")
        momentum = None  # AdaDP has none
    elif momentum is None:
        momentum = defaults["momentum"]
    l2_norm_clip = l2_norm_clip or defaults["l2_norm_clip"]
    delta = delta or defaults["delta"]
    (x_train, y_train), (x_test, y_test) = load_dataset(dataset, data_dir=data_dir)
    x_train, x_test = recipes.prepare_inputs(dataset, features, x_train, x_test)
    public_energy_data = None
    if mechanism == "sadpsgd":
        # SA-DPSGD's energy set: the first half of the (public) test split;
        # accuracy is reported on the other half, which the energy never read.
        half = len(x_test) // 2
        public_energy_data = (x_test[:half], y_test[:half])
        x_test, y_test = x_test[half:], y_test[half:]
    (x_train, y_train), validation_data = split_validation(x_train, y_train)
    num_examples = len(x_train)
    check_batch_size(batch_size, num_examples, dataset)
    steps_per_epoch = max(1, round(num_examples / batch_size))
    if mechanism == "dpis" and noise_multiplier is not None:
        raise ValueError(
            "DPIS chooses its noise multiplier every epoch from the target epsilon: "
            f"pass epsilon instead. Received: noise_multiplier={noise_multiplier}"
        )
    if noise_multiplier is None:
        epsilon = epsilon or defaults["epsilon"]
        noise_multiplier = accounting.calibrate_noise_multiplier(
            epsilon, delta, batch_size / num_examples, epochs * steps_per_epoch
        )
    if seed is not None:
        keras.utils.set_random_seed(seed)
    model = recipes.build_model(dataset, features=features)
    model.compile(
        optimizer=make_optimizer(mechanism, learning_rate, l2_norm_clip, noise_multiplier,
                                 momentum=momentum, seed=seed,
                                 public_energy_data=public_energy_data, target_epsilon=epsilon,
                                 target_delta=delta, epochs=epochs, num_examples=num_examples),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    budget = callbacks.PrivacyBudget(epsilon=epsilon, delta=delta)
    progress = [callbacks.ProgbarLogger()] if verbose else []
    history = model.fit(
        x_train, y_train, batch_size=batch_size, epochs=epochs,
        validation_data=validation_data, callbacks=[budget, *progress], verbose=verbose,
    )
    _, test_accuracy = model.evaluate(x_test, y_test, verbose=0)
    save_error = None
    if output:
        try:
            model.save(output)  # atomic: a failed save leaves any old file as it was
        except OSError as error:
            save_error = f"the model could not be saved to {output}: {error}"
    spent = model.privacy.epsilon(delta)
    result = {
        "dataset": dataset,
        "features": features,
        "mechanism": mechanism,
        "test_accuracy": round(float(test_accuracy), 4),
        "epsilon": round(spent, 4) if math.isfinite(spent) else spent,
        "delta": delta,
        "noise_multiplier": round(noise_multiplier, 4),
        "epochs_run": len(history.epoch),
        "steps": model.privacy.steps,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "momentum": momentum,
        "l2_norm_clip": l2_norm_clip,
        "stopped_for_budget": budget.stopped_for_budget,
        # Training rows with NaN/Inf (they contribute nothing): logged only when > 0.
        "nonfinite_examples": int(history.history.get("nonfinite_examples", [0])[-1]),
    }
    if save_error:
        result["output_error"] = save_error
    if mechanism == "sadpsgd":
        opt = model.optimizer
        result.update(
            accepted_steps=int(opt.accepted_count.numpy()),
            energy_examples=len(public_energy_data[1]),
            # The paper's Theorem 1 (accepted steps only): NOT a guarantee.
            paper_claimed_epsilon=round(opt.paper_claimed_epsilon(delta), 4),
        )
    if mechanism == "dpis":
        schedule = [round(row["sigma_g"], 4) for row in model.optimizer.epoch_history]
        result.update(noise_multiplier=schedule[-1] if schedule else None, sigma_g_schedule=schedule)
    if mechanism == "adadp":
        # The paper's Theorem 1 accounting (Wang et al. bound, classic conversion): NOT a guarantee.
        result.update(paper_theorem1_epsilon=round(model.optimizer.paper_epsilon(
            delta, batch_size / num_examples, model.privacy.steps), 4))
    return result
