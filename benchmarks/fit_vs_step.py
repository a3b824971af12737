"""What a `fit` adds to its compiled step, DP against plain Keras.

`benchmarks/step_breakdown.py` times the compiled `train_step` on one fixed
batch; `benchmarks/long_fit.py` times the steady step of a long `fit`. The
two differ by what the fit adds around the step: the input pipeline (for
tfdp, the Poisson draw and the gather of the drawn rows; its batches vary
in length around the expected batch size), Keras's train function and the
callbacks. For each zoo model (one process, both models built as
`benchmarks/throughput.py` builds them), this prints, alternating over
`--rounds` rounds, the median milliseconds a step of:

- the compiled `train_step` called on the data's first `--steps // 2`
  batches of the expected batch size in turn (each call a different batch,
  as in a fit: one batch called again and again stays in the caches, which
  favours the DP step, whose per-example pass reads its inputs more often);
- the steady step of a `--steps`-step `fit` (`long_fit.timed_fit`).

    python benchmarks/fit_vs_step.py
    python benchmarks/fit_vs_step.py --only mlp text_pooling --rounds 7
"""

import argparse
import itertools
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import long_fit  # noqa: E402
import throughput  # noqa: E402

MODELS = ("mlp", "text_pooling", "conv1d_series", "tanh_cnn_256")


def compiled_steps(plain, private, x, y, batch, count):
    """(plain, private) zero-argument callables: each call runs the model's
    compiled `train_step` on the next of the data's first `count` batches of
    `batch` rows (all drawn), in turn."""
    import tensorflow as tf

    batches = [(tf.constant(x[i * batch:(i + 1) * batch]),
                tf.constant(y[i * batch:(i + 1) * batch])) for i in range(count)]
    info = {"mask": tf.ones([batch]), "expected_batch_size": tf.constant(float(batch))}
    plain_step = tf.function(lambda x_batch, y_batch: plain.train_step((x_batch, y_batch)))
    private_step = tf.function(
        lambda x_batch, y_batch: private.train_step(((x_batch, y_batch), info)))
    plain_order, private_order = itertools.cycle(batches), itertools.cycle(batches)
    return (lambda: plain_step(*next(plain_order)),
            lambda: private_step(*next(private_order)))


def step_ms(step, calls):
    """Milliseconds a call of `step`, over `calls` calls (waits for the last)."""
    import tensorflow as tf

    start = time.perf_counter()
    for _ in range(calls):
        outputs = step()
    tf.nest.map_structure(lambda t: t.numpy(), outputs)
    return 1e3 * (time.perf_counter() - start) / calls


def measure(name, steps, rounds):
    """{column: median ms a step} for the zoo model `name`."""
    batch = throughput.ZOO[name][0]
    throughput.ZOO[name] = (batch, steps)  # build() sizes the data: steps + 1 batches
    plain, private, x, y = throughput.make_models(name)
    for model in (plain, private):
        model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=2, verbose=0)
    plain_step, private_step = compiled_steps(plain, private, x, y, batch, steps // 2)
    plain_step(), private_step()

    def fit_ms(model):
        return 1e3 * long_fit.timed_fit(model, x, y, batch, steps)[1]

    columns = {
        "Keras step": lambda: step_ms(plain_step, steps // 2),
        "Keras fit": lambda: fit_ms(plain),
        "DP step": lambda: step_ms(private_step, steps // 2),
        "DP fit": lambda: fit_ms(private),
    }
    times = {column: [] for column in columns}
    for _ in range(rounds):
        for column, run in columns.items():
            times[column].append(run())
    return {column: statistics.median(values) for column, values in times.items()}


def fit_arguments(doc, models):
    """The command line of this script and `fit_gap_probes.py`: `--only`
    zoo models (default `models`), `--steps` a fit and `--rounds`."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(throughput.ZOO), default=models)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args()


def main():
    args = fit_arguments(__doc__, MODELS)
    rows = {name: measure(name, args.steps, args.rounds) for name in args.only}
    columns = list(next(iter(rows.values())))
    print(f"ms a step, medians over {args.rounds} alternating rounds; fits of {args.steps} "
          "steps, their steady step (long_fit.timed_fit); compiled steps on the first "
          f"{args.steps // 2} batches in turn.")
    print()
    print("| model | " + " | ".join(columns) + " | fit less step (Keras / DP) |")
    print("|---" * (len(columns) + 2) + "|")
    for name, row in rows.items():
        extra = (f"{row['Keras fit'] - row['Keras step']:.2f} / "
                 f"{row['DP fit'] - row['DP step']:.2f}")
        print(f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + f" | {extra} |")


if __name__ == "__main__":
    main()
