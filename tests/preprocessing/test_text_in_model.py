"""Text the keras.io way (issue 54, Deliver 3): TextVectorization inside a DPModel.

Text in, prediction out: the vectorizer adapted privately trains on the
batched per-example path, and a crafted record's unique word is in no file
of the saved model (negative control: the same word is there when the
vectorizer was adapted with Keras's adapt and declared public).
"""

import os
import zipfile

import keras
import numpy as np
import pytest

import tfdp
from tfdp import preprocessing
from tfdp.per_example.preprocessing_layers import keeps_examples_independent

UNIQUE_WORD = "zyzzyva"


def reviews(n=300, seed=0):
    rng = np.random.default_rng(seed)
    words = np.array(["good", "great", "bad", "awful", "movie", "plot"])
    y = rng.integers(0, 2, n).astype("int32")
    texts = [" ".join(rng.choice(words[:2] if label else words[2:4], 2).tolist()
                      + rng.choice(words[4:], 2).tolist()) for label in y]
    texts[-1] += f" {UNIQUE_WORD}"  # one record's unique word
    return np.array(texts)[:, None], y


def text_model(vectorizer):
    inputs = keras.Input((1,), dtype="string")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(
        vectorizer(inputs)))
    model = tfdp.DPModel(inputs, keras.layers.Dense(2)(hidden))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.0,
                                                  seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def saved_bytes(model, folder):
    path = os.path.join(folder, "model.keras")
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        return b"".join(archive.read(name) for name in archive.namelist())


@pytest.mark.parametrize("how", ["private", "declared"])
def test_a_text_model_trains_and_a_private_vocabulary_keeps_no_unique_word(how, tmp_path):
    x, y = reviews()
    vectorizer = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=6)
    if how == "private":
        preprocessing.adapt_privately(vectorizer, x[:, 0], epsilon=1.0, delta=1e-6,
                                      max_tokens_per_record=5, seed=0)
    else:  # negative control: Keras's adapt on the same records, declared public
        vectorizer.adapt(x[:, 0])
        preprocessing.declare_public(vectorizer, source="(a wrong declaration)")
    model = text_model(vectorizer)
    assert model.per_example_path.startswith("per-example gradients: batched pass")
    history = model.fit(x, y, batch_size=50, epochs=1, verbose=0,
                        validation_data=reviews(20, seed=1))  # text validation data too
    assert model.privacy.steps > 0 and "val_loss" in history.history
    assert (UNIQUE_WORD.encode() in saved_bytes(model, tmp_path)) == (how == "declared")


def test_text_padded_to_the_batch_keeps_the_examples_dependent():
    assert keeps_examples_independent(keras.layers.TextVectorization(output_sequence_length=4))
    assert keeps_examples_independent(keras.layers.TextVectorization(output_mode="multi_hot"))
    assert not keeps_examples_independent(keras.layers.TextVectorization())
    assert keeps_examples_independent(keras.layers.StringLookup())


def test_text_into_a_model_that_reads_none_is_still_refused():
    inputs = keras.Input((1,))
    model = tfdp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = reviews(20)
    with pytest.raises(ValueError, match="TextVectorization or StringLookup layer in the model"):
        model.fit(x, y, batch_size=5, verbose=0)
