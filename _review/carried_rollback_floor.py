"""Carried ledgers after a rollback of the carrying model: is B's epsilon a valid bound?

A trains 10 steps, saves (file at 10), trains 10 more (20). B is built on A's
encoder (shared variables) and trains 5 steps: B's head learned from A's
encoder after A's 20 steps. A then rolls back (load_weights of the file at
10) and trains 30 steps on the shared encoder (A's ledger: 40). B's weights
now depend on A's steps 1-20 (through B's head) AND A's 30 new steps
(through the shared encoder): 50 distinct A-steps, plus B's 5.
`carried_floor.at_least` sees parts (e, 40) against floor (e, 20), a single
segment "run on further", and charges 40.
Prints B's epsilon against an independent dp_accounting composition of
55 and of 45 steps.
Run: cd /work/wt/review-7 && PYTHONPATH=$PWD python _review/carried_rollback_floor.py
"""
import os, tempfile
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras, numpy as np, dp_accounting
import tfdp

DELTA, Z, B, N = 1e-5, 0.8, 64, 256
rng = np.random.default_rng(0)
X = rng.normal(size=(N, 4)).astype("float32"); Y = (X[:, 0] > 0).astype("int32")


def compile_(model):
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=Z),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit(model, steps):
    model.fit(X, Y, batch_size=B, epochs=1, steps_per_epoch=steps, verbose=0)


def independent(steps):
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(B / N, dp_accounting.GaussianDpEvent(Z)), steps)
    return acc.get_epsilon(DELTA)


tmp = tempfile.mkdtemp()
inp = keras.Input((4,))
enc = keras.layers.Dense(8, activation="tanh", name="enc")
a = compile_(tfdp.DPModel(inp, keras.layers.Dense(2, name="head_a")(enc(inp)), name="A"))
fit(a, 10); a.save_weights(os.path.join(tmp, "a10.weights.h5")); fit(a, 10)
inp_b = keras.Input((4,))
b = compile_(tfdp.DPModel(inp_b, keras.layers.Dense(2, name="head_b")(enc(inp_b)), name="B"))
fit(b, 5)
print(f"after B's fit: B eps {b.privacy.epsilon(DELTA):.4f} (independent 25 steps "
      f"{independent(25):.4f})")
a.load_weights(os.path.join(tmp, "a10.weights.h5"))
fit(a, 30)
print(f"A's ledger steps after rollback + 30: {a.privacy.steps}")
e = b.privacy.epsilon(DELTA)
print(f"B eps now {e:.4f}; independent: 55 steps {independent(55):.4f}, 45 steps "
      f"{independent(45):.4f}, 50 {independent(50):.4f}")
print(f"B understated: {e < independent(55) - 1e-6}")
print("statement:", " ".join(b.privacy.statement(DELTA).split())[-400:])
