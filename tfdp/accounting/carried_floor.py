"""A carried training never shrinks below what a model trained on.

A model whose layers trained on top of another model's weights
(`tfdp.models.weight_ledgers`) learned from those weights as they were: if
the other model later rolls back (`load_weights` of an earlier file), its
own ledger shrinks with its weights, but what the first model's weights
carry does not. `PrivacyLedger.hold_carried` freezes the carried releases
as a floor when a model trains; `at_least` then charges every release that
happened: those of the floor and those carried now.

Releases have an identity (`PrivacyLedger.own_history`): a piece of a
segment, named by the ledger's branch (which a ledger loaded from a file
starts anew as soon as it releases anything) and the step it starts at, or
a one-off record, named by its branch and index. A piece only ever grows
(a rollback starts a new branch, it never shortens an old one), so the
releases that happened are, per identity, the largest count seen. Comparing
(event, count) alone took a rolled-back branch run further ((event, 40)
against a floor of (event, 20), of which only 10 are shared) for "the same
segment went on", and charged 40 of the 50 releases.

Releases without an identity (given by hand, or saved by an earlier tfdp)
are compared by (event, count) among themselves, as before; the identified
ones are matched by identity, never by count, even when both sides hold
some of each (a charge like the one below, frozen as a floor: an earlier
file's releases followed by this version's branches). So a floor without
identities met by identified releases (an earlier tfdp's file carrying a
training that now runs in this version) is not matched to them (nor the
reverse): a rollback shared with that file would again look like "the same
segment ran on". Both are then charged (an over-charge, never an under-
charge), unless the releases are that floor exactly: one unbranched history
(loaded from that file, not trained since) with the floor's (event, count).
The reverse (an identified floor, releases without identity) is always
charged both: an earlier file's releases are not this version's floor.

Example:

>>> from tfdp.accounting import dpsgd_event
>>> step = dpsgd_event(1.0, 0.1)
>>> [count for _, count, _ in at_least(((step, 12, "a@0"),), floor=((step, 9, "a@0"),))]
[12]
>>> rolled_back = ((step, 5, "a@0"), (step, 30, "b@5"))  # back to step 5, then 30 steps
>>> [count for _, count, _ in at_least(rolled_back, floor=((step, 9, "a@0"),))]
[9, 30]
>>> [count for _, count, _ in at_least(((step, 3),), floor=((step, 9),))]  # no identity
[9]
>>> [count for _, count, _ in at_least(rolled_back, floor=((step, 9),))]  # cannot be matched
[5, 30, 9]
>>> mixed = ((step, 9), (step, 4, "c@9"))  # an earlier file's 9 steps, then branch c
>>> [count for _, count, _ in at_least(mixed, floor=((step, 9), (step, 6, "b@9")))]
[4, 6, 9]
"""


def tagged(parts):
    """`parts` as (event, count, identity) triples; pairs get identity None."""
    return tuple((item[0], item[1], item[2] if len(item) > 2 else None) for item in parts)


def at_least(parts, floor):
    """Every release of `floor` and of `parts`, each counted once.

    Args:
        parts: (event, count) pairs or (event, count, identity) triples:
            another training's releases as they are now.
        floor: the same: its releases when this model trained.

    Returns:
        (event, count, identity) triples, a tuple: the identified releases,
        each identity once at the largest count either holds (`parts`'
        order, then what only the floor holds), followed by the releases
        without identity (identity None), compared by (event, count):
        `parts`' when they extend `floor`'s, else `floor`'s followed by
        what `parts` released after the two went separate ways. Only the
        identified side when `parts` is one unbranched history equal to a
        floor that has no identities at all (never the reverse: a floor of
        this version is not the history an earlier file holds; review 10,
        I2).
    """
    now, held = tagged(parts), tagged(floor)
    named = _union(tuple(item for item in now if item[2] is not None),
                   tuple(item for item in held if item[2] is not None))
    if _one_history(now, held):  # the floor's training, loaded from its earlier file
        return named
    unnamed = _by_count(tuple(item for item in now if item[2] is None),
                        tuple(item for item in held if item[2] is None))
    return named + tuple((event, count, None) for event, count in unnamed)


def _one_history(named, unnamed):
    """Whether `named` is one unbranched identified history and `unnamed`
    the same (event, count)s without identities: the training a floor froze,
    loaded from that earlier file and not trained since."""
    return (all(item[2] is not None for item in named) and all(item[2] is None for item in unnamed)
            and len({_branch(identity) for _, _, identity in named}) == 1
            and _merged(named) == _merged(unnamed))


def _branch(identity):
    """The branch that names a release ("branch@step", "branch#index")."""
    return identity.replace("#", "@").split("@")[0]


def _union(now, held):
    counts = {}
    order = []
    for event, count, identity in now + held:
        key = (identity, _event_key(event))
        if key not in counts:
            order.append((key, event))
        counts[key] = max(counts.get(key, 0), count)
    return tuple((event, counts[key], key[0]) for key, event in order)


def _event_key(event):
    """A hashable stand-in for a DpEvent (an identity with another event is another release)."""
    return repr(event)


def _merged(parts):
    """(event, count) pairs of `parts`, adjacent releases of one event summed."""
    merged = []
    for event, count, _ in parts:
        if merged and merged[-1][0] == event:
            merged[-1] = (event, merged[-1][1] + count)
        else:
            merged.append((event, count))
    return merged


def _by_count(parts, floor):
    """`at_least` for releases without identity, by (event, count)."""
    now, held = _merged(parts), _merged(floor)
    shared = 0
    while shared < min(len(now), len(held)) and now[shared] == held[shared]:
        shared += 1
    if shared == len(held):
        return [(event, count) for event, count, _ in parts]
    rest = now[shared:]
    if rest and rest[0][0] == held[shared][0]:  # the same segment, run to different lengths
        if shared == len(held) - 1 and held[shared][1] <= rest[0][1]:
            return [(event, count) for event, count, _ in parts]  # the floor's last segment ran on
        event, count = rest[0]
        count -= min(count, held[shared][1])
        rest = ([(event, count)] if count else []) + rest[1:]
    return _merged(tuple((e, n, None) for e, n in held + rest))
