"""Training throughput on a model zoo: tfdp DP-SGD against plain Keras.

For every zoo model, one child process builds the plain Keras model and the
same model as a `tfdp.DPModel` (same weights), for each `--dtypes` policy
(float32 and/or mixed_bfloat16), then fits each for one epoch of `steps`
steps, alternating all of them for `--rounds` rounds after a warm-up round
(tracing), and for each `--jit-compile` value (both models compiled with
it). Each row gives the median over rounds of examples/s measured two
ways, in two separate `fit` calls per round: the whole `fit` call with no
callback of the benchmark's own (input pipeline, callbacks and DP's epsilon
included: what a user with verbose=0 waits for), and inside `fit` (from the
end of the 3rd step to the end of the last, the step's loss read at both
ends by a callback). With two dtypes the last column gives bf16's whole-fit
speed over float32's for the same kind (plain or DP). Peak memory is
measured in separate child processes, one per model and kind, as the growth
of the process's peak RSS during `fit` over its RSS just before. "noise ms"
is the time to draw one step's Gaussian noise for every parameter, the
floor DP adds whatever the per-example path (dense on every embedding row).
With both `--jit-compile` values the last column gives XLA's whole-fit
speed over the same dtype without it. Synthetic data. Prints a Markdown
table.

    python benchmarks/throughput.py                 # whole zoo (~25 minutes on 2 cores)
    python benchmarks/throughput.py --only tanh_cnn_256 text_pooling --no-memory
    python benchmarks/throughput.py --only mlp mlp_2048 --dtypes float32 mixed_bfloat16
    python benchmarks/throughput.py --no-memory --jit-compile false true --steps-scale 10   # a GPU
    python benchmarks/throughput.py --only mlp tanh_cnn_256 --examples-per-user 4   # user-level
    python benchmarks/throughput.py --only mlp tanh_cnn_256 --bands 4   # DP-BandMF

`--steps-scale k` runs k times as many steps an epoch (with k times the
data): the zoo's epochs are sized for 2 CPU cores, and on a GPU the
per-`fit` costs of a 6- to 30-step epoch weigh on every whole-fit figure.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# name: (batch size, steps per epoch)
ZOO = {
    "tanh_cnn_256": (256, 30),
    "tanh_cnn_2048": (2048, 6),
    "mlp": (256, 30),
    "mlp_2048": (2048, 6),
    "text_pooling": (256, 20),
    "embedding_lstm": (128, 8),
    "embedding_bigru": (128, 8),
    "transformer": (64, 8),
    "resnet_groupnorm": (128, 8),
    "conv1d_series": (256, 20),
}


def build(name):
    """(keras layers graph as (inputs, outputs), x, y) for a zoo model."""
    import keras
    import numpy as np

    from tfdp import recipes

    L = keras.layers
    rng = np.random.default_rng(0)
    batch, steps = ZOO[name]
    n = batch * (steps + 1)

    def tokens(length, vocab):
        return rng.integers(1, vocab, (n, length)).astype("int32")

    if name.startswith("tanh_cnn"):
        inputs = keras.Input((28, 28, 1))
        outputs = keras.Sequential(recipes.tanh_cnn()[1:])(inputs)
        x = rng.random((n, 28, 28, 1), dtype=np.float32)
    elif name.startswith("mlp"):  # 784-512-256-10
        inputs = keras.Input((28, 28, 1))
        h = L.Dense(512, activation="relu")(L.Flatten()(inputs))
        outputs = L.Dense(10)(L.Dense(256, activation="relu")(h))
        x = rng.random((n, 28, 28, 1), dtype=np.float32)
    elif name == "text_pooling":
        inputs = keras.Input((128,), dtype="int32")
        h = L.GlobalAveragePooling1D()(L.Embedding(20000, 128)(inputs))
        outputs = L.Dense(2)(h)
        x = tokens(128, 20000)
    elif name == "embedding_lstm":
        inputs = keras.Input((100,), dtype="int32")
        outputs = L.Dense(2)(L.LSTM(64)(L.Embedding(20000, 128)(inputs)))
        x = tokens(100, 20000)
    elif name == "embedding_bigru":
        inputs = keras.Input((100,), dtype="int32")
        h = L.Bidirectional(L.GRU(32))(L.Embedding(20000, 128)(inputs))
        outputs = L.Dense(2)(h)
        x = tokens(100, 20000)
    elif name == "transformer":
        inputs = keras.Input((128,), dtype="int32")
        h = L.Embedding(5000, 128)(inputs)
        for _ in range(2):
            attended = L.MultiHeadAttention(num_heads=4, key_dim=32)(h, h)
            h = L.LayerNormalization()(h + attended)
            ffn = L.Dense(128)(L.Dense(256, activation="relu")(h))
            h = L.LayerNormalization()(h + ffn)
        outputs = L.Dense(2)(L.GlobalAveragePooling1D()(h))
        x = tokens(128, 5000)
    elif name == "resnet_groupnorm":
        inputs = keras.Input((32, 32, 3))
        h = L.Conv2D(16, 3, padding="same", activation="relu")(inputs)
        for filters, stride in ((16, 1), (32, 2)):
            skip = h if stride == 1 else L.Conv2D(filters, 1, strides=stride)(h)
            r = L.Conv2D(filters, 3, strides=stride, padding="same")(h)
            r = L.Activation("relu")(L.GroupNormalization(4)(r))
            r = L.GroupNormalization(4)(L.Conv2D(filters, 3, padding="same")(r))
            h = L.Activation("relu")(skip + r)
        outputs = L.Dense(10)(L.GlobalAveragePooling2D()(h))
        x = rng.random((n, 32, 32, 3), dtype=np.float32)
    elif name == "conv1d_series":
        inputs = keras.Input((128, 8))
        h = L.Conv1D(32, 5, activation="relu")(inputs)
        h = L.Conv1D(32, 5, activation="relu")(L.MaxPooling1D(2)(h))
        outputs = L.Dense(2)(L.GlobalAveragePooling1D()(h))
        x = rng.normal(size=(n, 128, 8)).astype(np.float32)
    else:
        raise ValueError(f"Unknown zoo model. Received: name={name!r}")
    classes = outputs.shape[-1]
    y = rng.integers(0, classes, n)
    return inputs, outputs, x, y


class StepClock:
    """Keras callback timing the steps of one epoch (skipping the first)."""

    def __new__(cls, first, last):
        import keras
        import numpy as np

        class Clock(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.times = {}

            def on_train_batch_end(self, batch, logs=None):
                if batch in (first, last):
                    float(np.asarray(logs["loss"]))  # waits for this step
                    self.times[batch] = time.perf_counter()

            def seconds(self):
                return self.times[last] - self.times[first]

        return Clock()


def make_models(name, dtype="float32", jit_compile=False, steps_per_execution=1):
    import keras

    import tfdp

    keras.utils.set_random_seed(0)
    keras.config.set_dtype_policy(dtype)
    try:
        inputs, outputs, x, y = build(name)
    finally:
        keras.config.set_dtype_policy("float32")
    plain = keras.Model(inputs, outputs)
    private = tfdp.DPModel(inputs, outputs)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss,
                  jit_compile=jit_compile, steps_per_execution=steps_per_execution)
    private.compile(optimizer=private_optimizer(), loss=loss, jit_compile=jit_compile,
                    steps_per_execution=steps_per_execution)
    return plain, private, x, y


# k for user-level DP (--examples-per-user): the DP model's records belong to
# users of k records each and a step samples batch / k users, k records each.
EXAMPLES_PER_USER = [None]
# b for DP-BandMF (--bands): the DP model trains with amplified DP-BandMF.
BANDS = [None]


def private_optimizer():
    import keras

    import tfdp

    if BANDS[0]:
        return tfdp.optimizers.DPBandMF(keras.optimizers.SGD(0.01), l2_norm_clip=1.0,
                                        noise_multiplier=1.0, bands=BANDS[0])
    return tfdp.optimizers.DPSGD(0.01, l2_norm_clip=1.0, noise_multiplier=1.0)


def fit_once(model, x, y, name):
    batch, steps = ZOO[name]
    k = EXAMPLES_PER_USER[0]
    settings = dict(batch_size=batch, epochs=1, steps_per_epoch=steps, verbose=0)
    if k and hasattr(model, "privacy"):  # the same records a step, sampled by user
        settings.update(user_ids=np.arange(len(y)) // k, examples_per_user=k,
                        batch_size=max(1, batch // k))
    skip = 2
    start = time.perf_counter()
    model.fit(x, y, **settings)
    wall = time.perf_counter() - start
    clock = StepClock(skip, steps - 1)
    model.fit(x, y, callbacks=[clock], **settings)
    return {
        "step": batch * (steps - 1 - skip) / clock.seconds(),
        "epoch": batch * steps / wall,
    }


def noise_ms(model):
    """Milliseconds to draw N(0, 1) for every trainable parameter once
    (tfdp's generator, as the DP step draws it)."""
    import tensorflow as tf

    from tfdp.mechanisms import dpsgd

    shapes = [v.shape for v in model.trainable_variables]

    @tf.function
    def draw(seed):
        return dpsgd.gaussian_noise_like([tf.zeros(s) for s in shapes], 1.0, seed)

    draw(tf.constant([0, 0], tf.int64))
    times = []
    for i in range(5):
        start = time.perf_counter()
        [t.numpy() for t in draw(tf.constant([i, 1], tf.int64))]
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def speed_child(name, rounds, dtypes=("float32",), jit_values=(False,)):
    models = {}
    for dtype in dtypes:
        for jit in jit_values:
            plain, private, x, y = make_models(name, dtype, jit)
            models[(variant(dtype, jit), "plain")] = plain
            models[(variant(dtype, jit), "dp")] = private
    results = {key: [] for key in models}
    for round_index in range(rounds + 1):
        for key, model in models.items():
            result = fit_once(model, x, y, name)
            if round_index:  # round 0 traces the steps
                results[key].append(result)
    median = {
        f"{key}/{kind}": {k: statistics.median(r[k] for r in runs) for k in ("step", "epoch")}
        for (key, kind), runs in results.items()
    }
    return {
        "speeds": median,
        "path": private.per_example_path.split(": ", 1)[1],
        "params": int(sum(v.shape.num_elements() for v in private.trainable_variables)),
        "noise_ms": noise_ms(private),
    }


def variant(dtype, jit):
    """The key of one (dtype policy, jit_compile) pair in a child's results."""
    return f"{dtype}/xla" if jit else dtype


def memory_child(name, kind):
    plain, private, x, y = make_models(name)
    model = plain if kind == "plain" else private
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fit_once(model, x, y, name)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_growth_mib": (after - before) / 1024}


def scale_steps(factor):
    """Multiplies every zoo model's steps per epoch by `factor` (in place)."""
    for name, (batch, steps) in ZOO.items():
        ZOO[name] = (batch, steps * factor)


def run_child(steps_scale, *args):
    command = [sys.executable, __file__, "--steps-scale", str(steps_scale), "--child", json.dumps(args)]
    if EXAMPLES_PER_USER[0]:
        command[2:2] = ["--examples-per-user", str(EXAMPLES_PER_USER[0])]
    if BANDS[0]:
        command[2:2] = ["--bands", str(BANDS[0])]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return {"error": last[:120]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(ZOO))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32"],
                        choices=["float32", "mixed_bfloat16", "mixed_float16"],
                        help="dtype policies to measure, interleaved in one process")
    parser.add_argument("--jit-compile", nargs="+", default=["false"], choices=["false", "true"],
                        help="jit_compile values to measure (plain and DP alike), interleaved")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    parser.add_argument("--steps-scale", type=int, default=1,
                        help="run this many times each model's steps per epoch (for a fast GPU)")
    parser.add_argument("--examples-per-user", type=int, default=None,
                        help="user-level DP: tfdp samples batch/k users of k records a step")
    parser.add_argument("--bands", type=int, default=None,
                        help="train the DP model with amplified DP-BandMF of this many bands")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.examples_per_user is not None and args.examples_per_user < 1:
        parser.error(f"--examples-per-user must be >= 1. Received: {args.examples_per_user}")
    EXAMPLES_PER_USER[0] = args.examples_per_user
    if args.bands is not None and args.bands < 1:
        parser.error(f"--bands must be >= 1. Received: {args.bands}")
    BANDS[0] = args.bands
    if args.steps_scale < 1:
        parser.error(f"--steps-scale must be >= 1. Received: {args.steps_scale}")
    scale_steps(args.steps_scale)
    if args.child:
        kind, *rest = json.loads(args.child)
        result = speed_child(*rest) if kind == "speed" else memory_child(*rest)
        print(json.dumps(result))
        return
    jit_values = [value == "true" for value in args.jit_compile]
    if args.bands:
        print(f"tfdp trains with amplified DP-BandMF, {args.bands} bands (DP-SGD otherwise).\n")
    if args.examples_per_user:
        print(f"User-level DP: tfdp samples batch / {args.examples_per_user} users a step, "
              f"{args.examples_per_user} records each (ex/s counts records).\n")
    compare, compare_jit = len(args.dtypes) > 1, len(jit_values) > 1
    print("| model | batch | dtype | XLA | params | per-example path | Keras ex/s (step / fit) "
          "| tfdp ex/s (step / fit) | DP/plain (step / fit) | noise ms | "
          "Keras peak +MiB | tfdp peak +MiB |" + (" fit vs float32 (Keras / tfdp) |" if compare else "")
          + (" fit vs no XLA (Keras / tfdp) |" if compare_jit else ""))
    print("|---" * (12 + compare + compare_jit) + "|")
    for name in args.only or ZOO:
        speed = run_child(args.steps_scale, "speed", name, args.rounds, args.dtypes, jit_values)
        memory = {} if args.no_memory else {
            kind: run_child(args.steps_scale, "memory", name, kind) for kind in ("plain", "dp")}
        batch = ZOO[name][0]
        if "error" in speed:
            print(f"| {name} | {batch} | | | fails: {speed['error']} |", flush=True)
            continue
        mib = [memory.get(k, {}).get("peak_growth_mib") for k in ("plain", "dp")]
        for dtype, jit in [(d, j) for d in args.dtypes for j in jit_values]:
            key = variant(dtype, jit)
            plain, dp = speed["speeds"][f"{key}/plain"], speed["speeds"][f"{key}/dp"]
            row = (
                f"| {name} | {batch} | {dtype} | {'yes' if jit else 'no'} | {speed['params']:,} "
                f"| {speed['path']} "
                f"| {plain['step']:.0f} / {plain['epoch']:.0f} | {dp['step']:.0f} / {dp['epoch']:.0f} "
                f"| {dp['step'] / plain['step']:.2f} / {dp['epoch'] / plain['epoch']:.2f} "
                f"| {speed['noise_ms']:.1f} | "
                + " | ".join("-" if m is None else f"{m:.0f}" for m in mib) + " |"
            )
            if compare:
                row += fit_ratios(speed["speeds"], key, variant("float32", jit)
                                  if "float32" in args.dtypes else None)
            if compare_jit:
                row += fit_ratios(speed["speeds"], key, variant(dtype, False))
            print(row, flush=True)


def fit_ratios(speeds, key, base):
    """A table cell: whole-fit speed of `key` over `base`, plain and DP."""
    if base is None:
        return " |"
    plain, dp = (speeds[f"{key}/{k}"]["epoch"] / speeds[f"{base}/{k}"]["epoch"]
                 for k in ("plain", "dp"))
    return f" {plain:.2f} / {dp:.2f} |"


if __name__ == "__main__":
    main()
