"""State from the private data reaching the released model by routes other than adapt().

Each case builds a DPModel whose preprocessing holds a crafted record's raw
token (CANARY) and reports REFUSED (fit refuses, naming the layer) or
ACCEPTED + whether the canary is in the saved .keras file.
Run: cd /work/wt/review-7 && PYTHONPATH=$PWD python _review/provenance_routes.py [case ...]
"""
import os, sys, tempfile, zipfile
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras, numpy as np, tensorflow as tf
import tfdp

CANARY = "zqxjcanary"
TMP = tempfile.mkdtemp()
TEXTS = np.array(["the cat sat", "the dog ran", "a cat ran", f"the {CANARY} sat"] * 4 + ["a dog sat"] * 4)
LABELS = np.arange(20) % 2


def fit_and_save(model, x):
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, LABELS, batch_size=10, epochs=1, steps_per_epoch=1, verbose=0)
    path = os.path.join(TMP, f"m{len(os.listdir(TMP))}.keras")
    model.save(path)
    with zipfile.ZipFile(path) as z:
        blob = b"".join(z.read(n) for n in z.namelist())
    return f"canary in saved file: {CANARY.encode() in blob}; statement says covered: " \
           f"{'epsilon' in model.privacy.statement(1e-5)}"


def text_model(vectorize):
    inp = keras.Input((1,), dtype="string")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 4)(vectorize(inp)))
    return tfdp.DPModel(inp, keras.layers.Dense(2)(h))


def raw_vocabulary():
    return sorted({t for s in TEXTS for t in s.split()})


def case_vocabulary_file():
    path = os.path.join(TMP, "vocab.txt")
    open(path, "w").write("\n".join(raw_vocabulary()))
    tv = keras.layers.TextVectorization(vocabulary=path, output_sequence_length=4, name="tv")
    return fit_and_save(text_model(tv), TEXTS[:, None])


def case_stringlookup_vocab_tensor():
    inp = keras.Input((3,), dtype="string")
    lk = keras.layers.StringLookup(vocabulary=tf.constant(raw_vocabulary()), name="lk")
    h = keras.layers.Flatten()(keras.layers.Embedding(50, 4)(lk(inp)))
    x = np.array([s.split() + ["a"] * (3 - len(s.split())) for s in TEXTS])
    return fit_and_save(tfdp.DPModel(inp, keras.layers.Dense(2)(h)), x)


def case_tfidf_weights_set_after_declare():
    tv = keras.layers.TextVectorization(output_mode="tf_idf", name="tv")
    tv.set_vocabulary(["the", "cat", "dog"], idf_weights=[1.0, 1.0, 1.0])
    tfdp.preprocessing.declare_public(tv, source="a public list")
    tv.set_vocabulary(["the", "cat", "dog"], idf_weights=[0.1, 2.0, 3.0])  # from private counts
    inp = keras.Input((1,), dtype="string")
    return fit_and_save(tfdp.DPModel(inp, keras.layers.Dense(2)(tv(inp))), TEXTS[:, None])


def case_hashing_salt():
    inp = keras.Input((1,), dtype="string")
    hsh = keras.layers.Hashing(num_bins=8, salt=[4711, 99950], name="hash")   # salt = a record's id
    h = keras.layers.Flatten()(keras.layers.Embedding(8, 4)(hsh(inp)))
    out = fit_and_save(tfdp.DPModel(inp, keras.layers.Dense(2)(h)), TEXTS[:, None])
    return out + " (salt 99950 is in config: " + str("99950" in str(hsh.get_config())) + ")"


def _keras_hub_model(tokenizer):
    """The text input is also read by a declared-public StringLookup (fit refuses text
    that no TextVectorization or StringLookup reads)."""
    inp = keras.Input((), dtype="string")
    ids = tokenizer(inp)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(60, 4)(ids))
    lk = keras.layers.StringLookup(vocabulary=["a"], output_mode="one_hot", name="public_lk")
    tfdp.preprocessing.declare_public(lk, source="constant")
    h = keras.layers.concatenate([h, lk(keras.layers.Reshape((1,))(inp))])
    return tfdp.DPModel(inp, keras.layers.Dense(2)(h))


def case_keras_hub_bpe():
    import keras_hub
    words = raw_vocabulary()
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>"] + words)}
    tok = keras_hub.tokenizers.BytePairTokenizer(vocabulary=vocab, merges=[], sequence_length=4,
                                                 name="bpe")
    return fit_and_save(_keras_hub_model(tok), TEXTS)


def case_keras_hub_wordpiece():
    import keras_hub
    vocab = ["[PAD]", "[UNK]"] + raw_vocabulary()   # a vocabulary built from the private texts
    tok = keras_hub.tokenizers.WordPieceTokenizer(vocabulary=vocab, sequence_length=4, name="wp")
    return fit_and_save(_keras_hub_model(tok), TEXTS)


def case_textvectorization_two_texts_per_record():
    """adapt_privately on (N, 2) texts: units = texts, not records?"""
    tv = keras.layers.TextVectorization(name="tv2")
    pairs = np.array([["u%d title" % i, "u%d body" % i] for i in range(50)])
    # every record has a unique token 'u<i>' in BOTH texts: k=1 per record means at most
    # one count per record; count the units adapt_privately built
    from tfdp.preprocessing import private_adapt as pa
    records = pa._record_tokens(tv, pairs)
    return f"records seen by the selection: {len(records)} for {len(pairs)} records " \
           f"(a record contributes up to {len(records) // len(pairs)}k tokens)"


CASES = {k[5:]: v for k, v in globals().items() if k.startswith("case_")}

if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        try:
            print(f"{name:40s} ACCEPTED {CASES[name]()}")
        except Exception as e:  # noqa
            msg = " ".join(str(e).split())
            print(f"{name:40s} REFUSED  {type(e).__name__}: {msg[:220]}"
                  + ("  [CANARY IN MESSAGE]" if CANARY in msg else ""))
        sys.stdout.flush()
