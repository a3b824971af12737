"""What keying dropout per example costs a DP step
(`tfdp.per_example.keyed_noise`).

For each model (an MLP with two Dropout(0.1) layers, a one-block
transformer encoder with KerasHub's dropout 0.1 in attention and the
feed-forward, an LSTM with dropout and recurrent dropout 0.1), times the
compiled DP train step in one process, alternating over rounds: tfdp's
keyed masks, and Keras's own draw by batch position (the masks before
keying; NOT private, timed for scale). Prints medians in ms a step and
keyed / positional.

    python benchmarks/keyed_noise.py --rounds 5
"""

import argparse
import contextlib
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdp  # noqa: E402
from tfdp.per_example import batched, keyed_noise  # noqa: E402
from results import cpu_name  # noqa: E402  (benchmarks/ is on the path when run as a script)

BATCH = 256


def _mlp():
    inputs = keras.Input((784,))
    h = keras.layers.Dropout(0.1)(keras.layers.Dense(256, activation="relu")(inputs))
    h = keras.layers.Dropout(0.1)(keras.layers.Dense(256, activation="relu")(h))
    return inputs, keras.layers.Dense(10)(h), np.random.default_rng(0).random((BATCH, 784))


def _transformer():
    import keras_hub

    inputs = keras.Input((64,), dtype="int32")
    h = keras.layers.Embedding(1000, 64)(inputs)
    h = keras_hub.layers.TransformerEncoder(128, 4, dropout=0.1)(h)
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h))
    return inputs, out, np.random.default_rng(0).integers(0, 1000, (BATCH, 64))


def _lstm():
    inputs = keras.Input((32, 16))
    h = keras.layers.LSTM(64, dropout=0.1, recurrent_dropout=0.1)(inputs)
    return inputs, keras.layers.Dense(10)(h), np.random.default_rng(0).random((BATCH, 32, 16))


MODELS = {"mlp": _mlp, "transformer": _transformer, "lstm": _lstm}


@contextlib.contextmanager
def positional():
    """Keras's own draws: the keyed handlers call the layers' own `call`."""
    saved = keyed_noise.keyed_noise_call, batched.keyed_cell_masks
    keyed_noise.keyed_noise_call = lambda layer, call, keys, *a, **k: call(*a, **k)
    batched.keyed_cell_masks = lambda model, keys: contextlib.nullcontext()
    try:
        yield
    finally:
        keyed_noise.keyed_noise_call, batched.keyed_cell_masks = saved


def _step(name):
    """A no-argument callable running one compiled DP step (traced here:
    inside `positional()` for Keras's draws)."""
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    inputs, outputs, x = MODELS[name]()
    model = tfdp.DPModel(inputs, outputs)
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = x.astype(model.inputs[0].dtype)
    y = (np.arange(BATCH) % 10).astype("int64")
    model._build_for((x[:1], y[:1]))
    model.make_train_function()
    step_info = {"mask": tf.ones([BATCH]), "expected_batch_size": tf.constant(float(BATCH))}
    data = [((tf.constant(x), tf.constant(y)), step_info)]
    model.train_function(data)
    return lambda: model.train_function(data)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS))
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; batch {BATCH}; {args.steps} steps a round, {args.rounds} rounds")
    print("| model | keyed ms | positional ms | keyed / positional |")
    print("|---|---|---|---|")
    for name in args.only or sorted(MODELS):
        keyed = _step(name)
        with positional():
            plain = _step(name)
        times = {"keyed": [], "positional": []}
        for _ in range(args.rounds):
            for label, step in (("keyed", keyed), ("positional", plain)):
                step()
                start = time.perf_counter()
                for _ in range(args.steps):
                    logs = step()
                float(np.asarray(logs["loss"]))
                times[label].append((time.perf_counter() - start) / args.steps * 1e3)
        ratios = [k / p for k, p in zip(times["keyed"], times["positional"])]
        print(f"| {name} | {statistics.median(times['keyed']):.2f} | "
              f"{statistics.median(times['positional']):.2f} | {statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
