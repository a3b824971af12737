"""`sampler_coupling`: the real sampler and train step on D and D minus one unit.

`sensitivity_search` checks one step on batches that differ in one row. The
guarantee also needs the sampler to keep every OTHER unit's draws to
themselves: if removing one person re-ranks the others, or shifts the
records' groups, other people's records change between D and D' and the
update moves by more than one unit's clipped contribution. This mode runs
the samplers tfdp trains with (`tfdp.data.users.UserSampler`,
`tfdp.data.cyclic_poisson.CyclicPoissonSampler`, `PoissonSampler`, and the
fixed order of DP-BandMF) with coupled randomness:

1. D is the given records; D' is D without one unit (a person with all their
   records, or one record). Fixed order is charged under zero-out: in D'
   the unit's rows stay where they are with weight (mask) 0.
2. Both samplers are built with the same seed (so the same key) and the same
   sampling probability q; each step t draws a batch from each with
   `draw(key, t)` (the samplers' public API: "indices" into the records it
   was given, and "mask").
3. The model's real train step (noise 0, `NeighbourStep.update`) runs on
   each draw, divided by the same expected batch size b, and the report is
   ||update(D') - update(D)|| / (lr C / b) per step.

The rows of D' are laid out in the slots the same units hold in D's draw (a
sum does not depend on the order, but its rounding does), so a correct
sampler gives a ratio <= 1 up to float32 rounding, and a sampler whose draws
of other units move with the removal gives one above 1 as soon as the moved
units' gradients differ (the result also counts those units).

Each sampling (`UserSampling`, `PoissonSampling`, `CyclicPoissonSampling`,
`FixedOrderSampling`) builds its sampler from the ORIGINAL indices of the
records it samples (`records`) and their units' stable ids (`units`): a
sampler that keys each unit's randomness by a stable id gets it from there.

Cost: 2 x `steps` train steps on the sampler's padded batches, plus one
trace (or XLA compilation) per batch length.

Example (user-level DP: 40 people of 2 records, one record each a step):

>>> import keras, numpy as np, tfdp
>>> model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(1)])
>>> model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0), loss="mse")
>>> rng = np.random.default_rng(0)
>>> x, y = rng.normal(size=(80, 3)).astype("float32"), 10 * rng.normal(size=(80, 1)).astype("float32")
>>> people = UserSampling(np.arange(80) // 2, examples_per_user=1, expected_users=40)
>>> result = sampler_coupling(model, x, y, sampling=people, removed=39, steps=2)
>>> result.worst_ratio <= 1 + 1e-5, result.moved_units
(True, 0)
"""

import dataclasses
import math

import numpy as np
import tensorflow as tf

from tfdp.auditing.neighbour_step import NeighbourStep

__all__ = ["CouplingResult", "CyclicPoissonSampling", "FixedOrderSampling", "PoissonSampling",
           "UserSampling", "sampler_coupling"]


class UserSampling:
    """User-level sampling (`tfdp.data.users.UserSampler`): the unit is a person.

    Args:
        user_ids: one id per record (integers or strings), as for `fit`.
        examples_per_user: k, as for `fit`.
        expected_users: b, the expected people a step in D (q = b / U).
    """

    relation = "remove"

    def __init__(self, user_ids, examples_per_user, expected_users):
        self.user_ids = np.asarray(user_ids)
        self.examples_per_user = int(examples_per_user)
        self.expected_units = float(expected_users)

    def units(self, count):
        return self.user_ids

    def sampler(self, records, units, seed, q):
        """A sampler over `records` (original indices) with probability q."""
        from tfdp.data.users import UserRecords, UserSampler

        users = UserRecords(units)
        return UserSampler(users, self.examples_per_user, q * users.num_users, seed=seed)

    def describe(self):
        return (f"UserSampler, k={self.examples_per_user} records a person, "
                f"b={self.expected_units:g} people")


class PoissonSampling:
    """Record-level Poisson sampling (`tfdp.data.poisson.PoissonSampler`).

    Args:
        expected_batch_size: b in D (q = b / N).
    """

    relation = "remove"
    examples_per_user = None

    def __init__(self, expected_batch_size):
        self.expected_units = float(expected_batch_size)

    def units(self, count):
        return np.arange(count)

    def sampler(self, records, units, seed, q):
        from tfdp.data.poisson import PoissonSampler

        return PoissonSampler(len(records), q * len(records), seed=seed)

    def describe(self):
        return f"PoissonSampler, b={self.expected_units:g}"


