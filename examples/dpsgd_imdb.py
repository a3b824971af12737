"""Private sentiment classification on IMDB: Embedding + LSTM (or a
bidirectional GRU) trained with DP-Adam, per-example gradients on the batched
path (tfdp's recurrent rule).

Reviews are the `keras.datasets.imdb` word ids (the `num_words` most
frequent words, others as the out-of-vocabulary id 2), cut to their last
`maxlen` words and zero-padded at the end; the zero padding is masked
(`mask_zero=True`), so a review's gradient ignores its padding. The noise is
calibrated so that the run spends `--epsilon` (delta = 1e-5, below 1/n).
Downloads IMDB on first use (about 17 MB).

    python examples/dpsgd_imdb.py                       # LSTM, epsilon 3
    python examples/dpsgd_imdb.py --bidirectional --epochs 2
    python examples/dpsgd_imdb.py --sample 5000 --epochs 1   # a quick look
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdp  # noqa: E402

OOV = 2  # keras.datasets.imdb's out-of-vocabulary id (0 pads, 1 starts a review)


def preprocess(reviews, labels, num_words, maxlen):
    """Reviews (lists of word ids) as int32 [n, maxlen] rows and labels [n].

    Ids at or above `num_words` become `OOV`; a review keeps its last
    `maxlen` ids and is zero-padded at the end (0 is the mask id).

    >>> x, y = preprocess([[1, 5, 99], [1, 7, 3, 4, 6]], [0, 1], num_words=50, maxlen=4)
    >>> x.tolist(), y.tolist()
    ([[1, 5, 2, 0], [7, 3, 4, 6]], [0, 1])
    """
    rows = [[i if i < num_words else OOV for i in review] for review in reviews]
    x = keras.utils.pad_sequences(rows, maxlen=maxlen, padding="post", truncating="pre", value=0)
    return x.astype("int32"), np.asarray(labels, dtype="int32")


def load_imdb(num_words=20000, maxlen=200, sample=None, loader=None, seed=0):
    """((x_train, y_train), (x_test, y_test)), preprocessed.

    Args:
        num_words, maxlen: see `preprocess`.
        sample: if given, keep this many random reviews of each split.
        loader: returns ((train reviews, labels), (test reviews, labels));
            default `keras.datasets.imdb.load_data` (downloads).
        seed: the sample's seed.
    """
    loader = loader or (lambda: keras.datasets.imdb.load_data(num_words=num_words))
    splits = []
    rng = np.random.default_rng(seed)
    for reviews, labels in loader():
        if sample is not None and sample < len(reviews):
            keep = rng.choice(len(reviews), sample, replace=False)
            reviews, labels = [reviews[i] for i in keep], np.asarray(labels)[keep]
        splits.append(preprocess(reviews, labels, num_words, maxlen))
    return tuple(splits)


def build_model(num_words, maxlen, bidirectional=False):
    """Embedding(num_words, 64, mask_zero) + LSTM(64) or Bidirectional(GRU(32)) + Dense(1)."""
    rnn = keras.layers.Bidirectional(keras.layers.GRU(32)) if bidirectional else keras.layers.LSTM(64)
    return tfdp.DPSequential([
        keras.Input((maxlen,), dtype="int32"),
        keras.layers.Embedding(num_words, 64, mask_zero=True),
        rnn,
        keras.layers.Dense(1),
    ])


def main(argv=None, loader=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--num-words", type=int, default=20000)
    parser.add_argument("--maxlen", type=int, default=200)
    parser.add_argument("--sample", type=int, default=None, help="reviews kept per split")
    parser.add_argument("--bidirectional", action="store_true", help="Bidirectional(GRU(32))")
    args = parser.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = load_imdb(
        args.num_words, args.maxlen, args.sample, loader
    )
    q = min(1.0, args.batch_size / len(x_train))
    steps = args.epochs * round(len(x_train) / args.batch_size)
    sigma = tfdp.accounting.calibrate_noise_multiplier(args.epsilon, args.delta, q, max(steps, 1))
    model = build_model(args.num_words, args.maxlen, args.bidirectional)
    model.compile(
        optimizer=tfdp.optimizers.DPOptimizer(
            keras.optimizers.Adam(0.005), l2_norm_clip=1.0, noise_multiplier=sigma
        ),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy")],
    )
    model.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2,
        callbacks=[tfdp.callbacks.PrivacyBudget(epsilon=args.epsilon, delta=args.delta)],
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(model.per_example_path)
    print(f"noise multiplier  {sigma:.4f}")
    print(f"test accuracy     {accuracy:.4f}")
    print(model.privacy.statement(args.delta))
    return model, accuracy


if __name__ == "__main__":
    main()
