"""A plain-language statement of a differential privacy guarantee.

Numbers in the statement are rounded up, never down: a statement must not
claim more privacy than the accountant proved.

Example:

>>> text = privacy_statement(2.9231, 1e-5, 14040)
>>> print(text.splitlines()[0])
This model was trained with (epsilon=2.93, delta=1e-05)-differential privacy at the record level, over 14040 private training steps.
"""

import decimal
import math

import dp_accounting

from tfdp.accounting._validation import check_int, check_real
from tfdp.accounting.joint_gaussian import joint_gaussians

DEFAULT_MECHANISM = "DP-SGD (Poisson-sampled Gaussian mechanism on clipped per-example gradients)"

_ACCOUNTANT_NAMES = {
    "rdp": "dp_accounting's RDP accountant",
    "pld": "dp_accounting's PLD (privacy loss distribution) accountant",
}


def _round_up(value, digits=3):
    """`value` (finite, >= 0) rounded up to `digits` significant digits, as text."""
    if value == 0:
        return "0"
    # The shortest repr reads back as the same float, so it is that number.
    exact = decimal.Decimal(repr(float(value)))
    quantum = decimal.Decimal(1).scaleb(exact.adjusted() - digits + 1)
    rounded = exact.quantize(quantum, rounding=decimal.ROUND_CEILING)
    if rounded.adjusted() > exact.adjusted():  # 9.9999 -> 10.0, not 10.00
        quantum = decimal.Decimal(1).scaleb(rounded.adjusted() - digits + 1)
        rounded = rounded.quantize(quantum, rounding=decimal.ROUND_CEILING)
    if decimal.Decimal("0.001") <= rounded < decimal.Decimal(10**6):
        return f"{rounded:f}"
    return f"{rounded:.{digits - 1}e}"


def _format_delta(delta):
    """`delta` to 3 significant digits, rounded up (1.2345e-05 -> 1.24e-05)."""
    text = f"{delta:.3g}"
    return text if float(text) >= delta else _round_up(delta)


_MEANINGS = {
    "add_or_remove": "adding or removing any one training record",
    "zero_out": (
        "replacing any one training record by one that contributes nothing to training "
        "(the zero-out relation: with a fixed data order the number and positions of "
        "the records are public, so the guarantee is about a record's content)"
    ),
    "add_or_remove_user": (
        "adding or removing any one person (user id) together with all of their training "
        "records (user-level differential privacy: each step samples people, and a "
        "person's contribution to a step is clipped as one unit, however many records "
        "they have: one with fewer than the k records a step takes contributes theirs "
        "repeated, one with more contributes k of them, and all get this same guarantee; "
        "the number of people is treated as public, as the number of records is in DP-SGD)"
    ),
}
_LEVELS = {"add_or_remove_user": "the user level"}
# The end of the "Not covered" sentence: what is public, and which groups the
# guarantee does not cover.
_NOT_COVERED_UNITS = {
    "add_or_remove": (
        "the training set's size N (treated as public: it sets the steps per epoch and "
        "the sampling probability q = batch_size / N), anything released outside tfdp, and "
        "groups of records: a person with k records gets roughly a k-fold weaker guarantee."
    ),
    "add_or_remove_user": (
        "the number of people U (treated as public: it sets the steps per epoch and the "
        "sampling probability q = batch_size / U), anything released outside tfdp, and "
        "groups of people: one person who holds several user ids is protected as a group "
        "of that many people (roughly a k-fold weaker guarantee for k ids)."
    ),
}


