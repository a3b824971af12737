"""The compiled row squares against TensorFlow's ops, in one DP train step.

For zoo models of `benchmarks/throughput.py` (one fixed batch, no input
pipeline, no XLA), traces the DP `train_step` of
`benchmarks/step_breakdown.py` twice in one process: with the compiled
sums of rows' squares that bound their norms (`tfdp.per_example.native_squares`)
and with TensorFlow's ops, then times the two and plain Keras's step
interleaved, round after round, and prints the median ms a step and the
ratios (medians of per-round ratios). `--against` picks TensorFlow's ops:
`fallback`, the op's reference (the same values, bit for bit, and what
runs without the library), or `reduce_sum`, one `tf.reduce_sum` of the
squares, as tfdp summed them before the compiled op (the same bound, other
roundings; a table for each).

    python benchmarks/row_squares.py --model mlp mlp_2048 text_pooling --rounds 5
    python benchmarks/row_squares.py --model mlp --against fallback reduce_sum
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from embedding_rows import compare, traced  # noqa: E402
from throughput import ZOO  # noqa: E402

from tfdp.per_example import native_squares  # noqa: E402

AGAINST = {
    "fallback": ("TensorFlow's reference", "library_here", lambda: None),
    "reduce_sum": ("one reduce_sum", "row_squares",
                   lambda rows: tf.reduce_sum(tf.square(rows), -1)),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=["mlp"], choices=sorted(ZOO))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--against", nargs="+", choices=sorted(AGAINST), default=["fallback"])
    args = parser.parse_args()
    print(f"row squares: {native_squares.squares_path()}; {args.rounds} rounds of "
          f"{args.repeats} steps, interleaved; ms are medians, ratios medians of per-round "
          "ratios.")
    for against in args.against:
        label, name, replacement = AGAINST[against]
        print(f"\nAgainst {against}:\n")
        compare(args.model,
                lambda step, name=name, replacement=replacement: traced(
                    step, False, native_squares, name, replacement),
                args.rounds, args.repeats, ops="compiled op", against=label)


if __name__ == "__main__":
    main()
