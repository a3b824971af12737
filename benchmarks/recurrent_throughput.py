"""Training throughput of recurrent text models: tfdp DP-SGD against Keras.

Embedding(20000, 128) + LSTM(64) and Embedding(20000, 128) +
Bidirectional(GRU(32)), each + Dense(1), sequence length 100, batch 128, on
random token ids. Both models of a row run in ONE process, their steps
interleaved (rounds of `--steps` steps each, after a warm-up), so the ratio is robust to a noisy machine. Each round is one
`fit` call timed from the end of its 2nd step to the end of its last (as
`benchmarks/throughput.py`), leaving out `fit`'s fixed costs. Prints a
Markdown table.

    python benchmarks/recurrent_throughput.py
    python benchmarks/recurrent_throughput.py --rounds 3 --steps 5   # quicker
    python benchmarks/recurrent_throughput.py --fixed-batch

`fit` draws Poisson batches padded to a fixed size (216 rows for an
expected 128 at IMDB's 25000 reviews), and every padded row runs through the
recurrence. `--fixed-batch` instead times `train_step` on one batch of
exactly `--batch` rows (all weights 1) for both, which isolates the cost of
per-example gradients, clipping and noise from that padding.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdp  # noqa: E402

L = keras.layers


def layers(name):
    rnn = L.LSTM(64) if name == "lstm" else L.Bidirectional(L.GRU(32))
    return [keras.Input((100,), dtype="int32"), L.Embedding(20000, 128), rnn, L.Dense(1)]


def compiled(name, private, xla):
    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    if private:
        model = tfdp.DPSequential(layers(name))
        optimizer = tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    else:
        model = keras.Sequential(layers(name))
        optimizer = keras.optimizers.SGD(0.1)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=xla)
    return model


class StepClock(keras.callbacks.Callback):
    """Times from the end of step `first` to the end of step `last`."""

    def __init__(self, first, last):
        super().__init__()
        self.first, self.last, self.times = first, last, {}

    def on_train_batch_end(self, batch, logs=None):
        if batch in (self.first, self.last):
            float(np.asarray(logs["loss"]))  # waits for this step
            self.times[batch] = time.perf_counter()

    def seconds(self):
        return self.times[self.last] - self.times[self.first]


def interleaved_fixed_batch(name, batch, rounds, steps, xla):
    """As `interleaved`, timing `train_step` on one batch of `batch` rows."""
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.integers(1, 20000, (batch, 100)).astype("int32")
    y = rng.integers(0, 2, (batch, 1)).astype("float32")
    models = {"keras": compiled(name, False, xla), "tfdp": compiled(name, True, xla)}
    for model in models.values():  # builds the optimizers' variables
        model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=1, verbose=0)
    info = {"mask": tf.ones([batch]), "expected_batch_size": tf.constant(float(batch))}
    data = {"keras": (tf.constant(x), tf.constant(y))}
    data["tfdp"] = (data["keras"], info)
    steps_of = {key: tf.function(model.train_step, jit_compile=xla) for key, model in models.items()}
    rates = {key: [] for key in models}
    for round_ in range(rounds + 1):  # round 0 traces and warms up
        for key in models:
            start = time.perf_counter()
            for _ in range(steps):
                logs = steps_of[key](data[key])
            float(np.asarray(logs["loss"]))  # waits for the last step
            if round_:
                rates[key].append(batch * steps / (time.perf_counter() - start))
    return float(np.median(rates["keras"])), float(np.median(rates["tfdp"])), models["tfdp"]


def interleaved(name, batch, rounds, steps, xla):
    """(Keras ex/s, tfdp ex/s, the DP model): medians over the rounds."""
    keras.utils.set_random_seed(0)
    skip = 2
    num = max(batch * (steps + skip), 25000)  # IMDB's size: its Poisson padding
    rng = np.random.default_rng(0)
    x = rng.integers(1, 20000, (num, 100)).astype("int32")
    y = rng.integers(0, 2, (num, 1)).astype("float32")
    models = {"keras": compiled(name, False, xla), "tfdp": compiled(name, True, xla)}
    rates = {key: [] for key in models}
    for round_ in range(rounds + 1):  # round 0 traces and warms up
        for key, model in models.items():
            clock = StepClock(skip - 1, skip + steps - 1)
            model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=skip + steps,
                      verbose=0, callbacks=[clock])
            if round_:
                # Expected batch for DP (Poisson sampling), exact for Keras.
                rates[key].append(batch * steps / clock.seconds())
    return float(np.median(rates["keras"])), float(np.median(rates["tfdp"])), models["tfdp"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--xla", action="store_true")
    parser.add_argument("--models", default="lstm,bigru")
    parser.add_argument("--fixed-batch", action="store_true", help="train_step on one fixed batch")
    args = parser.parse_args()
    measure = interleaved_fixed_batch if args.fixed_batch else interleaved
    print(f"{'train_step on one fixed batch' if args.fixed_batch else 'fit, Poisson batches'}:")
    print("| model | batch | XLA | per-example path | Keras ex/s | tfdp DP-SGD ex/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        keras_rate, dp_rate, dp_model = measure(name, args.batch, args.rounds, args.steps, args.xla)
        label = "Embedding+LSTM(64)" if name == "lstm" else "Embedding+Bidirectional(GRU(32))"
        print(
            f"| {label} | {args.batch} | {'on' if args.xla else 'off'} | {dp_model.per_example_path} "
            f"| {keras_rate:.0f} | {dp_rate:.0f} | {dp_rate / keras_rate:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
