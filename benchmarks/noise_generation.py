"""How long one DP step's Gaussian noise takes to draw, written several ways.

For the parameter shapes of three zoo models (benchmarks/throughput.py),
times `(sums + noise_stddev * N(0, 1)) / b` for every variable: tfdp's
`noisy_mean` (vectorised Box-Muller on 32-bit words, the whole tail:
`tfdp.mechanisms.gaussian`) on its two paths, the compiled kernel and the
graph generator (`TFDP_NOISE_KERNEL=graph`; the same values bit for bit);
the float32-uniform Box-Muller tfdp used before (its radius stops at 5.65
sigma); `tf.random.stateless_normal` per variable (clamped at 5.68 sigma);
and tfdp's `noisy_mean` under XLA. Then the same two paths as normals a
second, with the bare draw of the largest table (`gaussian.normals`), and
`tf.random.stateless_uniform` alone for it (the random bits every exact
method needs). Interleaved rounds of 20 calls; the best round's
milliseconds per step, wall-clock and process CPU time (the CPU time is
steadier on a shared machine). Each call pays a `tf.function` call's fixed
cost, which the small draws feel: the last table draws a model's noise
`CHAIN` times inside one graph (each draw added to the last one's result,
as a step adds it to its clipped sums), so a draw's time is the graph's
over `CHAIN`. The CPU is named from `lscpu`.

    python benchmarks/noise_generation.py [--rounds 4]
"""

import argparse
import math
import os
import subprocess
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from tfdp.mechanisms import dpsgd, gaussian, native_noise  # noqa: E402
from tfdp.mechanisms.native import build  # noqa: E402

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


# Draws a graph of the in-graph table holds.
CHAIN = 50


def chained_noisy_mean(sums, stddev, b, seed):
    """`noisy_mean` CHAIN times in one graph, each on the last one's result
    with a seed of its own (one seed throughout would let the graph draw the
    graph generator's noise once: it depends on the seed alone)."""
    for step in range(CHAIN):
        sums = dpsgd.noisy_mean(sums, stddev, b, seed + tf.constant([0, step], tf.int64))
    return sums


def cpu_name():
    """The CPU's model name as lscpu prints it, with the core count."""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in lines.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    return f"{name}, {os.cpu_count()} cores"


def on_path(path, function):
    """`function` as a tf.function that always runs on `path`: "graph" (the
    graph generator forced) or "kernel" (the compiled op, where it loads).
    The path is read when a trace is made, so each call sets it."""
    traced = tf.function(function)

    def call(*args):
        before = os.environ.get(build.ENV_SWITCH)
        os.environ[build.ENV_SWITCH] = path
        try:
            return traced(*args)
        finally:
            if before is None:
                del os.environ[build.ENV_SWITCH]
            else:
                os.environ[build.ENV_SWITCH] = before

    return call


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
    print(f"CPU: {cpu_name()}; noise: {native_noise.noise_path()}\n")
    paths = {"compiled kernel": on_path("kernel", dpsgd.noisy_mean),
             "graph generator": on_path("graph", dpsgd.noisy_mean)}
    variants = {
        **{f"noisy_mean, {path}": function for path, function in paths.items()},
        "float32 uniforms (capped, before)": tf.function(capped_noisy_mean),
        "stateless_normal": tf.function(stateless_normal),
        "noisy_mean, XLA": tf.function(dpsgd.noisy_mean, jit_compile=True),
    }
    seed = tf.constant([1, 2], tf.int64)  # an argument: nothing is folded at trace time
    print("milliseconds a step, wall-clock / process CPU, best of", args.rounds, "rounds\n")
    print("| model | entries | " + " | ".join(variants) + " |")
    print("|---|---" + "|---" * len(variants) + "|")
    rates = []
    for name, shapes in SHAPES.items():
        sums = [tf.random.normal(shape) for shape in shapes]
        call = (sums, 1.3, 256.0, seed)
        times = milliseconds(variants, call, args.rounds)
        entries = sum(t.shape.num_elements() for t in sums)
        cells = " | ".join(f"{times[v][0]:.2f} / {times[v][1]:.2f}" for v in variants)
        print(f"| {name} | {entries:,} | {cells} |")
        rates.append((f"noisy_mean, {name}", entries, [times[f"noisy_mean, {path}"] for path in paths]))
    count = 20000 * 128
    draws = {path: on_path(key, lambda s: gaussian.normals([[count]], [s], [tf.float32])[0])
             for path, key in (("compiled kernel", "kernel"), ("graph generator", "graph"))}
    times = milliseconds(draws, (seed,), args.rounds)
    rates.append((f"normals of {count:,}", count, [times[path] for path in paths]))
    print(f"\nmillion normals a second, wall-clock / process CPU time (best of {args.rounds} "
          "interleaved rounds)\n")
    print("| draw | entries | " + " | ".join(paths) + " | kernel / graph |")
    print("|---|---|---|---|---|")
    for name, entries, (kernel, graph) in rates:
        cells = " | ".join(f"{entries / ms[0] / 1e3:.0f} / {entries / ms[1] / 1e3:.0f}"
                           for ms in (kernel, graph))
        ratios = f"{graph[0] / kernel[0]:.2f}x / {graph[1] / kernel[1]:.2f}x"
        print(f"| {name} | {entries:,} | {cells} | {ratios} |")
    chained = {path: on_path(key, chained_noisy_mean)
               for path, key in (("compiled kernel", "kernel"), ("graph generator", "graph"))}
    print(f"\nmillion normals a second inside one graph ({CHAIN} draws of a model's noise a "
          "call, each on the last one's sums), wall-clock / process CPU time, best of "
          f"{args.rounds} interleaved rounds\n")
    print("| model | entries | " + " | ".join(paths) + " | kernel / graph |")
    print("|---|---|---|---|---|")
    for name, shapes in SHAPES.items():
        sums = [tf.random.normal(shape) for shape in shapes]
        times = milliseconds(chained, (sums, 1.3, 1.0, seed), args.rounds, calls=2)
        entries = sum(t.shape.num_elements() for t in sums) * CHAIN
        cells = " | ".join(f"{entries / times[path][0] / 1e3:.0f} / "
                           f"{entries / times[path][1] / 1e3:.0f}" for path in paths)
        kernel, graph = (times[path] for path in paths)
        print(f"| {name} | {entries // CHAIN:,} | {cells} | {graph[0] / kernel[0]:.2f}x / "
              f"{graph[1] / kernel[1]:.2f}x |")
    uniform = tf.function(lambda seed: tf.random.stateless_uniform([count], seed))
    ms = milliseconds({"uniform": uniform}, (seed,), args.rounds)["uniform"][0]
    print(f"\ntf.random.stateless_uniform of {count:,} floats: {ms:.2f} ms "
          f"({ms * 1e6 / count:.2f} ns an entry)")


if __name__ == "__main__":
    main()