class CyclicPoissonSampling(PoissonSampling):
    """DP-BandMF's amplified sampling (`tfdp.data.cyclic_poisson`): secret
    record groups, Poisson within the active group.

    Args:
        expected_batch_size: B in D (q = B bands / N within the group).
        bands: the number of groups.
        groups_seed: seeds the groups key (the same for D and D').
    """

    def __init__(self, expected_batch_size, bands, groups_seed=0):
        super().__init__(expected_batch_size)
        self.bands = int(bands)
        self.groups_seed = groups_seed

    def sampler(self, records, units, seed, q):
        from tfdp.data.cyclic_poisson import CyclicPoissonSampler
        from tfdp.data.sampling import sampling_key

        return CyclicPoissonSampler(len(records), q * len(records), self.bands,
                                    sampling_key(self.groups_seed), seed=seed)

    def describe(self):
        return f"CyclicPoissonSampler, {self.bands} bands, B={self.expected_units:g}"


class FixedOrderSampling:
    """DP-BandMF's fixed order: step t reads records t B .. t B + B - 1 of
    the data's order (cyclically), and D' zeroes one record out (mask 0).

    Args:
        batch_size: B.
    """

    relation = "zero out"
    examples_per_user = None

    def __init__(self, batch_size):
        self.expected_units = float(batch_size)

    def units(self, count):
        return np.arange(count)

    def draws(self, count, step):
        rows = (np.arange(int(self.expected_units)) + step * int(self.expected_units)) % count
        return rows, np.ones(len(rows), np.float32)

    def describe(self):
        return f"fixed order, B={self.expected_units:g}"


@dataclasses.dataclass(frozen=True)
class CouplingResult:
    """What `sampler_coupling` measured.

    Attributes:
        worst_ratio: the largest ||update(D') - update(D)|| / (lr C / b).
        ratios: that ratio at each step.
        moved_units: units other than the removed one whose drawn records
            differ between D and D' at some step (0 for a coupled sampler).
        removed: the removed (or zeroed-out) unit's id.
        sampling: the sampler, in words; relation: "remove" or "zero out".
    """

    worst_ratio: float
    ratios: tuple
    moved_units: int
    removed: object
    sampling: str
    relation: str

    def summary(self):
        verdict = "within the bound" if self.worst_ratio <= 1.0 + 1e-5 else "BOUND EXCEEDED"
        return (
            f"sampler coupling: worst ratio {self.worst_ratio:.9g} ({verdict}); {self.sampling}; "
            f"{self.relation} unit {self.removed!r}; {self.moved_units} other units' draws moved; "
            f"per step: {', '.join(f'{r:.6g}' for r in self.ratios)}"
        )

    def check(self, tolerance=1e-5):
        """Raises `SensitivityExceeded` if the worst ratio exceeds 1 + tolerance."""
        from tfdp.auditing.sensitivity import SensitivityExceeded

        if not self.worst_ratio <= 1.0 + tolerance:
            raise SensitivityExceeded(
                f"Removing one unit moved the DP update {self.worst_ratio:.6g} times the bound "
                f"(tolerance {tolerance:g}).\n{self.summary()}")


