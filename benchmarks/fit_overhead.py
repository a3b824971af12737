"""The fixed cost of one `fit` call: a 2-step DP fit of a small MLP.

Each `fit` builds its input pipeline (the Poisson draw in the TensorFlow graph,
`tfdp.data.sampling`) and starts an iterator over it; with the train step
already traced, a 2-step fit is mostly that fixed cost. The zoo's whole-fit
figures (`benchmarks/throughput.py`, epochs of 6 to 30 steps) include it once
per fit. Prints the median over `--rounds` fits, after warm-up fits.

    python benchmarks/fit_overhead.py
    python benchmarks/fit_overhead.py --steps 30
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import keras
    import numpy as np

    import tfdp

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(7680, 32)).astype("float32"), rng.integers(0, 10, 7680)
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((32,)), keras.layers.Dense(64, activation="tanh"),
                               keras.layers.Dense(10)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.01, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    settings = dict(batch_size=256, epochs=1, steps_per_epoch=args.steps, verbose=0)
    for _ in range(3):  # trace the step
        model.fit(x, y, **settings)
    seconds = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        model.fit(x, y, **settings)
        seconds.append(time.perf_counter() - start)
    print(f"{args.steps}-step fit: median {statistics.median(seconds):.3f} s "
          f"(min {min(seconds):.3f}, max {max(seconds):.3f}, {args.rounds} fits)")


if __name__ == "__main__":
    main()
