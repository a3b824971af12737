"""A composite adaptable layer's fingerprint covers only its DIRECT sublayers.

`_composite_state` fingerprints a layer with `adapt` by its weights and each
direct sublayer's `data_state`; `_data_layers` then skips every layer inside
it (recursively). A StringLookup two levels down (wrapper -> keras.Sequential
-> StringLookup) is in neither: after the wrapper is declared public (or fit
accepted it), the inner lookup is adapted again on the raw data, the model
trains, is saved, and its statement says covered; the crafted record's raw
token is in the saved file.
Run: cd /work/wt/review-7 && PYTHONPATH=$PWD python _review/composite_depth.py
"""
import os, tempfile, zipfile
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras, numpy as np
import tfdp

CANARY = "zqxjcanary"


class Featurizer(keras.layers.Layer):
    """A preprocessing block with an adapt() method, holding a small Sequential."""
    def __init__(self, **kw):
        super().__init__(**kw)
        self.block = keras.Sequential([keras.layers.StringLookup(
            output_mode="one_hot", max_tokens=8, pad_to_max_tokens=True, name="inner_lookup")],
            name="block")
    @property
    def lookup(self):
        return self.block.layers[0]
    def adapt(self, data):
        self.lookup.adapt(data)
    def call(self, x):
        return self.block(x)


feat = Featurizer(name="featurizer")
feat.adapt(np.array(["red", "green", "blue"]))                    # public colours
tfdp.preprocessing.declare_public(feat, source="the public colour list")
private = np.array(["red"] * 10 + ["green"] * 9 + [CANARY])
feat.lookup.adapt(private)                                         # raw adapt, after the declaration
inp = keras.Input((1,), dtype="string")
model = tfdp.DPModel(inp, keras.layers.Dense(2)(feat(inp)))
model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(private[:, None], np.arange(20) % 2, batch_size=10, epochs=1, verbose=0)
path = os.path.join(tempfile.mkdtemp(), "m.keras")
model.save(path)
with zipfile.ZipFile(path) as z:
    blob = b"".join(z.read(n) for n in z.namelist())
print(f"fit accepted, saved; canary in vocabulary: {CANARY in feat.lookup.get_vocabulary()}; "
      f"canary in saved file: {CANARY.encode() in blob}")
print("statement:", " ".join(model.privacy.statement(1e-5).split())[:260])
