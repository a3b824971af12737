"""keras.io's two preprocessing recipes: private-adapted, public-adapted, non-private.

keras.io's "Structured data classification from scratch" puts
`Normalization`, `StringLookup` and `IntegerLookup` in the model, and its
"Text classification from scratch" a `TextVectorization`; both call
`adapt(train_data)`. No data set ships offline, so each recipe runs on a
small generated sample of the same shape (fixed seeds):

- table: age and hours per week (numbers), city (one of 40 strings, Zipf
  frequencies), occupation code (one of 30 ints); the label is a noisy
  logistic function of all four. 4,000 training rows, 2,000 test rows.
- text: sentences of 8 to 15 words from a 300-word vocabulary (Zipf
  frequencies): 20 positive and 20 negative words among them; the label is
  whether positive words outnumber negative ones. 4,000 training
  sentences, 2,000 test sentences.

Three runs per recipe, the same model and training settings:

- "private": every preprocessing layer adapted with
  `tfdp.preprocessing.adapt_privately` on the training data (epsilon 0.5,
  delta 1e-7 each), then DP-SGD (noise multiplier 1.5, momentum 0.9, clip 1.0, batch
  256, 15 epochs); epsilon is the ledger's, preprocessing included, at
  delta 1e-5.
- "public": the layers adapted with Keras's `adapt` on 1,000 other rows of
  the same generator (public data), declared with
  `tfdp.preprocessing.declare_public`, then the same DP-SGD.
- "non-private": plain Keras, `adapt` on the training data, Adam, 15 epochs.

Accuracy is on the test rows, read once per run after training.

    nice -n 10 python benchmarks/private_preprocessing.py
    # prints the table and writes benchmarks/results/private_preprocessing.md
"""

import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdp  # noqa: E402

RESULT = pathlib.Path(__file__).parent / "results" / "private_preprocessing.md"
ADAPT = dict(epsilon=0.5, delta=1e-7, seed=0)
EPOCHS, BATCH, DELTA = 15, 256, 1e-5
CITIES = np.array([f"city_{i}" for i in range(40)])


def zipf_choice(rng, n, size, exponent=1.1):
    weights = 1.0 / np.arange(1, n + 1) ** exponent
    return rng.choice(n, size=size, p=weights / weights.sum())


def table(n, seed):
    rng = np.random.default_rng(seed)
    age = rng.uniform(18, 90, n)
    hours = np.clip(rng.normal(40, 10, n), 0, 100)
    city = zipf_choice(rng, 40, n)
    code = rng.integers(100, 130, n)
    effects = np.random.default_rng(99)  # the same law for every sample
    city_effect, code_effect = effects.normal(0, 1, 40), effects.normal(0, 1, 30)
    logit = 0.05 * (age - 50) + 0.08 * (hours - 40) + city_effect[city] + code_effect[code - 100]
    y = (logit + rng.logistic(size=n) > 0).astype("int32")
    x = {"age": age[:, None], "hours": hours[:, None], "city": CITIES[city][:, None],
         "code": code[:, None]}
    return x, y


def text(n, seed):
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(300)])
    positive, negative = set(range(0, 40, 2)), set(range(1, 40, 2))
    sentences, labels = [], []
    for _ in range(n):
        ids = zipf_choice(rng, 300, rng.integers(8, 16), exponent=0.8)
        score = sum(i in positive for i in ids) - sum(i in negative for i in ids)
        sentences.append(" ".join(words[ids]))
        labels.append(int(score > 0 or (score == 0 and rng.random() < 0.5)))
    return np.array(sentences)[:, None], np.array(labels, "int32")


def table_layers():
    return {"age": keras.layers.Normalization(name="age_norm"),
            "hours": keras.layers.Normalization(name="hours_norm"),
            "city": keras.layers.StringLookup(output_mode="one_hot", name="city_lookup"),
            "code": keras.layers.IntegerLookup(output_mode="one_hot", name="code_lookup")}


def table_model(layers, cls):
    inputs = {"age": keras.Input((1,), name="age"), "hours": keras.Input((1,), name="hours"),
              "city": keras.Input((1,), dtype="string", name="city"),
              "code": keras.Input((1,), dtype="int64", name="code")}
    features = keras.layers.concatenate([layers[k](inputs[k]) for k in inputs])
    hidden = keras.layers.Dense(32, activation="relu")(features)
    return cls(inputs, keras.layers.Dense(2)(hidden))


def text_layers():
    return {"text": keras.layers.TextVectorization(max_tokens=300, output_sequence_length=16,
                                                   name="vectorizer")}


def text_model(layers, cls):
    inputs = keras.Input((1,), dtype="string")
    hidden = keras.layers.Embedding(300, 16)(layers["text"](inputs))
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    return cls(inputs, keras.layers.Dense(2)(hidden))


RECIPES = {
    "structured data (Normalization, StringLookup, IntegerLookup)": (
        table, table_layers, table_model,
        {"age": dict(value_range=(0, 100)), "hours": dict(value_range=(0, 100)),
         "city": {}, "code": {}}),
    "text (TextVectorization)": (
        text, text_layers, text_model, {"text": dict(max_tokens_per_record=12)}),
}


def adapt(layers, x, how, options):
    for key, layer in layers.items():
        data = x[key] if isinstance(x, dict) else x[:, 0]
        if key in ("city", "code"):
            data = data[:, 0]
        if how == "private":
            tfdp.preprocessing.adapt_privately(layer, data, **ADAPT, **options[key])
        else:
            layer.adapt(data)
            if how == "public":
                tfdp.preprocessing.declare_public(layer, source="1,000 rows of public data")


def tensors(x):
    """Keras's own fit and evaluate take text as tf.string tensors, not NumPy text."""
    return keras.tree.map_structure(
        lambda a: tf.constant(a.astype(str)) if a.dtype.kind in "US" else a, x)


def run(recipe, how):
    generate, make_layers, make_model, options = RECIPES[recipe]
    keras.utils.set_random_seed(0)
    (x, y), (x_test, y_test) = generate(4000, 0), generate(2000, 1)
    layers = make_layers()
    adapt(layers, generate(1000, 2)[0] if how == "public" else x, how, options)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if how == "non-private":
        model = make_model(layers, keras.Model)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, metrics=["accuracy"])
        model.fit(tensors(x), y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
        epsilon = "none"
    else:
        model = make_model(layers, tfdp.DPModel)
        model.compile(optimizer=tfdp.optimizers.DPSGD(
            0.5, momentum=0.9, l2_norm_clip=1.0, noise_multiplier=1.5, seed=0),
            loss=loss, metrics=["accuracy"])
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
        epsilon = f"{model.privacy.epsilon(DELTA):.2f}"
    accuracy = model.evaluate(tensors(x_test), y_test, verbose=0, return_dict=True)["accuracy"]
    return f"| {recipe} | {how} | {epsilon} | {100 * accuracy:.1f}% |"


def main():
    lines = ["| recipe | preprocessing | epsilon (delta 1e-5) | test accuracy |",
             "|---|---|---|---|"]
    for recipe in RECIPES:
        for how in ("private", "public", "non-private"):
            lines.append(run(recipe, how))
            print(lines[-1], file=sys.stderr, flush=True)
    text_out = "\n".join(lines) + "\n"
    print(text_out)
    RESULT.write_text(text_out)


if __name__ == "__main__":
    main()
