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


def traced(function, compiled, module=native_rows, name="library_here",
           replacement=lambda dtype: None):
    """`function` as a tf.function traced (and warmed) with the compiled
    ops, or (`compiled` False) with `module.name` replaced by `replacement`
    while it traces (by default no library: TensorFlow's ops)."""
    step = tf.function(function)
    if compiled:
        step()
    else:
        with mock.patch.object(module, name, replacement):
            step()
    step()
    return step


def milliseconds(step, repeats):
    start = time.perf_counter()
    for _ in range(repeats):
        result = step()
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result)
    return (time.perf_counter() - start) / repeats * 1e3


def compare(names, reference, rounds, repeats, ops="compiled ops", against="TensorFlow's ops"):
    """Prints the table of `main` for zoo models `names`: Keras's step, the
    DP step traced by `reference(step)` (named `against`) and traced with
    the compiled `ops`, interleaved over `rounds` rounds of `repeats` steps."""
    print(f"| model | batch | Keras ms | DP ms, {against} | DP ms, {ops} | "
          f"compiled speed-up | DP/plain, {against} | DP/plain, {ops} |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        steps = dict(stages(name))
        timed = {"keras": traced(steps["Keras train_step"], True),
                 "reference": reference(steps["DP train_step"]),
                 "compiled": traced(steps["DP train_step"], True)}
        results = [{label: milliseconds(step, repeats) for label, step in timed.items()}
                   for _ in range(rounds)]

        def median(key):
            return statistics.median(r[key] for r in results)

        def ratio(top, bottom):
            return statistics.median(r[top] / r[bottom] for r in results)

        print(f"| {name} | {ZOO[name][0]} | {median('keras'):.1f} | {median('reference'):.1f} | "
              f"{median('compiled'):.1f} | {ratio('reference', 'compiled'):.2f}x | "
              f"{ratio('keras', 'reference'):.2f} | {ratio('keras', 'compiled'):.2f} |",
              flush=True)


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
    compare(args.model, lambda step: traced(step, False), args.rounds, args.repeats)


if __name__ == "__main__":
    main()
