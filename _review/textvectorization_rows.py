"""adapt_privately(TextVectorization, texts of shape (N, 2)) treats each TEXT as a unit.

`_record_tokens` reshapes TextVectorization data to (-1,), so a record of two
texts (a title and a body) is two units: it moves a shared token's count by 2
and brings 4 distinct tokens where k = 2 is accounted (L2 sqrt(6) vs sqrt(2)). Measured: the counts the selection sees for D and
D' = D plus one crafted record, and the lone-token pass probability.
Run: cd /work/wt/review-7 && PYTHONPATH=$PWD python _review/textvectorization_rows.py
"""
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras, numpy as np
from tfdp.preprocessing import adapt_privately, partition_selection as ps

seen = []
original = ps.select
def spy(counts, noise_std, threshold, rng):
    seen.append((dict(counts), noise_std, threshold))
    return original(counts, noise_std, threshold, rng)
ps.select = spy

base = [["common title", "common body"] for _ in range(300)]
crafted = ["common zqsecretone", "common zqsecrettwo"]
for name, data in (("D", base), ("D'", base + [crafted])):
    tv = keras.layers.TextVectorization(name="tv")
    adapt_privately(tv, np.array(data), epsilon=1.0, delta=1e-6, max_tokens_per_record=2, seed=0)
    counts, std, cut = seen[-1]
    print(f"{name}: {len(data)} records; count('common') = {counts.get('common')}; lone tokens of "
          f"the crafted record: {[t for t in counts if t.startswith('zq')]}; noise std {std:.3f}, "
          f"threshold {cut:.2f}")
d, d2 = seen[0][0], seen[1][0]
l2 = np.sqrt(sum((d2.get(t, 0) - d.get(t, 0)) ** 2 for t in set(d) | set(d2)))
lone = [t for t in d2 if t not in d]
print(f"one record moved the counts by L2 {l2:.3f}; accounted sensitivity sqrt(k) = {np.sqrt(2):.3f} "
      f"-> ratio {l2 / np.sqrt(2):.3f}; distinct tokens it added: {len(lone)} lone (threshold sized "
      f"for k = 2)")
