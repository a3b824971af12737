"""How much of the DP step's extra time two of its parts hold: the step
timed with each part replaced by a stand-in that is NOT private.

For a model of `benchmarks/throughput.py`'s zoo (its batch size, one fixed
batch, no input pipeline, no XLA; the steps of `benchmarks/step_breakdown.py`),
one process traces and times, interleaved over `--rounds` rounds of
`--repeats` calls:

* the DP `train_step` as tfdp runs it;
* the same step with no noise (`add_normals` returns the sums, divided as
  before): what the Gaussian draw costs in the step;
* the same step with row norms from one `tf.norm` a row, scaled by 1.001,
  in place of `rounding.row_bounds` (float32 squares and their proved
  bound, float64 squares for rows that need them): an upper limit on what
  a faster row bound could save;
* both stand-ins at once;
* Keras's own `train_step` on the same model.

The stand-ins are for measurement only: without noise nothing is private,
and a norm scaled by 1.001 is not a proved bound. Medians and minimums of
the rounds, in ms a step; read the rows against each other (one process,
the same load).

    python benchmarks/overhead_whatif.py --model mlp text_pooling --rounds 7
"""

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402
from embedding_rows import milliseconds  # noqa: E402
from step_breakdown import stages  # noqa: E402
from throughput import ZOO  # noqa: E402

from tfdp.mechanisms import dpsgd, gaussian  # noqa: E402
from tfdp.per_example import rounding  # noqa: E402

_ADD_NORMALS = gaussian.add_normals
_ROW_BOUNDS = rounding.row_bounds


def _no_noise(tensors, seeds, stddev, divisor=None):
    """`add_normals` without the draw (NOT private)."""
    del seeds, stddev
    return [t if divisor is None else t / tf.cast(divisor, t.dtype) for t in tensors]


def _one_pass_rows(rows, floor=None):
    """Row norms from one `tf.norm` (NOT a proved bound)."""
    del floor
    return tf.cast(tf.norm(rows, axis=-1), tf.float64) * 1.001


def _traced_step(name, add_normals, row_bounds):
    """(DP step, Keras step) as traced `tf.function`s with the given parts."""
    dpsgd.add_normals = add_normals  # the name dpsgd.add_gaussian_noise calls
    rounding.row_bounds = row_bounds
    try:
        steps = dict(stages(name))
        dp_step = tf.function(steps["DP train_step"])
        dp_step()  # traced with the parts above
    finally:
        dpsgd.add_normals, rounding.row_bounds = _ADD_NORMALS, _ROW_BOUNDS
    return dp_step, tf.function(steps["Keras train_step"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", choices=sorted(ZOO), default=["mlp"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print("| model | step | median ms | min ms |")
    print("|---|---|---|---|")
    for name in args.model:
        steps = {}
        steps["DP train_step"], keras_step = _traced_step(name, _ADD_NORMALS, _ROW_BOUNDS)
        steps["DP, no noise (not private)"], _ = _traced_step(name, _no_noise, _ROW_BOUNDS)
        steps["DP, one-pass row norms (not a bound)"], _ = _traced_step(
            name, _ADD_NORMALS, _one_pass_rows)
        steps["DP, both stand-ins"], _ = _traced_step(name, _no_noise, _one_pass_rows)
        steps["Keras train_step"] = keras_step
        keras_step()
        times = {label: [] for label in steps}
        for _ in range(args.rounds):
            for label, step in steps.items():
                times[label].append(milliseconds(step, args.repeats))
        for label, values in times.items():
            print(f"| {name} | {label} | {statistics.median(values):.2f} | {min(values):.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
