"""What starting the DP input pipeline costs, against tf.data's static optimizations.

Every DP `fit` builds its Poisson pipeline (`tfdp.data.make_dataset`: the
arrays converted to tensors, the draw, the gather) and makes one iterator
over it. tf.data's default static optimizations rewrite a pipeline's graph
when an iterator is made, and that graph holds the in-memory arrays the
gather reads, so the rewrite serialized and copied them: a start cost that
grew with the data. tfdp turns them off (`tfdp.data.poisson._finish`).

For synthetic float32 data of each `--sizes` (records x features, int32
labels), this times, alternating over `--rounds` rounds: building the
pipeline, and making its iterator and reading the first batch, once as tfdp
makes it and once with the default static optimizations turned back on
(the pipeline before this change). Prints medians over rounds, in ms.

    python benchmarks/pipeline_start.py
    python benchmarks/pipeline_start.py --sizes 8000x784 60000x784 --rounds 7
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from results import cpu_name  # noqa: E402  (benchmarks/ is on the path when run as a script)
from tfdp.data.poisson import PoissonSampler, make_dataset  # noqa: E402


def with_static_optimizations(dataset):
    """`dataset` with tf.data's default static optimizations on again."""
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = True
    return dataset.with_options(options)


def start_ms(dataset):
    """Milliseconds to make an iterator over `dataset` and read one element."""
    start = time.perf_counter()
    tf.nest.map_structure(lambda t: t.numpy(), next(iter(dataset)))
    return 1e3 * (time.perf_counter() - start)


def measure(records, features, rounds, batch_size):
    """{column: median ms} for data of `records` x `features`."""
    rng = np.random.default_rng(0)
    x = rng.random((records, features), dtype=np.float32)
    y = rng.integers(0, 10, records).astype(np.int32)
    sampler = PoissonSampler(records, batch_size, seed=0, fixed_shape=False)
    columns = {"build": [], "iterator and first batch, tfdp": [],
               "iterator and first batch, static optimizations on": []}
    start_ms(make_dataset(sampler, (x, y), repeat=True))  # warm-up: traces, caches
    for _ in range(rounds):
        begin = time.perf_counter()
        dataset = make_dataset(sampler, (x, y), repeat=True)
        columns["build"].append(1e3 * (time.perf_counter() - begin))
        columns["iterator and first batch, tfdp"].append(start_ms(dataset))
        columns["iterator and first batch, static optimizations on"].append(
            start_ms(with_static_optimizations(make_dataset(sampler, (x, y), repeat=True))))
    return {name: statistics.median(values) for name, values in columns.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["8000x784", "60000x784", "50000x3072"],
                        help="records x features of each data set")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}\n")
    print(f"ms, medians over {args.rounds} alternating rounds; float32 records, expected "
          f"batch {args.batch_size}\n")
    header = None
    for size in args.sizes:
        records, features = (int(part) for part in size.split("x"))
        row = measure(records, features, args.rounds, args.batch_size)
        if header is None:
            header = list(row)
            print("| data | MB | " + " | ".join(header) + " |")
            print("|---" * (len(header) + 2) + "|")
        megabytes = records * features * 4 / 2**20
        print(f"| {records} x {features} | {megabytes:,.0f} | "
              + " | ".join(f"{row[name]:.1f}" for name in header) + " |", flush=True)


if __name__ == "__main__":
    main()
