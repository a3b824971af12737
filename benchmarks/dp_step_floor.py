"""How fast a DP-SGD step of a Dense model could be here: a floor, measured.

For the MLPs of `benchmarks/throughput.py`'s zoo (their batch sizes, one
fixed batch, no input pipeline, no XLA), one process times, interleaved over
`--rounds` rounds of `--repeats` calls, each a traced `tf.function`:

* Keras's own `train_step` on the plain model;
* a hand-written DP-SGD step with TensorFlow's ops alone: the gradients at
  each Dense output by one backward pass, each example's norm from the
  rank-one formula |x|^2 |g|^2 + |g|^2 in float32, clip weights, the clipped
  sums by one matmul a layer, the SGD update; NO noise;
* the same step with tfdp's Gaussian noise (`tfdp.mechanisms.gaussian.
  add_normals`, the compiled kernel where it runs, keyed by a step counter);
* tfdp's noise alone, on zero sums of the model's variables;
* tfdp's DP `train_step`.

The hand-written steps are NOT tfdp's guarantee: they bound no rounding,
check no write and no input, and the first has no noise. They show what the
step's arithmetic costs on this machine without tfdp's machinery, so the
distance between tfdp's step and Keras's splits into what the noise costs
(work the plain step does not do at all) and what tfdp adds around it.
Ratios are Keras's step time over each step's (DP/plain, as
`benchmarks/long_fit.py` gives them), medians of per-round ratios.

    python benchmarks/dp_step_floor.py
    python benchmarks/dp_step_floor.py --model mlp mlp_2048 --rounds 9
"""

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from embedding_rows import milliseconds  # noqa: E402
from step_breakdown import stages  # noqa: E402
from throughput import ZOO, build  # noqa: E402

from tfdp.mechanisms import gaussian  # noqa: E402

CLIP = 1.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 0.1


def dense_layers(model):
    """The model's Dense layers in order, after checking that it holds only
    Flatten and Dense layers (the hand-written step knows no others)."""
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    unknown = [layer.name for layer in layers
               if not isinstance(layer, (keras.layers.Flatten, keras.layers.Dense))]
    if unknown:
        raise ValueError(f"The hand-written step takes Flatten and Dense layers only. "
                         f"Received: {unknown}")
    return [layer for layer in layers if isinstance(layer, keras.layers.Dense)]


def hand_written_steps(name):
    """(no-noise step, step with tfdp's noise, noise alone) for the zoo model
    `name`, on its own copy of the model's layers and one fixed batch."""
    inputs, outputs, x, y = build(name)
    batch = ZOO[name][0]
    model = keras.Model(inputs, outputs)
    layers = dense_layers(model)
    x = tf.reshape(tf.constant(x[:batch]), [batch, -1])
    y = tf.constant(y[:batch])
    variables = [v for layer in layers for v in (layer.kernel, layer.bias)]
    counter = tf.Variable(0, dtype=tf.int64)

    def clipped_sums():
        probes = [tf.zeros([batch, layer.units]) for layer in layers]
        with tf.GradientTape() as tape:
            tape.watch(probes)
            h, inputs_of = x, []
            for layer, probe in zip(layers, probes):
                inputs_of.append(h)
                h = layer.activation(tf.matmul(h, layer.kernel) + layer.bias + probe)
            loss = tf.reduce_sum(
                tf.nn.sparse_softmax_cross_entropy_with_logits(y, h))
        grads = tape.gradient(loss, probes)
        squares = 0.0
        for h, g in zip(inputs_of, grads):
            g_squares = tf.reduce_sum(tf.square(g), 1)
            squares += tf.reduce_sum(tf.square(h), 1) * g_squares + g_squares
        weights = tf.minimum(1.0, CLIP / tf.sqrt(squares + 1e-30))
        sums = []
        for h, g in zip(inputs_of, grads):
            weighted = g * weights[:, None]
            sums += [tf.matmul(h, weighted, transpose_a=True), tf.reduce_sum(weighted, 0)]
        return sums

    def seeds():
        counter.assign_add(1)
        return [tf.stack([counter, tf.constant(i, tf.int64)]) for i in range(len(variables))]

    def update(grads):
        for variable, grad in zip(variables, grads):
            variable.assign_sub(LEARNING_RATE * grad)

    def without_noise():
        update([s / batch for s in clipped_sums()])

    def with_noise():
        update(gaussian.add_normals(clipped_sums(), seeds(), CLIP * NOISE_MULTIPLIER,
                                    divisor=batch))

    def noise_alone():
        return gaussian.add_normals([tf.zeros_like(v) for v in variables], seeds(),
                                    CLIP * NOISE_MULTIPLIER, divisor=batch)

    return without_noise, with_noise, noise_alone


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", choices=["mlp", "mlp_2048"], default=["mlp"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"{args.rounds} rounds of {args.repeats} calls each, interleaved; medians.\n")
    print("| model | step | ms a step | DP/plain |")
    print("|---|---|---|---|")
    for name in args.model:
        tfdp_steps = dict(stages(name))
        without_noise, with_noise, noise_alone = hand_written_steps(name)
        steps = {
            "Keras train_step": tfdp_steps["Keras train_step"],
            "hand-written DP-SGD, no noise (not private)": without_noise,
            "hand-written DP-SGD + tfdp's noise": with_noise,
            "tfdp's noise alone": noise_alone,
            "tfdp DP train_step": tfdp_steps["DP train_step"],
        }
        steps = {label: tf.function(step) for label, step in steps.items()}
        for step in steps.values():
            step()  # traced before timing
        times = {label: [] for label in steps}
        for _ in range(args.rounds):
            for label, step in steps.items():
                times[label].append(milliseconds(step, args.repeats))
        keras_times = times["Keras train_step"]
        for label, values in times.items():
            ratio = statistics.median(k / v for k, v in zip(keras_times, values))
            shown = "" if label in ("Keras train_step", "tfdp's noise alone") else f"{ratio:.2f}"
            print(f"| {name} | {label} | {statistics.median(values):.2f} | {shown} |",
                  flush=True)


if __name__ == "__main__":
    main()