def privacy_statement(
    epsilon, delta, steps, mechanism_description=DEFAULT_MECHANISM, accountant=None,
    relation="add_or_remove", search=False, preprocessing=(),
):
    """A few plain-language sentences describing an (epsilon, delta) guarantee.

    Suitable for a model card: the guarantee, what it means, what it covers
    and what it does not cover.

    Args:
        epsilon: the epsilon the ledger reports, a number >= 0 (inf allowed).
        delta: the delta it was computed at, in [0, 1).
        steps: the number of private training steps, an integer >= 0.
        mechanism_description: what was released, in words.
        accountant: optional "rdp" or "pld", named in the statement.
        relation: the neighbouring relation the guarantee holds under:
            "add_or_remove" (default), "zero_out" (DP-BandMF in a fixed
            data order) or "add_or_remove_user" (user-level DP); see
            `PrivacyLedger.relation`.
        search: True when the ledger charges a private hyperparameter
            search that chose this model (`tfdp.tuning`): the statement
            then says the search is covered.
        preprocessing: the ledger's preprocessing provenance entries
            (`PrivacyLedger.preprocessing`): one "Preprocessing:" line names
            each layer's state and where it came from.

    Returns:
        The statement, one sentence group per line.

    Example:

    >>> print(privacy_statement(0.7242, 1e-5, 6000).splitlines()[2])
    Meaning: adding or removing any one training record changes the probability of any outcome of training by at most a factor e^epsilon = 2.07, except with probability at most delta = 1e-05.
    """
    epsilon = check_real("epsilon", epsilon, low=0.0, low_inclusive=True, allow_inf=True)
    delta = check_real("delta", delta, low=0.0, high=1.0, low_inclusive=True)
    steps = check_int("steps", steps, minimum=0)
    if not isinstance(mechanism_description, str):
        raise TypeError(
            "Expected `mechanism_description` to be a string. Received: "
            f"mechanism_description={mechanism_description!r}"
        )
    if relation not in _MEANINGS:
        raise ValueError(
            f"Expected `relation` in {tuple(_MEANINGS)}. Received: relation={relation!r}"
        )
    mechanism = f"Mechanism: {mechanism_description}."
    if math.isinf(epsilon):
        return (
            "This model has NO finite differential privacy guarantee: the ledger holds a "
            "release that is not differentially private, or the noise was too small for any "
            f"finite bound at this delta ({steps} private training steps).\n{mechanism}"
        )
    eps_text = _round_up(epsilon)
    try:
        factor = _round_up(math.exp(epsilon))
    except OverflowError:
        factor = "more than 1e300"
    lines = [
        f"This model was trained with (epsilon={eps_text}, delta={_format_delta(delta)})-"
        f"differential privacy at {_LEVELS.get(relation, 'the record level')}, over {steps} "
        "private training steps.",
        mechanism,
        f"Meaning: {_MEANINGS[relation]} changes the probability of "
        f"any outcome of training by at most a factor e^epsilon = {factor}, except with "
        f"probability at most delta = {_format_delta(delta)}.",
        "Covered: the trained weights and anything derived from them alone (predictions, "
        "exports, fine-tuning on other data), and every release recorded in the privacy "
        "ledger (the noisy gradients and any extra noisy statistics the mechanism released). "
        "A saved checkpoint carries the ledger of every step that ran before it was chosen: "
        "a file kept by ModelCheckpoint(save_best_only=True) is charged for every step up "
        "to its last comparison, not only those before its weights were saved.",
        "Noise: every Gaussian draw has the whole Gaussian tail (no truncation, which would "
        "add to delta); like every floating-point implementation, the analysis treats the "
        "noise as real-valued, so attacks on floating-point granularity (Mironov 2012) and "
        "timing are not covered.",
        "Not covered: hyperparameters tuned by looking at results on the private data, "
        "unless tuned by tfdp.tuning's private search (then this statement says so), "
        "training-set loss and metrics shown in the logs, decisions callbacks take from that "
        "logged loss or those metrics (ReduceLROnPlateau, EarlyStopping on the training loss: "
        "the learning rate and the stopping epoch they choose are not protected), "
        "validation data (validation_split or validation_data: the records held out get no "
        "protection at all, and neither do the validation metrics"
        + ("; a private search's validation split is covered: see Search" if search else "")
        + "), data-independent choices "
        "(model architecture, clipping norm, noise level, schedule), "
        + _NOT_COVERED_UNITS.get(relation, _NOT_COVERED_UNITS["add_or_remove"]),
    ]
    if search:
        lines.insert(4, _SEARCH_COVERED)
    if preprocessing:
        lines.insert(4, describe_preprocessing(preprocessing))
    if accountant is not None:
        name = _ACCOUNTANT_NAMES.get(accountant, str(accountant))
        lines.append(f"Epsilon was computed with {name}, an upper bound on the privacy loss.")
    return "\n".join(lines)


_SEARCH_COVERED = (
    "Search: this model was chosen by a private hyperparameter search (tfdp.tuning), and "
    "the guarantee covers the whole search: every trial's training, every trial's private "
    "score, the choice of the best, its hyperparameters and score, and the random number "
    "of trials, which is kept secret (the other trials' models and scores were discarded)."
)

