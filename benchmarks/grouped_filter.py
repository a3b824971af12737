"""A Conv2D's per-example kernel gradients: patches and an einsum against
one grouped convolution (`tfdp.per_example.grouped_filter`), shape by shape.

For each layer shape (batch, input side, channels in and out, kernel,
stride), times in one process, alternating over rounds: the einsum route
(`patches.extract_patches` rows times the output gradient's, the route
`LinearGrads` takes by default), the grouped route, and TensorFlow's own
batch-summed kernel gradient (what plain Keras computes, for scale). Prints
the medians in ms, einsum / grouped, and whether `grouped_filter.applies`
takes the grouped route for that shape.

    python benchmarks/grouped_filter.py --rounds 5
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfdp.per_example import grouped_filter  # noqa: E402
from tfdp.per_example.patches import as_rows, extract_patches  # noqa: E402
from results import cpu_name  # noqa: E402  (benchmarks/ is on the path when run as a script)

# (name, batch, side, channels in, channels out, kernel, stride, padding):
# the zoo's ResNet (benchmarks/throughput.py) and tanh CNN layers, and
# wider ones.
SHAPES = [
    ("resnet stem", 128, 32, 3, 16, 3, 1, "same"),
    ("resnet 16 -> 16", 128, 32, 16, 16, 3, 1, "same"),
    ("resnet 16 -> 32, stride 2", 128, 32, 16, 32, 3, 2, "same"),
    ("resnet 32 -> 32", 128, 16, 32, 32, 3, 1, "same"),
    ("tanh CNN first layer, batch 2048", 2048, 28, 1, 16, 8, 2, "same"),
    ("8 -> 8", 128, 32, 8, 8, 3, 1, "same"),
    ("16 -> 16, 5x5", 128, 32, 16, 16, 5, 1, "same"),
    ("16 -> 16, valid, batch 256", 256, 32, 16, 16, 3, 1, "valid"),
    ("32 -> 32, 32x32", 128, 32, 32, 32, 3, 1, "same"),
    ("16 -> 64", 128, 32, 16, 64, 3, 1, "same"),
    ("64 -> 64, 16x16", 128, 16, 64, 64, 3, 1, "same"),
    ("64 -> 64, 8x8", 128, 8, 64, 64, 3, 1, "same"),
]


def routes(batch, side, cin, cout, kernel, stride, padding):
    """(applies, {route: no-argument callable returning a tensor})."""
    layer = keras.layers.Conv2D(cout, kernel, strides=stride, padding=padding)
    layer.build((None, side, side, cin))
    x = tf.random.stateless_normal([batch, side, side, cin], [0, 1])
    out = layer.compute_output_shape((batch, side, side, cin))
    g = tf.random.stateless_normal(out, [0, 2])

    @tf.function
    def einsum(x, g):
        patches = as_rows(extract_patches(x, layer.kernel_size, layer.strides,
                                          layer.dilation_rate, padding))
        return tf.einsum("bsk,bso->bko", patches, as_rows(g))

    @tf.function
    def grouped(x, g):
        return grouped_filter.per_example_kernels(layer, x, g)

    @tf.function
    def batch_sum(x, g):
        return tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=layer.kernel.shape, out_backprop=g,
            strides=[1, stride, stride, 1], padding=padding.upper())

    applies = grouped_filter.applies(layer, x, g)
    return applies, {name: (lambda f=f: f(x, g)) for name, f in
                     (("einsum", einsum), ("grouped", grouped), ("batch sum", batch_sum))}


def timed(call, repeats):
    call().numpy()
    start = time.perf_counter()
    for _ in range(repeats):
        call().numpy()
    return (time.perf_counter() - start) / repeats * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; "
          f"{args.rounds} alternating rounds of {args.repeats} calls, medians in ms\n")
    print("| shape | batch | grouped route taken | einsum | grouped | batch sum (Keras) "
          "| einsum / grouped |")
    print("|---|---|---|---|---|---|---|")
    for name, batch, side, cin, cout, kernel, stride, padding in SHAPES:
        applies, calls = routes(batch, side, cin, cout, kernel, stride, padding)
        times = {route: [] for route in calls}
        for _ in range(args.rounds):
            for route, call in calls.items():
                times[route].append(timed(call, args.repeats))
        med = {route: statistics.median(t) for route, t in times.items()}
        print(f"| {name} | {batch} | {'yes' if applies else 'no'} | {med['einsum']:.2f} "
              f"| {med['grouped']:.2f} | {med['batch sum']:.2f} "
              f"| {med['einsum'] / med['grouped']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
