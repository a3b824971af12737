"""Per-example pass of the tanh CNN: factored norms from float32 Gram
matrices (today's `rounding.factored_norm_bounds`) against the float64 Gram
matrices it replaced (`_float64_reference` below, main's code before issue
53 item 2, verbatim), interleaved rounds on one fixed batch.

The stage timed is step_breakdown.py's "per-example pass and norms"
(forward, backward to the rules' probes, every example's squared norm
bound) of `recipes.build_model("fashion_mnist")` with the recipe's
loss and clip, as a `tf.function` (no XLA). Each round times both routes
(best of 3 means of `--repeats` calls each); the table gives the median
over rounds.

    python benchmarks/factored_norms.py --batch 256 512 1024 2048 --rounds 3
    python benchmarks/factored_norms.py --norms-only   # the Gram norm alone

`--norms-only` times `factored_norm_bounds` alone on the shapes of the
CNN's one factored layer (the second convolution: 25 positions, 256 patch
entries, 32 filters; random data), old against new.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdp  # noqa: E402
from tfdp import recipes  # noqa: E402
from tfdp.per_example import rounding  # noqa: E402

NEW = rounding.factored_norm_bounds


def _float64_reference(x, g):
    """main's factored_norm_bounds before float32 Gram matrices."""
    positions, fan_in, fan_out = x.shape[1], x.shape[2], g.shape[2]
    x_gram, g_gram = rounding._gram64(x), rounding._gram64(g)
    estimate = tf.reduce_sum(tf.reduce_sum(x_gram * g_gram, 2), 1)
    rows_x = rounding.row_norm_bounds(tf.linalg.diag_part(x_gram), fan_in)
    rows_g = rounding.row_norm_bounds(tf.linalg.diag_part(g_gram), fan_out)
    terms = fan_in + fan_out + 2 * positions + 4
    sq = estimate + rounding.gamma(terms, tf.float64) * tf.square(rounding.mass_of(rows_x, rows_g))
    return tf.maximum(sq, 0.0), rows_x, rows_g


def per_example_pass(batch, route):
    """A tf.function computing every example's squared norm bound with
    `route` as the factored norm (patched in while it traces)."""
    keras.utils.set_random_seed(0)
    model = recipes.build_model("fashion_mnist")
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((batch, 28, 28, 1), np.float32))
    y = tf.constant(rng.integers(0, 10, batch))
    model(x[:1])
    mask = tf.ones([batch])

    @tf.function
    def run():
        grads, _, _ = tfdp.per_example.compute_per_example_gradients(
            model, x, y, mask, model._per_example_loss)
        return grads.sq_norms()

    rounding.factored_norm_bounds = route
    try:
        result = run().numpy()  # traces with `route`
    finally:
        rounding.factored_norm_bounds = NEW
    return run, result


def norms_only(batch, route):
    """A tf.function of `route` on the second convolution's shapes."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((batch, 25, 256), np.float32))
    g = tf.constant(rng.normal(size=(batch, 25, 32)).astype(np.float32) * 1e-3)
    run = tf.function(lambda: route(x, g)[0])
    return run, run().numpy()


def milliseconds(function, repeats):
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            result = function()
        result.numpy()
        best = min(best, (time.perf_counter() - start) / repeats * 1e3)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--norms-only", action="store_true")
    args = parser.parse_args()
    setup = norms_only if args.norms_only else per_example_pass
    print("| batch | float64 Grams (ms) | float32 Grams (ms) | speedup | max norm ratio new/old |")
    print("|---|---|---|---|---|")
    for batch in args.batch:
        old, old_norms = setup(batch, _float64_reference)
        new, new_norms = setup(batch, NEW)
        times = {"old": [], "new": []}
        for _ in range(args.rounds):
            times["old"].append(milliseconds(old, args.repeats))
            times["new"].append(milliseconds(new, args.repeats))
        old_ms, new_ms = statistics.median(times["old"]), statistics.median(times["new"])
        ratio = float(np.max(np.sqrt(new_norms / old_norms)))
        print(f"| {batch} | {old_ms:.1f} | {new_ms:.1f} | {old_ms / new_ms:.2f}x | {ratio:.6f} |",
              flush=True)


if __name__ == "__main__":
    main()
