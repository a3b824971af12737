"""Sparse against dense embedding noise at the same epsilon, on a large vocabulary.

A text classifier (Embedding(V, d) -> mean pooling -> Dense(1)) on
generated data: tokens drawn from a Zipf law over V ids, the label says
whether a document holds more tokens of a "positive" set than of a
"negative" one (each a random half of the 400 most frequent ids). Both runs
use DPOptimizer(Adam) at the same noise multiplier z, batch and steps, so
the ledger charges the same epsilon (printed from each model's ledger); the
sparse run sets `sparse_embeddings={"tokens": SparseNoise(...)}`, whose
gradient noise is raised to (z^-2 - sigma_c^-2)^(-1/2) to pay for the row
selection. Reported: seconds per epoch after the first (compiled) epoch,
held-out accuracy, epsilon, and the mean share of rows a step updated.

    python benchmarks/sparse_embedding_noise.py [--vocab 50000 100000] [--epochs 4]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdp  # noqa: E402
from results import cpu_name  # noqa: E402  (benchmarks/ is on the path when run as a script)

LENGTH, DIM, TRAIN, TEST, BATCH = 32, 64, 20000, 5000, 1000
NOISE, SELECTION_NOISE, MAX_ROWS, THRESHOLD = 1.0, 4.0, 32, 60.0


def make_data(vocab, rng):
    """Zipf(1.1) token ids over `vocab` and a label from frequent tokens."""
    ranks = np.arange(1, vocab + 1)
    p = ranks ** -1.1
    p /= p.sum()
    x = rng.choice(vocab, size=(TRAIN + TEST, LENGTH), p=p).astype("int32")
    frequent = rng.permutation(400)
    positive, negative = np.isin(x, frequent[:200]), np.isin(x, frequent[200:])
    y = (positive.sum(1) > negative.sum(1)).astype("float32")
    return (x[:TRAIN], y[:TRAIN]), (x[TRAIN:], y[TRAIN:])


def model_for(vocab, sparse):
    inputs = keras.Input((LENGTH,), dtype="int32")
    rows = keras.layers.Embedding(vocab, DIM, name="tokens")(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(rows))
    model = tfdp.DPModel(inputs, outputs)
    settings = ({"tokens": tfdp.optimizers.SparseNoise(
        SELECTION_NOISE, threshold=THRESHOLD, max_rows_per_example=MAX_ROWS)} if sparse else None)
    optimizer = tfdp.optimizers.DPOptimizer(
        keras.optimizers.Adam(0.02), l2_norm_clip=1.0, noise_multiplier=NOISE, seed=0,
        sparse_embeddings=settings)
    model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy(threshold=0.0)])
    return model


def run(vocab, sparse, data, epochs):
    (x, y), (tx, ty) = data
    model = model_for(vocab, sparse)
    table = model.get_layer("tokens").embeddings
    times, updated = [], []
    for epoch in range(epochs):
        before = table.numpy()
        start = time.perf_counter()
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        times.append(time.perf_counter() - start)
        updated.append(np.mean(np.any(table.numpy() != before, axis=1)))
    accuracy = model.evaluate(tx, ty, verbose=0, return_dict=True)["binary_accuracy"]
    return {"s/epoch": min(times[1:]) if epochs > 1 else times[0], "accuracy": accuracy,
            "epsilon": model.privacy.epsilon(1e-5), "rows moved/epoch": np.mean(updated)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[50000, 100000])
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; {TRAIN} train / {TEST} test documents of {LENGTH} tokens, "
          f"Embedding dim {DIM}, batch {BATCH}, {args.epochs} epochs, z={NOISE}, "
          f"sparse: sigma_c={SELECTION_NOISE}, k={MAX_ROWS}, threshold={THRESHOLD}")
    header = f"{'vocab':>7} {'noise':>6} {'s/epoch':>8} {'speedup':>8} {'accuracy':>9} " \
             f"{'epsilon':>8} {'rows moved/epoch':>17}"
    print(header)
    for vocab in args.vocab:
        data = make_data(vocab, np.random.default_rng(vocab))
        dense = run(vocab, False, data, args.epochs)
        sparse = run(vocab, True, data, args.epochs)
        for name, row in (("dense", dense), ("sparse", sparse)):
            print(f"{vocab:>7} {name:>6} {row['s/epoch']:>8.2f} "
                  f"{dense['s/epoch'] / row['s/epoch']:>7.2f}x {row['accuracy']:>9.4f} "
                  f"{row['epsilon']:>8.3f} {row['rows moved/epoch']:>17.4f}")


if __name__ == "__main__":
    main()
