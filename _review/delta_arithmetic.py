"""Independent check of partition selection's accounting and the ledger's
composition with DP-SGD (eps_acc(delta - A) - log(1 - A)).

1. The threshold T against scipy: P(1 + N(0, s^2) > T) per token, and
   1 - (1 - p)^k against delta/2, by numerical integration of the law
   and by Monte Carlo of one lone unit with k tokens (fixed seed).
2. The ledger's epsilon for two private adaptations (A = sum of delta/2)
   and 3 DP-SGD steps, against dp_accounting's RDP and PLD accountants run
   here, composing the events directly (independent of tfdp's _engine).
3. A lone unit's tokens: probability that any of them passes, measured by
   simulation through tfdp's own partition_selection.select.
Run: cd /work/wt/review-7 && PYTHONPATH=$PWD python _review/delta_arithmetic.py
"""
import math, os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, dp_accounting, keras
from scipy import stats
import tfdp
from tfdp.preprocessing import partition_selection as ps, adapt_privately
from tfdp.accounting.calibration import calibrate_noise_multiplier

# 1. threshold
for s, k, d in [(2.0, 1, 1e-6), (5.3, 4, 5e-7), (11.0, 32, 1e-9)]:
    T = ps.threshold(s, k, d)
    p = stats.norm.sf(T - 1, scale=s)
    union = -math.expm1(k * math.log1p(-p))
    print(f"T(s={s}, k={k}, d={d:g}) = {T:.6f}: per-token p={p:.6e}; 1-(1-p)^k={union:.6e} "
          f"(target {d:g}; ratio {union / d:.9f})")

# 3. Monte Carlo of a lone unit (k tokens, each count 1) with inflated delta to see hits
rng = np.random.default_rng(0)
s, k, d = 1.0, 3, 0.05
T = ps.threshold(s, k, d)
trials = 20000
hits = sum(bool(ps.select({f"t{i}": 1 for i in range(k)}, s, T, rng)) for _ in range(trials))
se = math.sqrt(d * (1 - d) / trials)
print(f"Monte Carlo lone unit k={k}, delta_thr={d}: P(any passes) = {hits / trials:.4f} "
      f"(target {d}, 3 s.e. = {3 * se:.4f})")

# 2. ledger vs independent composition
ids = np.repeat(np.arange(20), 60)
l1 = keras.layers.IntegerLookup(name="a"); l2 = keras.layers.IntegerLookup(name="b")
EPS_A, DEL_A = 0.7, 1e-6
adapt_privately(l1, ids, epsilon=EPS_A, delta=DEL_A, seed=0)
adapt_privately(l2, ids, epsilon=EPS_A, delta=DEL_A, seed=1)
inp1 = keras.Input((1,), dtype="int64"); inp2 = keras.Input((1,), dtype="int64")
h = keras.layers.concatenate([keras.layers.Flatten()(keras.layers.Embedding(32, 2)(l1(inp1))),
                              keras.layers.Flatten()(keras.layers.Embedding(32, 2)(l2(inp2)))])
model = tfdp.DPModel([inp1, inp2], keras.layers.Dense(2)(h))
Z, B = 1.1, 60
model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=Z, seed=0),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit([ids[:, None], ids[:, None]], (ids % 2).astype("int32"), batch_size=B, epochs=1,
          steps_per_epoch=3, verbose=0)
steps = model.privacy.steps
q = B / len(ids)
A = 2 * (DEL_A / 2)
sig = calibrate_noise_multiplier(EPS_A + math.log1p(-DEL_A / 2), DEL_A / 2,
                                 sampling_probability=1.0, steps=1)
# check the calibration independently: Gaussian(sig) at delta/2 gives <= eps - shift
acc = dp_accounting.rdp.RdpAccountant(); acc.compose(dp_accounting.GaussianDpEvent(sig))
print(f"adaptation sigma {sig:.6f}: RDP eps at delta/2 = {acc.get_epsilon(DEL_A / 2):.6f} + "
      f"shift {-math.log1p(-DEL_A / 2):.2e} vs requested {EPS_A}")
for target in (1e-5, 1e-6 + 1e-7, 3e-6):
    event = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(Z)), steps),
        dp_accounting.GaussianDpEvent(sig), dp_accounting.GaussianDpEvent(sig)])
    rdp = dp_accounting.rdp.RdpAccountant(); rdp.compose(event)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4); pld.compose(event)
    ind_rdp = rdp.get_epsilon(target - A) - math.log1p(-A)
    ind_pld = pld.get_epsilon(target - A) - math.log1p(-A)
    led_rdp = model.privacy.epsilon(target)
    led_pld = model.privacy.epsilon(target, accountant="pld")
    print(f"delta={target:g}: ledger rdp {led_rdp:.8f} vs independent {ind_rdp:.8f}; "
          f"ledger pld {led_pld:.6f} vs independent {ind_pld:.6f}")
print("ledger at delta = A (all spent by thresholds):", model.privacy.epsilon(A))
