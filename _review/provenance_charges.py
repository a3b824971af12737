"""Is a private adaptation's charge kept when the layer changes hands?

1. adapt_privately(eps=3) then declare_public on the same layer (same state):
   the model's epsilon must still include the adaptation.
2. A (privately adapted lookup, eps=3) saved and loaded; B built on the loaded
   lookup only (fresh embedding and head): B's epsilon must include it.
3. The same lookup object (A, in memory, charged) reused in B: B charges it.
Each line prints the model's epsilon and an independent composition with
and without the adaptation.
Run: cd /work/wt/review-7 && PYTHONPATH=$PWD python _review/provenance_charges.py
"""
import math, os, tempfile
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras, numpy as np, dp_accounting
import tfdp
from tfdp.accounting.calibration import calibrate_noise_multiplier

DELTA, Z, B = 1e-5, 1.0, 60
EPS_A, DEL_A = 3.0, 1e-7
ids = np.repeat(np.arange(1, 21), 30)


def model_on(lookup, name):
    inp = keras.Input((1,), dtype="int64")
    h = keras.layers.Flatten()(keras.layers.Embedding(32, 2)(lookup(inp)))
    m = tfdp.DPModel(inp, keras.layers.Dense(2)(h), name=name)
    m.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=Z),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def fit(m, steps=3):
    m.fit(ids[:, None], ids % 2, batch_size=B, epochs=1, steps_per_epoch=steps, verbose=0)
    return m


def independent(steps, adaptations):
    q = B / len(ids)
    sig = calibrate_noise_multiplier(EPS_A + math.log1p(-DEL_A / 2), DEL_A / 2,
                                     sampling_probability=1.0, steps=1)
    ev = [dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(Z)), steps)]
    ev += [dp_accounting.GaussianDpEvent(sig)] * adaptations
    acc = dp_accounting.rdp.RdpAccountant(); acc.compose(dp_accounting.ComposedDpEvent(ev))
    a = adaptations * DEL_A / 2
    return acc.get_epsilon(DELTA - a) - math.log1p(-a)


def adapted():
    lk = keras.layers.IntegerLookup(name="item")
    tfdp.preprocessing.adapt_privately(lk, ids, epsilon=EPS_A, delta=DEL_A, seed=0)
    return lk


lk = adapted()
tfdp.preprocessing.declare_public(lk, source="(a lie)")
m = fit(model_on(lk, "declared"))
print(f"1. declared after private: eps {m.privacy.epsilon(DELTA):.4f}; independent with "
      f"adaptation {independent(3, 1):.4f}, without {independent(3, 0):.4f}")

tmp = tempfile.mkdtemp()
a = fit(model_on(adapted(), "A")); path = os.path.join(tmp, "a.keras"); a.save(path)
loaded = tfdp.load_model(path)
b = fit(model_on(loaded.get_layer("item"), "B"))
print(f"2. B on loaded A's lookup: eps {b.privacy.epsilon(DELTA):.4f}; independent A+B steps + "
      f"adaptation {independent(6, 1):.4f}, B + adaptation {independent(3, 1):.4f}, B alone "
      f"{independent(3, 0):.4f}")

lk = adapted(); a = fit(model_on(lk, "A2")); b = fit(model_on(lk, "B2"))
print(f"3. B on A's in-memory lookup: eps {b.privacy.epsilon(DELTA):.4f}; B + adaptation "
      f"{independent(3, 1):.4f}, B alone {independent(3, 0):.4f}")
