"""Re-adapting a privately adapted lookup on the raw data in the middle of an
epoch, and restoring the private vocabulary before the epoch ends.

`ProvenanceWatch` checks the vocabulary at each epoch's start, `save` and the
statement check it again; a callback that re-adapts at on_train_batch_begin
and restores at on_train_batch_end is seen by none of them. The steps in
between look the data up in a vocabulary built from every record without
noise: the indices of OTHER records depend on the crafted one, so one record
moves the trained (released) weights by many times the clipped-sum bound.

Relation: replacement of one record (same N, same Poisson draws), bound
2 * lr * C / b per step. Noise: same seed on both sides (the draws cancel).
Prints ||w(D) - w(D')|| / (2 lr C / b) with and without the callback, and
what the statement says.
Run: cd /work/wt/review-7 && PYTHONPATH=$PWD python _review/readapt_mid_epoch.py
"""
import os, tempfile
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras, numpy as np
import tfdp
from tfdp import preprocessing

LR, C, B = 1.0, 1.0, 64
CANARY = 1000


def dataset(canary_id):
    common = np.repeat(np.arange(100, 110), 3)          # 10 ids x 3 records
    singles = np.arange(1, 34)                           # 33 unique ids (1 record each)
    ids = np.concatenate([[canary_id], common, singles]).astype("int64")
    return ids[:, None], (ids % 2).astype("int32")


class ReadaptOnRaw(keras.callbacks.Callback):
    def __init__(self, lookup, raw):
        super().__init__()
        self.lookup, self.raw = lookup, raw
    def on_train_batch_begin(self, batch, logs=None):
        self.private = self.lookup.get_vocabulary(include_special_tokens=False)
        self.lookup.adapt(self.raw)                       # Keras's plain adapt, no noise
    def on_train_batch_end(self, batch, logs=None):
        self.lookup.set_vocabulary(self.private)          # back to the private state


def run(canary_id, attack, tmp):
    x, y = dataset(canary_id)
    keras.utils.set_random_seed(0)
    lookup = keras.layers.IntegerLookup(name="item")
    # private vocabulary: adapted from public-ish data is irrelevant here; adapt privately
    # on the same data (the common ids pass, singletons do not)
    preprocessing.adapt_privately(lookup, np.repeat(np.arange(100, 110), 200), epsilon=1.0,
                                  delta=1e-6, seed=0)
    inp = keras.Input((1,), dtype="int64")
    emb = keras.layers.Embedding(64, 4, embeddings_initializer="zeros", name="emb")(lookup(inp))
    out = keras.layers.Dense(2, name="head")(keras.layers.Flatten()(emb))
    model = tfdp.DPModel(inp, out)
    model.compile(optimizer=tfdp.optimizers.DPSGD(LR, l2_norm_clip=C, noise_multiplier=1.0,
                                                  seed=3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cbs = [ReadaptOnRaw(lookup, x[:, 0])] if attack else []
    model.fit(x, y, batch_size=B, epochs=1, steps_per_epoch=1, verbose=0, callbacks=cbs)
    path = os.path.join(tmp, f"m_{canary_id}_{attack}.keras")
    model.save(path)                                      # the re-check at save passes
    statement = model.privacy.statement(1e-5)
    return np.concatenate([w.ravel() for w in model.get_weights()]).astype(np.float64), statement


if __name__ == "__main__":
    tmp = tempfile.mkdtemp()
    for attack in (False, True):
        w1, st = run(CANARY, attack, tmp)
        w2, _ = run(0, attack, tmp)   # the record replaced by id 0 (also a singleton)
        ratio = np.linalg.norm(w1 - w2) / (2 * LR * C / B)
        print(f"re-adapt mid-epoch={attack}: ratio ||w(D)-w(D')|| / (2 lr C/b) = {ratio:.4f}; "
              f"saved and stated: {'epsilon' in st}")
    print("statement:", " ".join(st.split())[:300])
