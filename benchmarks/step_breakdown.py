"""Where a DP-SGD step's time goes, against the plain Keras step.

Times, on one fixed batch of the tanh CNN or the MLP 784-512-256-10 (no
input pipeline, no XLA):
per-example gradients with clipping and the clipped sum; `privatize`
(adds the noise); `privatize` plus the update; the whole DP `train_step`;
and Keras's own `train_step` on the same model. For work on throughput
(benchmarks/throughput.py gives the end-to-end figures).

    python benchmarks/step_breakdown.py --batch 256
    python benchmarks/step_breakdown.py --model mlp --batch 256
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdp  # noqa: E402
from tfdp import recipes  # noqa: E402
from tfdp.mechanisms import dpsgd  # noqa: E402
from tfdp.per_example import compute_per_example_gradients  # noqa: E402


def milliseconds(function, repeats):
    """Mean wall time of `function()` in ms, after one warm-up call."""
    function()
    start = time.perf_counter()
    for _ in range(repeats):
        result = function()
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result)
    return (time.perf_counter() - start) / repeats * 1e3


def layers(name):
    """Fresh layers of the model `name` ("tanh_cnn" or "mlp")."""
    if name == "tanh_cnn":
        return recipes.tanh_cnn()
    return [
        keras.Input((28, 28, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--model", choices=("tanh_cnn", "mlp"), default="tanh_cnn")
    args = parser.parse_args()
    batch = args.batch
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((batch, 28, 28, 1), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, batch))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = tfdp.DPSequential(layers(args.model))
    optimizer = tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(x.numpy(), y.numpy(), batch_size=batch // 2, epochs=1, steps_per_epoch=1, verbose=0)
    mask = tf.ones([batch])
    info = {"mask": mask, "expected_batch_size": tf.constant(float(batch))}
    per_example_loss = model._per_example_loss

    def gradients():
        grads, _, _ = compute_per_example_gradients(model, x, y, mask, per_example_loss)
        return grads

    @tf.function
    def clipped_sum():
        grads = gradients()
        return grads.weighted_sum(dpsgd.clip_factors(grads.sq_norms(), 1.0, mask))

    @tf.function
    def privatize():
        return optimizer.privatize(gradients(), info)[0]

    @tf.function
    def privatize_and_apply():
        noisy = optimizer.privatize(gradients(), info)[0]
        optimizer.apply_private_gradients(noisy, model.trainable_variables, model=model)
        return noisy

    @tf.function
    def dp_train_step():
        return model.train_step(((x, y), info))

    plain = keras.Sequential(layers(args.model))
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    plain.fit(x.numpy(), y.numpy(), batch_size=batch, epochs=1, verbose=0)

    @tf.function
    def keras_train_step():
        return plain.train_step((x, y))

    for name, function in [
        ("per-example gradients, clipping, clipped sum", clipped_sum),
        ("+ noise (privatize)", privatize),
        ("+ update", privatize_and_apply),
        ("DP train_step", dp_train_step),
        ("Keras train_step", keras_train_step),
    ]:
        print(f"{name:46s} {milliseconds(function, args.repeats):7.2f} ms")


if __name__ == "__main__":
    main()
