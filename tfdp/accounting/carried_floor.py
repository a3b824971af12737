"""A carried training never shrinks below what a model trained on.

A model whose layers trained on top of another model's weights
(`tfdp.models.weight_ledgers`) learned from those weights as they were: if
the other model later rolls back (`load_weights` of an earlier file), its
own ledger shrinks with its weights, but what the first model's weights
carry does not. `PrivacyLedger.hold_carried` freezes the carried releases
as a floor when a model trains; `at_least` then charges the floor, the
releases now carried, or, when they went separate ways (rolled back, then
trained again), both: every release that happened is charged.

Example:

>>> from tfdp.accounting import dpsgd_event
>>> step = dpsgd_event(1.0, 0.1)
>>> [count for _, count in at_least(((step, 3),), floor=((step, 9),))]  # rolled back
[9]
>>> [count for _, count in at_least(((step, 12),), floor=((step, 9),))]  # went on
[12]
"""


def _merged(parts):
    """`parts` as a list with adjacent releases of one event summed."""
    merged = []
    for event, count in parts:
        if merged and merged[-1][0] == event:
            merged[-1] = (event, merged[-1][1] + count)
        else:
            merged.append((event, count))
    return merged


def at_least(parts, floor):
    """The releases `parts` carries now, or more where they do not cover `floor`.

    Args:
        parts: (event, count) pairs: another training's releases as they are now.
        floor: (event, count) pairs: its releases when this model trained.

    Returns:
        `parts` itself when it extends `floor` (the other training went on);
        else `floor` followed by whatever `parts` released after the two
        went separate ways, as a tuple.
    """
    now, held = _merged(parts), _merged(floor)
    shared = 0
    while shared < min(len(now), len(held)) and now[shared] == held[shared]:
        shared += 1
    if shared == len(held):
        return parts
    rest = now[shared:]
    if rest and rest[0][0] == held[shared][0]:  # the same segment, run to different lengths
        if shared == len(held) - 1 and held[shared][1] <= rest[0][1]:
            return parts  # the floor's last segment ran on further
        event, count = rest[0]
        count -= min(count, held[shared][1])
        rest = ([(event, count)] if count else []) + rest[1:]
    return tuple(_merged(held + rest))
