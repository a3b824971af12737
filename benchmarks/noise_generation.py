"""How long one DP step's Gaussian noise takes to draw, written several ways.

For the parameter shapes of three zoo models (benchmarks/throughput.py),
times `(sums + noise_stddev * N(0, 1)) / b` for every variable: tfdp's
`noisy_mean` (vectorised Box-Muller on 32-bit words, the whole tail:
`tfdp.mechanisms.gaussian`); the float32-uniform Box-Muller tfdp used
before (its radius stops at 5.65 sigma), as the baseline;
`tf.random.stateless_normal` per variable (clamped at 5.68 sigma); and
tfdp's `noisy_mean` under XLA. Also `tf.random.stateless_uniform` alone for
the largest table (the random bits every exact method needs). Interleaved
rounds of 20 calls; the best round's milliseconds per step, wall-clock and
process CPU time (the CPU time is steadier on a shared machine).

    python benchmarks/noise_generation.py [--rounds 4]
"""

import argparse
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


def float32_box_muller(shape, seed):
    """N(0, 1) from float32 uniforms, as tfdp drew it before issue 34."""
    count = tf.reduce_prod(shape)
    half = (count + 1) // 2
    uniforms = tf.random.stateless_uniform(tf.stack([2, half]), seed=seed)
    radius = tf.sqrt(-2.0 * tf.math.log1p(-uniforms[0]))
    angle = tf.constant(2.0 * math.pi) * uniforms[1]
    pairs = tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], 0)
    return tf.reshape(pairs[:count], shape)


def capped_noisy_mean(sums, stddev, b, seed):
    out = []
    for index, tensor in enumerate(sums):
        stream = tf.random.experimental.stateless_fold_in(seed, index)
        noise = float32_box_muller(tf.shape(tensor), stream) * stddev
        out.append((tensor + noise) / b)
    return out


def stateless_normal(sums, stddev, b, seed):
    out = []
    for index, tensor in enumerate(sums):
        stream = tf.random.experimental.stateless_fold_in(seed, index)
        out.append((tensor + tf.random.stateless_normal(tensor.shape, stream) * stddev) / b)
    return out


def milliseconds(functions, args, rounds, calls=20):
    """{name: (best wall ms, best CPU ms)} over interleaved rounds."""
    wall, cpu = {}, {}
    for _ in range(rounds):
        for name, function in functions.items():
            function(*args)
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(calls):
                out = function(*args)
            tf.nest.map_structure(lambda t: t.numpy(), out)
            elapsed = (time.perf_counter() - start, time.process_time() - start_cpu)
            wall[name] = min(wall.get(name, math.inf), elapsed[0] / calls * 1e3)
            cpu[name] = min(cpu.get(name, math.inf), elapsed[1] / calls * 1e3)
    return {name: (wall[name], cpu[name]) for name in functions}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    variants = {
        "noisy_mean": tf.function(dpsgd.noisy_mean),
        "float32 uniforms (capped, before)": tf.function(capped_noisy_mean),
        "stateless_normal": tf.function(stateless_normal),
        "noisy_mean, XLA": tf.function(dpsgd.noisy_mean, jit_compile=True),
    }
    print("milliseconds a step, wall-clock / process CPU, best of", args.rounds, "rounds\n")
    print("| model | entries | " + " | ".join(variants) + " |")
    print("|---|---" + "|---" * len(variants) + "|")
    for name, shapes in SHAPES.items():
        sums = [tf.random.normal(shape) for shape in shapes]
        call = (sums, 1.3, 256.0, tf.constant([1, 2], tf.int64))
        times = milliseconds(variants, call, args.rounds)
        entries = sum(t.shape.num_elements() for t in sums)
        cells = " | ".join(f"{times[v][0]:.2f} / {times[v][1]:.2f}" for v in variants)
        print(f"| {name} | {entries:,} | {cells} |")
    count = 20000 * 128
    uniform = tf.function(lambda seed: tf.random.stateless_uniform([count], seed))
    seed = tf.constant([1, 2], tf.int64)
    ms = milliseconds({"uniform": uniform}, (seed,), args.rounds)["uniform"][0]
    print(f"\ntf.random.stateless_uniform of {count:,} floats: {ms:.2f} ms "
          f"({ms * 1e6 / count:.2f} ns an entry)")


if __name__ == "__main__":
    main()
