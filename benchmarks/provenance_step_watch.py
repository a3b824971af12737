"""What fit's per-step provenance watch costs (issue 52, open finding 3).

Before every step `tfdp.preprocessing.provenance.ProvenanceWatch` reads the
run-time state of the model's adaptable layers (`run_time_state.token`: the
variables a step reads, the lookup tables held) and compares it with the
last checked one; only a change runs the full provenance check, whose
fingerprint of a 20,000-word vocabulary is what a check per step would cost
instead. Prints one Markdown table, milliseconds, the best of `--repeats`
runs of `--steps` calls each (the machine's load shows in the worst).

    python benchmarks/provenance_step_watch.py
"""

import argparse
import time

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tfdp.preprocessing import provenance, run_time_state


def models():
    text = tf.constant([" ".join(f"w{j}" for j in range(20000))])
    for mode in ("int", "tf_idf"):
        vectorize = keras.layers.TextVectorization(
            max_tokens=20002, output_mode=mode,
            **({"output_sequence_length": 16} if mode == "int" else {}))
        vectorize.adapt(text)
        inputs = keras.Input((1,), dtype="string")
        yield f"TextVectorization, 20k vocabulary, {mode}", tfdp.DPModel(
            inputs, keras.layers.Dense(2)(vectorize(inputs)))
    normalization = keras.layers.Normalization()
    normalization.adapt(np.random.default_rng(0).random((100, 8)).astype("float32"))
    inputs = keras.Input((8,))
    yield "Normalization, 8 features", tfdp.DPModel(
        inputs, keras.layers.Dense(2)(normalization(inputs)))


def best_ms(function, steps, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            function()
        times.append((time.perf_counter() - start) / steps * 1e3)
    return min(times), max(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| model | watch per step, best (worst) ms | full check, best ms |")
    print("|---|---|---|")
    for name, model in models():
        extra, layers = provenance.step_layers(model)
        checked = run_time_state.token(layers)
        watch = best_ms(lambda: run_time_state.same(checked, run_time_state.token(layers)),
                        args.steps, args.repeats)
        full = best_ms(lambda: provenance.check_released(model, extra), 5, 2)
        print(f"| {name} | {watch[0]:.3f} ({watch[1]:.3f}) | {full[0]:.1f} |")


if __name__ == "__main__":
    main()