def sampler_coupling(model, x, y, sample_weight=None, *, sampling, removed=None, steps=2, seed=0,
                     physical_batch_size=None):
    """Runs the real sampler and train step on D and D minus one unit.

    See the module docstring.

    Args:
        model: a compiled, built `tfdp.DPModel` / `tfdp.DPSequential`. Only read.
        x, y, sample_weight: the records of D (arrays, one row a record).
        sampling: `UserSampling`, `PoissonSampling`, `CyclicPoissonSampling`
            or `FixedOrderSampling`.
        removed: the unit removed (zeroed out) in D': a user id, or a record
            index (default: the smallest id, which re-ranks every other unit).
        steps: steps drawn and compared.
        seed: the sampling seed shared by D and D'.
        physical_batch_size: as `fit`'s argument.

    Returns:
        `CouplingResult`; `.check()` raises if the bound broke.
    """
    from tfdp.auditing.sensitivity import _check_data, _check_model

    _check_model(model)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"Expected `steps` to be an int >= 1. Received: steps={steps!r}")
    data = _check_data(model, x, y, sample_weight, records=2)
    count = len(tf.nest.flatten(data)[0])
    units = np.asarray(sampling.units(count))
    if len(units) != count:
        raise ValueError(f"Expected one user id per record ({count}). Received: {len(units)} ids")
    removed = np.unique(units)[0] if removed is None else removed
    if not np.any(units == removed):
        raise ValueError(f"Expected `removed` to be one of the units. Received: removed={removed!r}")
    k = sampling.examples_per_user or 1
    b = sampling.expected_units
    step = NeighbourStep(model, data, records=min(count, 7), batch_size=b,
                         physical_batch_size=physical_batch_size,
                         examples_per_user=sampling.examples_per_user)
    rows = [tf.nest.map_structure(lambda a, i=i: np.asarray(a[i]), data) for i in range(count)]
    ratios, moved = [], set()
    with step:
        for t in range(steps):
            d_rows, d_mask, p_rows, p_mask = _draws(sampling, units, removed, count, b, seed, t)
            moved |= _moved(units, removed, d_rows, d_mask, p_rows, p_mask)
            if sampling.relation == "remove":
                d_rows, d_mask, p_rows, p_mask = _aligned(units, removed, k, d_rows, d_mask,
                                                          p_rows, p_mask)
            before = step.update([rows[i] for i in d_rows], d_mask)
            after = step.update([rows[i] for i in p_rows], p_mask)
            change = np.linalg.norm(after - before)
            ratios.append(float(change / step.bound) if np.isfinite(change) else math.inf)
    return CouplingResult(
        worst_ratio=max(ratios), ratios=tuple(ratios), moved_units=len(moved),
        removed=removed.item() if hasattr(removed, "item") else removed,
        sampling=sampling.describe(), relation=sampling.relation)


def _draws(sampling, units, removed, count, b, seed, t):
    """(rows, mask) of D and of D' at step t, rows as indices into D."""
    if sampling.relation == "zero out":
        rows, mask = sampling.draws(count, t)
        return rows, mask, rows, np.where(units[rows] == removed, 0.0, mask).astype(np.float32)
    everyone = np.arange(count)
    kept = np.flatnonzero(units != removed)
    q = b / len(np.unique(units))
    out = []
    for records in (everyone, kept):
        sampler = sampling.sampler(records, units[records], seed, q)
        draw = sampler.draw(sampler.key, t)
        out += [records[draw["indices"].numpy()], draw["mask"].numpy().astype(np.float32)]
    return tuple(out)


def _moved(units, removed, d_rows, d_mask, p_rows, p_mask):
    """Units other than `removed` whose drawn records differ between D and D'."""
    def drawn(rows, mask):
        picked = {}
        for row in rows[mask > 0]:
            picked.setdefault(units[row].item(), []).append(int(row))
        return {unit: sorted(r) for unit, r in picked.items()}

    before, after = drawn(d_rows, d_mask), drawn(p_rows, p_mask)
    removed = removed.item() if hasattr(removed, "item") else removed
    return {u for u in set(before) | set(after)
            if u != removed and before.get(u) != after.get(u)}


def _aligned(units, removed, k, d_rows, d_mask, p_rows, p_mask):
    """Both draws laid out alike: each unit's block of k rows in D' takes the
    slot it holds in D; the rest fill free slots; padding rows (mask 0) of
    both hold the same record, one that D' has."""
    filler = int(np.flatnonzero(units != removed)[0])
    blocks = lambda rows, mask: [(rows[i:i + k], mask[i]) for i in range(0, len(rows), k)]
    d_blocks, p_blocks = blocks(d_rows, d_mask), blocks(p_rows, p_mask)
    slots = {units[r[0]].item(): i for i, (r, m) in enumerate(d_blocks) if m > 0}
    length = max(len(d_blocks), len(p_blocks))
    placed, rest = {}, []
    for r, m in p_blocks:
        unit = units[r[0]].item()
        if m > 0 and unit in slots and slots[unit] not in placed:
            placed[slots[unit]] = r
        elif m > 0:
            rest.append(r)
    free = [i for i in range(length + len(rest)) if i not in placed]
    placed.update(zip(free, rest))
    length = max(length, max(placed, default=-1) + 1)
    pad = np.full(k, filler)
    d = [(r, 1.0) if m > 0 else (pad, 0.0) for r, m in d_blocks]
    d += [(pad, 0.0)] * (length - len(d))
    p = [(placed[i], 1.0) if i in placed else (pad, 0.0) for i in range(length)]
    flat = lambda pairs: (np.concatenate([r for r, _ in pairs]),
                          np.repeat(np.array([m for _, m in pairs], np.float32), k))
    return flat(d) + flat(p)
