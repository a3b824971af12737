"""The DP train step with materialized per-example tensors measured from
float32 row squares and summed unmasked where every bound is finite
(`rounding.sum_of_squares_by_rows`, `grads.finite_or_masked`: "new") against
the route before them, float64 squares of the whole tensor and the mask
always applied (`rounding.sum_of_squares`, `grads.masked`: "old"), in one
process: two copies of a zoo model (`benchmarks/throughput.py`, its batch
size, one fixed batch, no XLA), one traced with each route, their
`train_step`s timed in alternating rounds (the mean of `--repeats` calls
each), so load hits both alike. The table gives each route's median over
rounds and the median of the per-round ratios.

    python benchmarks/materialized_norms.py --model tanh_cnn_256 conv1d_series --rounds 7
"""

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdp  # noqa: E402
from embedding_rows import milliseconds  # noqa: E402
from throughput import ZOO, build  # noqa: E402
from tfdp.per_example import grads, rounding  # noqa: E402

NEW_ROUTES = (rounding.sum_of_squares_by_rows, grads.finite_or_masked)


def _masked_when_materialized(tensor, bounds, keep, min_entries=rounding.ROW_SQUARES_MIN_ENTRIES):
    """The old route's `finite_or_masked`: materialized tensors (called with
    the default `min_entries`) always masked; a factored part's x as today."""
    if min_entries:
        return grads.masked(tensor, keep)
    return NEW_ROUTES[1](tensor, bounds, keep, min_entries)


def traced_step(name, old):
    """The zoo model's DP train_step as a traced `tf.function` on one
    batch, built with the old route (`old=True`) or today's."""
    inputs, outputs, x, y = build(name)
    batch = ZOO[name][0]
    model = tfdp.DPModel(inputs, outputs)
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = ((tf.constant(x[:batch]), tf.constant(y[:batch])),
            {"mask": tf.ones([batch]), "expected_batch_size": tf.constant(float(batch))})
    if old:
        rounding.sum_of_squares_by_rows = rounding.sum_of_squares
        grads.finite_or_masked = _masked_when_materialized
    try:  # the routes are read while tracing only
        model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, steps_per_epoch=1, verbose=0)
        step = tf.function(lambda: model.train_step(data))
        step()
    finally:
        rounding.sum_of_squares_by_rows, grads.finite_or_masked = NEW_ROUTES
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", choices=sorted(ZOO), default=["tanh_cnn_256"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"DP train_step ms, {args.rounds} alternating rounds of {args.repeats} calls, "
          "medians; old/new: median of the per-round ratios\n")
    print("| model | batch | old ms | new ms | old/new |")
    print("|---|---|---|---|---|")
    for name in args.model:
        steps = {"old": traced_step(name, True), "new": traced_step(name, False)}
        times = {"old": [], "new": []}
        for _ in range(args.rounds):
            for route, step in steps.items():
                step()  # warm: the other route ran last
                times[route].append(milliseconds(step, args.repeats))
        ratio = statistics.median(o / n for o, n in zip(times["old"], times["new"]))
        print(f"| {name} | {ZOO[name][0]} | {statistics.median(times['old']):.2f} | "
              f"{statistics.median(times['new']):.2f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
