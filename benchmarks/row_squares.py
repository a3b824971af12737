"""The compiled row squares against their TensorFlow reference, in one DP
train step.

For zoo models of `benchmarks/throughput.py` (one fixed batch, no input
pipeline, no XLA), traces the DP `train_step` of
`benchmarks/step_breakdown.py` twice in one process: with the compiled
sums of rows' squares that bound their norms (`tfdp.per_example.native_squares`)
and with their TensorFlow reference (the same values, bit for bit), then
times the two and plain Keras's step interleaved, round after round, and
prints the median ms a step and the ratios (medians of per-round ratios).

    python benchmarks/row_squares.py --model mlp mlp_2048 text_pooling --rounds 5
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from embedding_rows import compare, traced  # noqa: E402
from throughput import ZOO  # noqa: E402

from tfdp.per_example import native_squares  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=["mlp"], choices=sorted(ZOO))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"row squares: {native_squares.squares_path()}; {args.rounds} rounds of "
          f"{args.repeats} steps, interleaved; ms are medians, ratios medians of per-round "
          "ratios.\n")
    compare(args.model, lambda step: traced(step, False, native_squares, lambda: None),
            args.rounds, args.repeats, ops="compiled op")


if __name__ == "__main__":
    main()
