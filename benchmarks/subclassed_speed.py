"""Step speed of a subclassed `tfdp.DPModel` against the same functional one.

A subclassed model (`class MyModel(tfdp.DPModel)` with `call()`) has no graph
for tfdp to walk, so it trains on the whole-model vectorized path. For a zoo
model of benchmarks/throughput.py this times, in one process, one epoch's
steps (skipping the first three, as throughput.py does) of: the functional
`DPModel` on its default path, the functional one forced to
`per_example_gradients="vectorized"`, and a subclassed `DPModel` whose
`call()` runs the same layers. Median over `--rounds`; prints a Markdown
table of examples/s.

    python benchmarks/subclassed_speed.py --only mlp --rounds 3
    python benchmarks/subclassed_speed.py --only mlp --batch 64 --steps 8   # quicker

`--batch` and `--steps` replace the zoo model's batch size and steps an
epoch (the vectorized path holds batch x parameters floats).
"""

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from throughput import ZOO, build, fit_once  # noqa: E402


def models(name):
    import keras

    import tfdp

    class Subclassed(tfdp.DPModel):
        def __init__(self, graph, **kwargs):
            super().__init__(**kwargs)
            self.graph = graph

        def call(self, inputs):
            return self.graph(inputs)

    keras.utils.set_random_seed(0)
    inputs, outputs, x, y = build(name)
    built = {
        "functional, default path": tfdp.DPModel(inputs, outputs),
        "functional, vectorized": tfdp.DPModel(inputs, outputs,
                                               per_example_gradients="vectorized"),
        "subclassed (vectorized)": Subclassed(keras.Model(inputs, outputs)),
    }
    for model in built.values():
        model.compile(
            optimizer=tfdp.optimizers.DPSGD(0.01, l2_norm_clip=1.0, noise_multiplier=1.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return built, x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=["mlp"], choices=sorted(ZOO))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the zoo's)")
    parser.add_argument("--steps", type=int, default=None, help="steps an epoch (default: the zoo's)")
    args = parser.parse_args()
    for name in args.only:
        batch, steps = ZOO[name]
        ZOO[name] = (args.batch or batch, args.steps or steps)
    print("| model | path | examples/s (in fit) | path line |")
    print("|---|---|---|---|")
    for name in args.only:
        built, x, y = models(name)
        speeds = {label: [] for label in built}
        for model in built.values():  # warm-up: tracing
            fit_once(model, x, y, name)
        for _ in range(args.rounds):
            for label, model in built.items():
                speeds[label].append(fit_once(model, x, y, name)["step"])
        for label, model in built.items():
            print(f"| {name} | {label} | {statistics.median(speeds[label]):.0f} | "
                  f"{model.per_example_path} |")


if __name__ == "__main__":
    main()
