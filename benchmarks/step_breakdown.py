"""Where a DP-SGD step's time goes, against the plain Keras step.

Times, on one fixed batch of a model of `benchmarks/throughput.py`'s zoo
(its batch size; no input pipeline, no XLA; best of 3 runs of `--repeats`
calls, each stage a `tf.function` of its own): the forward pass; the
batched per-example pass with every example's gradient norm (forward,
backward to the rules' probes, norms); the same plus the clipped sum;
drawing and adding the noise alone (`noisy_gradients` of zero sums);
`privatize` (clipped sum and noise); `privatize` plus the update; the whole
DP `train_step`; and Keras's own `train_step` on the same model. Each line
adds to the one before it unless it says "alone". For work on throughput
(benchmarks/throughput.py gives the end-to-end figures).

    python benchmarks/step_breakdown.py --model tanh_cnn_256
    python benchmarks/step_breakdown.py --model mlp text_pooling
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdp  # noqa: E402
from throughput import ZOO, build  # noqa: E402


def milliseconds(function, repeats):
    """Best of 3 mean wall times of `function()` in ms, after a warm-up call."""
    function()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            result = function()
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result)
        best = min(best, (time.perf_counter() - start) / repeats * 1e3)
    return best


def stages(name):
    """(label, function) pairs for the zoo model `name`; `main` times each
    as a `tf.function`."""
    inputs, outputs, x, y = build(name)
    batch = ZOO[name][0]
    x, y = tf.constant(x[:batch]), tf.constant(y[:batch])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = tfdp.DPModel(inputs, outputs)
    optimizer = tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(x.numpy(), y.numpy(), batch_size=batch // 2, epochs=1, steps_per_epoch=1, verbose=0)
    plain = keras.Model(inputs, outputs)  # the same layers and weights
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    plain.fit(x.numpy(), y.numpy(), batch_size=batch, epochs=1, verbose=0)
    mask = tf.ones([batch])
    info = {"mask": mask, "expected_batch_size": tf.constant(float(batch))}
    variables = model.trainable_variables

    def per_example():
        grads, _, _ = tfdp.per_example.compute_per_example_gradients(
            model, x, y, mask, model._per_example_loss)
        return grads

    def privatize_and_apply():
        noisy = optimizer.privatize(per_example(), info)[0]
        optimizer.apply_private_gradients(noisy, variables, model=model)
        return noisy

    return [
        ("forward", lambda: model(x, training=True)),
        ("per-example pass and norms", lambda: per_example().sq_norms()),
        ("+ clipped sum", lambda: optimizer.clipped_sum(per_example(), info)[0]),
        ("noise alone (noisy_gradients of zeros)",
         lambda: optimizer.noisy_gradients([tf.zeros_like(v) for v in variables], info, variables)),
        ("+ noise (privatize)", lambda: optimizer.privatize(per_example(), info)[0]),
        ("+ update", privatize_and_apply),
        ("DP train_step", lambda: model.train_step(((x, y), info))),
        ("Keras train_step", lambda: plain.train_step((x, y))),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", choices=sorted(ZOO), default=["tanh_cnn_256"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print("| model | stage | ms |")
    print("|---|---|---|")
    for name in args.model:
        for label, function in stages(name):
            print(f"| {name} | {label} | {milliseconds(tf.function(function), args.repeats):.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
