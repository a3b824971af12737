"""Other save routes than DPModel.save/save_weights/export after a lookup is
re-adapted on the raw data post-fit (the state check at release).

DPModel.save refuses (control). keras.saving.save_model(model, path),
tf.saved_model.save and keras.export.ExportArchive do not call DPModel.save
or export: is the check bypassed, and is the canary in the written files?
Run: cd /work/wt/review-7 && PYTHONPATH=$PWD python _review/save_routes_after_readapt.py
"""
import glob, os, tempfile, zipfile
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras, numpy as np, tensorflow as tf
import tfdp

CANARY = 99950
ids = np.append(np.random.default_rng(0).integers(1, 10, 299), CANARY)


def model_after_readapt():
    lookup = keras.layers.IntegerLookup(name="lookup", output_mode="one_hot", max_tokens=12,
                                        pad_to_max_tokens=True)
    tfdp.preprocessing.adapt_privately(lookup, ids, epsilon=1.0, delta=1e-7, seed=0)
    inp = keras.Input((1,), dtype="int64")
    model = tfdp.DPModel(inp, keras.layers.Dense(2)(lookup(inp)))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(ids[:, None], ids % 2, batch_size=30, epochs=1, verbose=0)
    lookup.adapt(ids)                                   # raw adapt after fit
    assert CANARY in lookup.get_vocabulary()
    return model


NEEDLES = (str(CANARY).encode(), np.int64(CANARY).tobytes())


def holds(folder_or_file):
    paths = [folder_or_file] if os.path.isfile(folder_or_file) else \
        glob.glob(os.path.join(folder_or_file, "**"), recursive=True)
    for p in paths:
        if not os.path.isfile(p):
            continue
        blobs = [open(p, "rb").read()]
        if p.endswith(".keras"):
            with zipfile.ZipFile(p) as z:
                blobs += [z.read(n) for n in z.namelist()]
        if any(n in b for b in blobs for n in NEEDLES):
            return True
    return False


def attempt(name, write):
    tmp = tempfile.mkdtemp()
    try:
        path = write(model_after_readapt(), tmp)
        print(f"{name:32s} WRITTEN; canary in it: {holds(path)}")
    except Exception as e:  # noqa
        print(f"{name:32s} REFUSED {type(e).__name__}: {' '.join(str(e).split())[:150]}")


def dp_save(m, tmp):
    p = os.path.join(tmp, "m.keras"); m.save(p); return p


def keras_saving(m, tmp):
    p = os.path.join(tmp, "m.keras"); keras.saving.save_model(m, p); return p


def tf_saved_model(m, tmp):
    p = os.path.join(tmp, "sm"); tf.saved_model.save(m, p); return p


def export_archive(m, tmp):
    p = os.path.join(tmp, "ea")
    archive = keras.export.ExportArchive(); archive.track(m)
    archive.add_endpoint("serve", m.call, [tf.TensorSpec((None, 1), tf.int64)])
    archive.write_out(p); return p


if __name__ == "__main__":
    for name, fn in (("DPModel.save (control)", dp_save), ("keras.saving.save_model", keras_saving),
                     ("tf.saved_model.save", tf_saved_model),
                     ("keras.export.ExportArchive", export_archive)):
        attempt(name, fn)
