"""How long one DP step's Gaussian noise takes to draw, written several ways.

For the parameter shapes of three zoo models (benchmarks/throughput.py),
times `(sums + noise_stddev * N(0, 1)) / b` for every variable: tfdp's
`noisy_mean` (vectorised Box-Muller per variable); the same with sigma/b
folded into the half-size radius; one flat draw for all variables, split;
`tf.random.stateless_normal` per variable; and tfdp's `noisy_mean` under
XLA. Also `tf.random.stateless_uniform` alone for the largest table (the
uniforms every exact method needs). Best of 4 interleaved rounds of 20
calls; milliseconds per step.

    python benchmarks/noise_generation.py
"""

import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from tfdp.mechanisms import dpsgd  # noqa: E402

SHAPES = {
    "mlp": [(784, 512), (512,), (512, 256), (256,), (256, 10), (10,)],
    "text_pooling": [(20000, 128), (128, 2), (2,)],
    "tanh_cnn": [(8, 8, 1, 16), (16,), (4, 4, 16, 32), (32,), (512, 32), (32,), (32, 10), (10,)],
}


def box_muller(count, seed, scale):
    """`count` N(0, scale^2) draws, scale folded into the radius."""
    half = (count + 1) // 2
    uniforms = tf.random.stateless_uniform([2, half], seed=seed)
    radius = tf.sqrt(tf.math.log1p(-uniforms[0]) * (-2.0 * scale * scale))
    angle = uniforms[1] * (2.0 * math.pi)
    pairs = tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], 0)
    return pairs if count % 2 == 0 else pairs[:count]


def folded(sums, stddev, b, seed):
    out = []
    for index, tensor in enumerate(sums):
        stream = tf.random.experimental.stateless_fold_in(seed, index)
        noise = box_muller(tensor.shape.num_elements(), stream, stddev / b)
        out.append(tensor / b + tf.reshape(noise, tensor.shape))
    return out


def flat(sums, stddev, b, seed):
    sizes = [t.shape.num_elements() for t in sums]
    parts = tf.split(box_muller(sum(sizes), seed, stddev / b), sizes)
    return [t / b + tf.reshape(p, t.shape) for t, p in zip(sums, parts)]


def stateless_normal(sums, stddev, b, seed):
    out = []
    for index, tensor in enumerate(sums):
        stream = tf.random.experimental.stateless_fold_in(seed, index)
        out.append((tensor + tf.random.stateless_normal(tensor.shape, stream) * stddev) / b)
    return out


def milliseconds(functions, args, rounds=4, calls=20):
    """{name: best mean ms over interleaved rounds}."""
    best = {}
    for _ in range(rounds):
        for name, function in functions.items():
            function(*args)
            start = time.perf_counter()
            for _ in range(calls):
                out = function(*args)
            tf.nest.map_structure(lambda t: t.numpy(), out)
            best[name] = min(best.get(name, float("inf")),
                             (time.perf_counter() - start) / calls * 1e3)
    return best


def main():
    variants = {
        "noisy_mean": tf.function(dpsgd.noisy_mean),
        "folded scale": tf.function(folded),
        "one flat draw": tf.function(flat),
        "stateless_normal": tf.function(stateless_normal),
        "noisy_mean, XLA": tf.function(dpsgd.noisy_mean, jit_compile=True),
    }
    print("| model | entries | " + " | ".join(variants) + " |")
    print("|---|---" + "|---" * len(variants) + "|")
    for name, shapes in SHAPES.items():
        sums = [tf.random.normal(shape) for shape in shapes]
        args = (sums, 1.3, 256.0, tf.constant([1, 2], tf.int64))
        times = milliseconds(variants, args)
        entries = sum(t.shape.num_elements() for t in sums)
        print(f"| {name} | {entries:,} | " + " | ".join(f"{times[v]:.2f}" for v in variants) + " |")
    count = 20000 * 128
    uniform = tf.function(lambda seed: tf.random.stateless_uniform([count], seed))
    ms = milliseconds({"uniform": uniform}, (tf.constant([1, 2], tf.int64),))["uniform"]
    print(f"\ntf.random.stateless_uniform of {count:,} floats: {ms:.2f} ms "
          f"({ms * 1e6 / count:.2f} ns an entry)")


if __name__ == "__main__":
    main()
