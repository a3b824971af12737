"""The compiled embedding-row ops against TensorFlow's, in one DP train step.

For zoo models with an embedding (`benchmarks/throughput.py`'s, one fixed
batch, no input pipeline, no XLA), traces the DP `train_step` of
`benchmarks/step_breakdown.py` twice in one process: with tfdp's compiled
first positions, merge and scatter (`tfdp.per_example.native_rows`), and
with TensorFlow's ops (the reference), then times the two and plain
Keras's step interleaved, round after round, and prints the median ms a
step and the ratios (medians of per-round ratios).

    python benchmarks/embedding_rows.py --model text_pooling embedding_lstm --rounds 5
"""

import argparse
import os
import statistics
import time
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from step_breakdown import stages  # noqa: E402
from throughput import ZOO  # noqa: E402

from tfdp.per_example import native_rows  # noqa: E402


def traced(function, compiled_rows):
    """`function` as a tf.function traced (and warmed) with or without the
    compiled row ops."""
    step = tf.function(function)
    if compiled_rows:
        step()
    else:
        with mock.patch.object(native_rows, "library_here", lambda dtype: None):
            step()
    step()
    return step


def milliseconds(step, repeats):
    start = time.perf_counter()
    for _ in range(repeats):
        result = step()
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result)
    return (time.perf_counter() - start) / repeats * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=["text_pooling"],
                        choices=sorted(name for name in ZOO if name in (
                            "text_pooling", "embedding_lstm", "embedding_bigru", "transformer")))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"rows: {native_rows.rows_path()}; {args.rounds} rounds of {args.repeats} steps, "
          "interleaved; ms are medians, ratios medians of per-round ratios.\n")
    print("| model | batch | Keras ms | DP ms, TensorFlow's ops | DP ms, compiled ops | "
          "compiled speed-up | DP/plain, TensorFlow's ops | DP/plain, compiled ops |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.model:
        steps = dict(stages(name))
        timed = {"keras": traced(steps["Keras train_step"], True),
                 "reference": traced(steps["DP train_step"], False),
                 "compiled": traced(steps["DP train_step"], True)}
        rounds = []
        for _ in range(args.rounds):
            rounds.append({label: milliseconds(step, args.repeats)
                           for label, step in timed.items()})

        def median(key):
            return statistics.median(r[key] for r in rounds)

        def ratio(top, bottom):
            return statistics.median(r[top] / r[bottom] for r in rounds)

        print(f"| {name} | {ZOO[name][0]} | {median('keras'):.1f} | "
              f"{median('reference'):.1f} | "
              f"{median('compiled'):.1f} | {ratio('reference', 'compiled'):.2f}x | "
              f"{ratio('keras', 'reference'):.2f} | {ratio('keras', 'compiled'):.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
