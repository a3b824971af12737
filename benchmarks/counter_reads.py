"""The ledger's step-count read: one ReadVariableOp against Keras's numpy().

`tfdp.models.counter_reads.read_counter` reads a DP model's private step
counter, which the fit's per-step hooks read several times a step
(`LedgerGuard`, `PrivacyBudget`). This times it against the read it
replaced, `int(counter.numpy())`, on the counter of a built `DPSequential`,
alternating over `--rounds` rounds of `--reads` reads, and prints the median
microseconds a read and the median of the per-round ratios.

    python benchmarks/counter_reads.py --rounds 7
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp.models.counter_reads import read_counter  # noqa: E402


def microseconds(read, reads):
    start = time.perf_counter()
    for _ in range(reads):
        read()
    return (time.perf_counter() - start) / reads * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reads", type=int, default=2000)
    args = parser.parse_args()
    model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(1)])
    counter = model._dp_steps  # pylint: disable=protected-access
    counter.assign(41)
    reads = {"numpy()": lambda: int(counter.numpy()), "read_counter": lambda: read_counter(counter)}
    assert len({read() for read in reads.values()}) == 1  # the same value
    rounds = [{label: microseconds(read, args.reads) for label, read in reads.items()}
              for _ in range(args.rounds)]
    print(f"{args.rounds} rounds of {args.reads} reads, alternating; medians.\n")
    print("| read | us a read |\n|---|---|")
    for label in reads:
        print(f"| {label} | {statistics.median(r[label] for r in rounds):.1f} |")
    ratio = statistics.median(r["numpy()"] / r["read_counter"] for r in rounds)
    print(f"\nnumpy() / read_counter: {ratio:.2f}x")


if __name__ == "__main__":
    main()