def describe_preprocessing(entries):
    """The statement's line naming where each preprocessing layer's state came from.

    Example:

    >>> print(describe_preprocessing([dict(layer="lookup", what="vocabulary", kind="public",
    ...                                    source="the 2020 census codes", additive_delta=0.0)]))
    Preprocessing: vocabulary of 'lookup' from data declared public: the 2020 census codes. Data declared public is not covered by this guarantee.
    """
    pieces = []
    for entry in entries:
        if entry["kind"] == "public":
            pieces.append(
                f"{entry['what']} of {entry['layer']!r} from data declared public: "
                f"{entry['source']}")
        else:
            unit = (" per person (which protects each record too)"
                    if entry.get("unit") == "person" else "")
            pieces.append(
                f"{entry['what']} of {entry['layer']!r} adapted privately{unit} on the training "
                f"data ({entry['source']}; covered by this guarantee)")
    text = "Preprocessing: " + "; ".join(pieces) + "."
    if any(entry["kind"] == "public" for entry in entries):
        text += " Data declared public is not covered by this guarantee."
    return text


_TRIAL_COUNT_LAWS = {math.inf: "Poisson", 1.0: "geometric", 0.0: "logarithmic"}


def is_search(event):
    """Whether `event` charges a private hyperparameter search (repeat and select)."""
    return isinstance(event, dp_accounting.dp_event.RepeatAndSelectDpEvent)


def _describe_search(event):
    law = _TRIAL_COUNT_LAWS.get(event.shape, f"truncated negative binomial (shape {event.shape:.4g})")
    inner = event.event
    parts = (
        [(item.event, item.count) if isinstance(item, dp_accounting.SelfComposedDpEvent)
         else (item, 1) for item in inner.events]
        if isinstance(inner, dp_accounting.ComposedDpEvent) else [(inner, 1)]
    )
    score = ""
    last = parts[-1][0] if parts else None
    if len(parts) > 1 and parts[-1][1] == 1 and isinstance(last, dp_accounting.GaussianDpEvent):
        # The trial's noisy validation score (tfdp.tuning.scores): what picks the best.
        parts = parts[:-1]
        score = (f", and scored by a noisy validation score (Gaussian, noise multiplier "
                 f"{last.noise_multiplier:.4g}) that picks the best; that score is part of "
                 "this search, not a release of its own")
    return (
        f"a private hyperparameter search: the best of a random number of trials ({law} law, "
        f"mean {event.mean:.4g}), each trial trained with {describe_releases(parts)}{score}"
    )


def _describe_event(event):
    if is_search(event):
        return _describe_search(event)
    if isinstance(event, dp_accounting.PoissonSampledDpEvent) and isinstance(
        event.event, dp_accounting.GaussianDpEvent
    ):
        return (
            f"Poisson-sampled Gaussian (sampling probability {event.sampling_probability:.4g}, "
            f"noise multiplier {event.event.noise_multiplier:.4g})"
        )
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return f"Gaussian (noise multiplier {event.noise_multiplier:.4g})"
    joint = (joint_gaussians(event.event)
             if isinstance(event, dp_accounting.PoissonSampledDpEvent) else None)
    if joint is not None:  # tfdp.accounting.joint_gaussian: a sparse-embedding step
        rate = event.sampling_probability
        selections = ", ".join(f"{s:.4g}" for s in joint[1:])
        return (
            f"Poisson-sampled Gaussian (sampling probability {rate:.4g}) releasing the "
            f"gradient (noise multiplier {joint[0]:.4g}) and the sparse embeddings' row "
            f"selection counts (noise multiplier {selections}) of the same batch, "
            f"composed as one Gaussian of noise multiplier "
            f"{sum(s ** -2.0 for s in joint) ** -0.5:.4g}"
        )
    return type(event).__name__


def describe_releases(parts):
    """Short text for a list of (event, count) releases, for the statement.

    Example:

    >>> from tfdp.accounting.events import dpsgd_event
    >>> describe_releases([(dpsgd_event(1.3, 0.0025), 6000)])
    '6000 x Poisson-sampled Gaussian (sampling probability 0.0025, noise multiplier 1.3)'
    """
    if not parts:
        return "no private release yet"
    pieces = [f"{count} x {_describe_event(event)}" for event, count in parts[:3]]
    if len(parts) > 3:
        pieces.append(f"{len(parts) - 3} more segment(s) or release(s)")
    return "; ".join(pieces)
