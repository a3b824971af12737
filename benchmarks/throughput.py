"""Training throughput: tfdp DP-SGD against the non-private Keras step.

Each configuration runs in a fresh process (so peak memory is its own) on
synthetic 28x28 data: the 4-layer tanh CNN of MECHANISMS.md section 6 and a
784-256-10 MLP, batch 256 and 2048, XLA off and on, tfdp's per-example path
"fast" (book-keeping) and, for the CNN at batch 256, "vectorized"
(tf.vectorized_map). Prints a Markdown table.

    python benchmarks/throughput.py              # full table (~10 minutes on 2 cores)
    python benchmarks/throughput.py --quick      # CNN at batch 256 only
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def build(model_name, private, method):
    import keras

    import tfdp
    from tfdp import recipes

    if model_name == "cnn":
        layers = recipes.tanh_cnn()
    else:
        layers = [
            keras.Input((28, 28, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(256, activation="tanh"),
            keras.layers.Dense(10),
        ]
    if private:
        return tfdp.DPSequential(layers, per_example_gradients=method)
    return keras.Sequential(layers)


def measure(model_name, batch, xla, private, method, steps):
    """Examples per second of `steps` training steps inside one `fit`.

    The clock runs from the end of the 5th step to the end of the last (the
    step's loss is read at both ends, which waits for the step), so the
    `fit` call's fixed costs (building the input pipeline, the epoch's
    epsilon) and the first steps are left out for both Keras and tfdp.
    """
    import keras
    import numpy as np

    import tfdp

    class StepClock(keras.callbacks.Callback):
        def __init__(self, first, last):
            super().__init__()
            self.first, self.last, self.times = first, last, {}

        def on_train_batch_end(self, batch, logs=None):
            if batch in (self.first, self.last):
                float(np.asarray(logs["loss"]))  # waits for this step
                self.times[batch] = time.perf_counter()

    keras.utils.set_random_seed(0)
    skip = 5
    num = batch * (steps + skip)  # Keras must not run out of data within the epoch
    rng = np.random.default_rng(0)
    x = rng.random((num, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, num)
    model = build(model_name, private, method)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if private:
        optimizer = tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    else:
        optimizer = keras.optimizers.SGD(0.1)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=xla)
    clock = StepClock(skip - 1, skip + steps - 1)
    model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=skip + steps, verbose=0,
              callbacks=[clock])
    seconds = clock.times[clock.last] - clock.times[clock.first]
    examples = batch * steps  # expected batch for DP (Poisson), exact for Keras
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"examples_per_s": examples / seconds, "peak_mib": peak_mib}


def configurations(quick):
    models = ["cnn"] if quick else ["cnn", "mlp"]
    batches = [256] if quick else [256, 2048]
    for model_name in models:
        for batch in batches:
            for xla in (False, True):
                yield model_name, batch, xla, "fast"
                if model_name == "cnn" and batch == 256:
                    yield model_name, batch, xla, "vectorized"


def run_child(model_name, batch, xla, private, method, steps):
    command = [sys.executable, __file__, "--child", json.dumps([model_name, batch, xla, private, method, steps])]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*json.loads(args.child))))
        return
    print("| model | batch | XLA | per-example path | Keras ex/s | tfdp DP-SGD ex/s | ratio | Keras peak MiB | tfdp peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    baselines = {}
    for model_name, batch, xla, method in configurations(args.quick):
        key = (model_name, batch, xla)
        if key not in baselines:
            baselines[key] = run_child(model_name, batch, xla, False, "auto", args.steps)
        base = baselines[key]
        dp = run_child(model_name, batch, xla, True, method, args.steps)
        print(
            f"| {model_name} | {batch} | {'on' if xla else 'off'} | {method} "
            f"| {base['examples_per_s']:.0f} | {dp['examples_per_s']:.0f} "
            f"| {dp['examples_per_s'] / base['examples_per_s']:.2f} "
            f"| {base['peak_mib']:.0f} | {dp['peak_mib']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
