"""`PrivacyLedger`: every private release of a training run, as DpEvents.

The ledger is tfdp's single source of truth for epsilon. Mechanisms describe
what each training step releases (`begin_steps`) and any one-off release
(`record`); the ledger composes them with dp_accounting's accountants and
answers epsilon, delta and "how many more steps fit in the budget".

Releases are kept as segments: from `begin_steps(event)` on, every step
releases `event`, until the next `begin_steps` with a different event closes
the segment. Steps are counted by the model (a `step_counter`) or by
`advance`. Steps that run while no event is declared are refused, never
silently left out of epsilon.

A segment can also count participations in rounds instead of steps
(`begin_steps(event, steps_per_round=P)`): its n steps release
`SelfComposedDpEvent(event, ceil(n / P))`. DP-BandMF uses it
(`tfdp.accounting.bandmf`): with correlated noise over b <= P steps and each
record in at most one step of every P, a record's n steps hold at most
ceil(n / P) participations, each one `event`. Such a segment also names the
neighbouring relation its guarantee holds under ("zero_out" for a fixed data
order); the statement then says which one.

Example:

>>> from tfdp.accounting import PrivacyLedger, dpsgd_event
>>> ledger = PrivacyLedger()
>>> ledger.begin_steps(dpsgd_event(noise_multiplier=1.3, sampling_probability=150 / 60000))
>>> ledger.advance(6000)                    # 15 epochs of 60,000 examples
>>> round(ledger.epsilon(delta=1e-5), 4)
0.7242
>>> ledger.steps_within_budget(epsilon=1.0, delta=1e-5)
5610
>>> restored = PrivacyLedger.from_json(ledger.to_json())
>>> restored.epsilon(delta=1e-5) == ledger.epsilon(delta=1e-5)
True
"""

import collections
import json
import math
import uuid

import dp_accounting

from tfdp.accounting import _engine, additive_delta, integrity
from tfdp.accounting._validation import check_choice, check_delta, check_int, check_real, show
from tfdp.accounting.carried_floor import at_least, tagged
from tfdp.accounting.events import event_from_dict, event_to_dict
from tfdp.accounting.statement import describe_releases, is_search, privacy_statement

_FORMAT = "tfdp.PrivacyLedger"
# Version 2 adds a segment's "steps_per_round" and "relation"; a ledger that
# uses neither is written as version 1, as before, and both are read.
_VERSION = 1
_ROUNDS_VERSION = 2
# Version 3 adds "preprocessing" (the provenance of preprocessing state,
# `tfdp.preprocessing`) and "carried" (releases of other models' training
# that this model's weights carry, `carry`); written only when there are
# some, so a tfdp that cannot read them refuses the file instead of
# dropping them.
_EXTENDED_VERSION = 3
_PREPROCESSING_KEYS = ("id", "layer", "state", "kind", "what", "source", "unit", "additive_delta")
# A per-person adaptation's grouping of records into people (a digest), optional.
_PREPROCESSING_OPTIONAL = ("partition",)
_PREPROCESSING_KINDS = ("private", "public")
_CACHE_SIZE = 256

RELATIONS = ("add_or_remove", "zero_out", "add_or_remove_user")
# Segments of one ledger must all protect records, or all protect users.
_USER_RELATION = "add_or_remove_user"


class Counting(collections.namedtuple("Counting", ["steps_per_round", "relation"])):
    """How a segment counts releases: ceil(steps / steps_per_round) of its
    event, a guarantee under `relation`. Steps (1, "add_or_remove") is the
    default: one release per step."""

    __slots__ = ()

    def releases(self, steps):
        """How many releases of the event `steps` steps of the segment make."""
        return -(-steps // self.steps_per_round)

    @property
    def is_default(self):
        return self == PER_STEP


PER_STEP = Counting(1, "add_or_remove")


def _check_counting(steps_per_round, relation):
    steps_per_round = check_int("steps_per_round", steps_per_round, minimum=1)
    check_choice("relation", relation, RELATIONS)
    return Counting(steps_per_round, relation)


def _check_event(event, name="event"):
    """Refuses anything that is not a serializable dp_accounting event."""
    if not isinstance(event, dp_accounting.DpEvent):
        raise TypeError(
            f"Expected `{name}` to be a dp_accounting DpEvent. Received: {name}={show(event)} "
            f"(of type {type(event).__name__})"
        )
    event_to_dict(event)  # the ledger must be savable: fail now, not at save time
    return event


def _check_accountant(accountant, conversion="tight"):
    check_choice("accountant", accountant, _engine.ACCOUNTANTS)
    check_choice("conversion", conversion, _engine.CONVERSIONS)
    if conversion == "classic" and accountant != "rdp":
        raise ValueError(
            "The classic conversion converts RDP, so it needs accountant='rdp'. "
            f"Received: accountant={accountant!r}, conversion='classic'"
        )


class PrivacyLedger:
    """Composes a training run's private releases; answers privacy questions.

    Args:
        step_counter: optional zero-argument callable returning the number of
            private training steps run so far (tfdp's models pass a reader of
            a variable the compiled train step increments). If None, the
            ledger keeps its own count, advanced with `advance(n)`.

    Example:

    >>> from tfdp.accounting import dpsgd_event
    >>> ledger = PrivacyLedger()
    >>> ledger.begin_steps(dpsgd_event(1.1, 256 / 60000))
    >>> ledger.advance(1000)
    >>> ledger.record(dp_accounting.GaussianDpEvent(100.0))  # e.g. a noisy dataset size
    >>> ledger
    PrivacyLedger(steps=1000, segments=1, records=1)
    """

    def __init__(self, step_counter=None):
        if step_counter is not None and not callable(step_counter):
            raise TypeError(
                "Expected `step_counter` to be a zero-argument callable or None. "
                f"Received: step_counter={show(step_counter)}"
            )
        self._step_counter = step_counter
        self._own_steps = 0
        self._segments = []  # closed segments: (event, start, end, Counting), contiguous from 0
        self._open = None  # (event, start, Counting), start == end of the last closed segment
        self._records = []  # one-off releases: (event, count)
        self._preprocessing = []  # provenance of preprocessing state: dicts (_PREPROCESSING_KEYS)
        self._carried = {}  # source id -> Carried: another training these weights carry
        self._floors = {}  # source id -> tagged parts: what it carried when this model trained
        # The branches of this ledger's history, (id, first step, first record index):
        # a ledger loaded from a file starts a new one (`_resumed`) once it releases
        # anything, so the releases of a rolled-back run and of the discarded one
        # have different identities (`own_history`).
        self._lineage = [(_new_id(), 0, 0)]
        self._resumed = None
        self._version = 0  # bumped on every change other than the step count
        # Called before a statement: its model refuses state changed since its
        # provenance and charges the adaptations it holds.
        self.before_statement = None
        self._high_water = 0  # the largest step count seen: counters never go back
        self._cache = {}

    # -- steps ---------------------------------------------------------------

    @property
    def steps(self):
        """The number of private training steps run so far (an int)."""
        if self._step_counter is None:
            return self._own_steps
        value = self._step_counter()
        try:
            return check_int("step_counter()", value, minimum=0)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"The ledger's step_counter must return an integer >= 0: {error}"
            ) from None

    def advance(self, n=1):
        """Counts `n` more steps of the open event.

        Only for a ledger without a `step_counter` (with one, the counter is
        the truth and this raises).

        Args:
            n: an integer >= 0.

        Raises:
            ValueError: if the ledger has a step counter, if `n` is negative,
                or if no step event is open (call `begin_steps` first).
        """
        if self._step_counter is not None:
            raise ValueError(
                "This ledger reads its steps from its `step_counter`; advance() is only "
                "for a ledger created without one."
            )
        n = check_int("n", n, minimum=0)
        if n and self._open is None:
            raise ValueError(
                "No step event is open: call begin_steps(event) before counting steps, "
                f"so that every step is accounted. Received: n={n}"
            )
        self._own_steps += n

    def _unaccounted_error(self, now):
        return ValueError(
            f"The step counter reads {now}, but no step event was ever declared: those "
            "private steps would be missing from epsilon. Call begin_steps(event) before "
            "running private steps (or restore the ledger saved with these weights)."
        )

    def _check_counter(self, now):
        if self._open is None:
            if now > 0:
                raise self._unaccounted_error(now)
        elif now < self._high_water:
            raise ValueError(
                f"The step counter went backwards: it reads {now}, but this ledger has "
                f"already counted {self._high_water} steps. Releases are never un-counted; "
                "to resume from an earlier checkpoint, restore its saved ledger."
            )
        self._high_water = now

    # -- recording -----------------------------------------------------------

    def begin_steps(self, event, steps_per_round=1, relation="add_or_remove",
                    new_segment=False):
        """From the current step on, every step releases `event`.

        Closes the open segment (its count is the steps run since it began).
        Calling it with an event and counting equal to the open one's does
        nothing, unless `new_segment`.

        Args:
            event: a `dp_accounting.DpEvent`, e.g. `dpsgd_event(sigma, q)`.
            steps_per_round: P, an int >= 1: the segment's n steps release
                `SelfComposedDpEvent(event, ceil(n / P))` (default 1: one
                release per step). Only for a mechanism whose analysis
                bounds a record's participations in any n consecutive steps
                of the segment by ceil(n / P), each one `event`
                (`tfdp.accounting.bandmf`).
            relation: the neighbouring relation the segment's guarantee holds
                under: "add_or_remove" (default) or "zero_out" (a record
                replaced by one that contributes nothing).
            new_segment: close the open segment even if it is equal, so that
                the rounds of the two are counted apart (a DP-BandMF noise
                stream that starts afresh).

        Raises:
            TypeError: if `event` is not a DpEvent.
            ValueError: if steps ran before any event was declared, the step
                counter went backwards, or an argument is out of range.

        Example:

        >>> ledger = PrivacyLedger()
        >>> ledger.begin_steps(dp_accounting.GaussianDpEvent(2.0), steps_per_round=10,
        ...                    relation="zero_out")
        >>> ledger.advance(25)                  # 25 steps: 3 participations
        >>> ledger.composed_event().events[0].count
        3
        """
        _check_event(event)
        counting = _check_counting(steps_per_round, relation)
        now = self.steps
        self._check_counter(now)
        carried = [c.label for c in self._carried.values()
                   if (c.relation == _USER_RELATION) != (relation == _USER_RELATION)]
        if carried:
            raise ValueError(
                f"This model's weights carry the training of {', '.join(carried)}, at the "
                f"{'record' if relation == _USER_RELATION else 'user'} level, and these steps "
                "are at the other level: one guarantee does not bound the other, so the two "
                "cannot be composed. Train fresh layers instead of the ones it trained, or "
                f"train at the same level. Received: relation={relation!r}"
            )
        if any((other == _USER_RELATION) != (relation == _USER_RELATION)
               for other in self._relations(now)):
            raise ValueError(
                "A ledger's steps must all be user-level or all record-level: a record-level "
                "guarantee does not protect a person with several records, and a user-level "
                "one is not charged per record. Received: relation="
                f"{relation!r} after steps under {self.relation!r}"
            )
        if self._open is not None:
            open_event, start, open_counting = self._open
            if open_event == event and open_counting == counting and not new_segment:
                return
            if now > start:
                self._segments.append((open_event, start, now, open_counting))
        self._open = (event, now, counting)
        self._version += 1

    def record(self, event, count=1):
        """Records `count` one-off releases of `event` not tied to steps.

        For example the noisy dataset size DPIS releases once.

        Args:
            event: a `dp_accounting.DpEvent`.
            count: how many times it was released, an integer >= 1.
        """
        _check_event(event)
        count = check_int("count", count, minimum=1)
        self._records.append((event, count))
        self._version += 1

    def charge_preprocessing(self, entry, event=None):
        """Records where a preprocessing layer's state came from (once per entry id).

        `tfdp.preprocessing` calls it when `fit` first meets a layer whose
        state was adapted privately (`event` is the adaptation's Gaussian
        release, recorded like `record(event)`, and `entry["additive_delta"]`
        its threshold's failure probability, accounted as
        `tfdp.accounting.additive_delta` derives) or declared public (no
        event, no delta). The statement names every entry.

        Args:
            entry: a dict with the keys "id", "layer", "state", "kind"
                ("private" or "public"), "what", "source", "unit" ("record"
                or "person" for a private adaptation, "" for public data)
                (strings) and "additive_delta" (a number in [0, 1)).
            event: the adaptation's `dp_accounting.DpEvent`, or None.

        Returns:
            True if charged now, False if an entry with this id was already
            charged (a second fit, or a model saved and loaded).

        Example:

        >>> ledger = PrivacyLedger()
        >>> entry = dict(id="a1", layer="lookup", state="0f", kind="public",
        ...              what="vocabulary", source="a public word list", unit="",
        ...              additive_delta=0.0)
        >>> ledger.charge_preprocessing(entry), ledger.charge_preprocessing(entry)
        (True, False)
        """
        entry = _check_preprocessing(entry, "entry")
        if event is not None:
            _check_event(event)
        if entry["kind"] == "public" and (event is not None or entry["additive_delta"]):
            raise ValueError(
                "State declared public releases nothing private: it takes no event and no "
                f"additive delta. Received: entry={show(entry)}, event={show(event)}"
            )
        if any(item["id"] == entry["id"] for item in self._preprocessing):
            return False
        self._preprocessing.append(entry)
        if event is not None:
            self._records.append((event, 1))
        self._version += 1
        return True

    @property
    def preprocessing(self):
        """The provenance entries of preprocessing state, as a tuple of dicts
        (see `charge_preprocessing`)."""
        return tuple(dict(item) for item in self._preprocessing)

    def _additive_delta(self):
        """A: the summed failure probability of the preprocessing thresholds,
        this ledger's and those of the trainings its weights carry."""
        return math.fsum([self.own_additive_delta()]
                         + [c.additive_delta for c in self._carried.values()])

    def own_additive_delta(self):
        """This ledger's own thresholds' failure probability, without the
        carried ones: what another model that holds these weights carries."""
        return math.fsum(item["additive_delta"] for item in self._preprocessing)

    def _epsilon_of(self, parts, delta, accountant="rdp", conversion="tight"):
        """Epsilon of `parts` (this ledger's releases and any planned ones)
        with this ledger's thresholds' delta (for calibrations)."""
        return additive_delta.epsilon_with(parts, delta, self._additive_delta(), accountant,
                                           conversion)

    def carry(self, source_id, label, parts, relation="add_or_remove", additive_delta=0.0):
        """Charges releases that this model's weights carry from another
        training (`tfdp.models.weight_ledgers`): weights that another
        model's DP steps trained, held or trained on here.

        Carried releases compose with this ledger's own (a valid bound
        whatever data each training read) and are named in the statement.
        Carrying the same `source_id` again replaces its releases (the
        other training's ledger as it is now), so nothing is counted twice.

        Args:
            source_id: a string naming the other training.
            label: how the statement names it, e.g. "model 'encoder'".
            parts: its releases, a sequence of (DpEvent, count >= 1).
            relation: the neighbouring relation its guarantee holds under
                (see `relation`).
            additive_delta: its preprocessing thresholds' failure
                probability (`own_additive_delta`), added to this ledger's.

        Raises:
            ValueError: if the other training is user-level and this
                ledger's record-level, or the reverse (one guarantee does
                not bound the other), or a part is malformed.

        Example:

        >>> from tfdp.accounting import dpsgd_event
        >>> ledger = PrivacyLedger()
        >>> ledger.carry("a", "model 'a'", [(dpsgd_event(1.0, 0.01), 100)])
        >>> round(ledger.epsilon(1e-5), 4) > 0, len(ledger.own_parts())
        (True, 0)
        """
        if not isinstance(source_id, str) or not isinstance(label, str):
            raise TypeError(
                "Expected `source_id` and `label` to be strings. Received: "
                f"source_id={show(source_id)}, label={show(label)}"
            )
        check_choice("relation", relation, RELATIONS)
        additive_delta = check_real("additive_delta", additive_delta, low=0.0, high=1.0,
                                    low_inclusive=True)
        parts = tuple((_check_event(event, "parts"), check_int("count", count, minimum=1),
                       _check_identity(identity))
                      for event, count, identity in tagged(parts))
        if any((other == _USER_RELATION) != (relation == _USER_RELATION)
               for other in self._relations(self.steps, without=source_id)):
            raise ValueError(
                f"These weights carry the training of {label}, "
                f"{'user-level' if relation == _USER_RELATION else 'record-level'}, and this "
                "model's training is the other level: one guarantee does not bound the other, "
                "so the two cannot be composed. Train fresh layers instead of the ones "
                f"{label} trained, or train at the same level. Received: relation={relation!r}"
            )
        parts = at_least(parts, self._floors.get(source_id, ()))
        carried = Carried(label, tuple((event, count) for event, count, _ in parts), relation,
                          additive_delta, tuple(identity for _, _, identity in parts))
        if self._carried.get(source_id) != carried:
            self._carried[source_id] = carried
            self._version += 1

    def hold_carried(self):
        """Freezes what this ledger carries as a floor (`carried_floor`):
        called when its model trains on the carried weights, so a later
        rollback of the model that trained them does not lower this charge.
        A saved ledger keeps it (a loaded ledger's carried releases are floors).

        Example:

        >>> from tfdp.accounting import dpsgd_event
        >>> ledger = PrivacyLedger()
        >>> ledger.carry("a", "model 'a'", [(dpsgd_event(1.0, 0.01), 100)])
        >>> ledger.hold_carried()
        >>> ledger.carry("a", "model 'a'", [(dpsgd_event(1.0, 0.01), 10)])  # 'a' rolled back
        >>> ledger.carried["a"].parts[0][1]
        100
        """
        self._floors = {key: c.history for key, c in self._carried.items()}

    @property
    def floors(self):
        """{source id: (event, count, identity) triples}: what each carried
        training released when this ledger's model trained on it
        (`hold_carried`); never charged less."""
        return dict(self._floors)

    @property
    def carried(self):
        """{source id: Carried(label, parts, relation)}: the other trainings
        these weights carry (`carry`), charged with this ledger's own."""
        return dict(self._carried)

    def own_parts(self):
        """This ledger's own releases as (event, count) pairs, without the
        carried ones: what another model that holds these weights carries."""
        parts = self._parts(self.steps)
        return parts[:len(parts) - self._carried_count()]

    def own_history(self):
        """This ledger's own releases with their identity, as (event, count,
        identity) triples (`tfdp.accounting.carried_floor`): what another
        model that trains on these weights holds as its floor.

        A segment is cut where a branch of the history begins (a ledger
        loaded from a file that released more since), each piece named
        "branch@first step"; a one-off record is "branch#index". The counts
        sum to `own_parts`' (a rounds segment cut in two may count one round
        more: never fewer).
        """
        now = self.steps
        self._check_counter(now)
        branches = self._branches(now)
        ends = [start for _, start, _ in branches[1:]] + [math.inf]
        history = []

        def pieces(event, start, end, counting):
            for (branch, first, _), last in zip(branches, ends):
                low, high = max(start, first), min(end, last)
                if high > low:
                    history.append((event, counting.releases(high - low), f"{branch}@{low}"))

        for event, start, end, counting in self._segments:
            pieces(event, start, end, counting)
        for index, (event, count) in enumerate(self._records):
            branch = [name for name, _, first in branches if first <= index][-1]
            history.append((event, count, f"{branch}#{index}"))
        if self._open is not None:
            event, start, counting = self._open
            pieces(event, start, now, counting)
        return history

    def _branches(self, now):
        """The lineage, with the branch a load began once it released anything."""
        if self._resumed is not None:
            _, steps, records = self._resumed
            if now > steps or len(self._records) > records:
                return self._lineage + [self._resumed]
        return list(self._lineage)

    def _carried_count(self):
        return sum(len(c.parts) for c in self._carried.values())

    def _relations(self, now, without=None):
        """The relations of the segments that ran and of the carried trainings."""
        spans = [c.relation for _, start, end, c in self._spans(now) if end > start]
        return spans + [c.relation for key, c in self._carried.items() if key != without]

    def charge_selection(self, event, earlier=()):
        """Replaces every release so far by `event`, one release that covers them.

        For a model chosen by a private hyperparameter search
        (`tfdp.tuning`): its steps and score are one trial of the search,
        and `event` (a `RepeatAndSelectDpEvent` over the trial's releases)
        charges the whole search. The steps so far become one closed
        segment that releases `event` once (`steps_per_round` = its steps);
        the open step event stays open, so further training is charged on
        top. `earlier` are the events of earlier searches of the same
        tuner, kept as one-off records (a rerun pays again).

        Args:
            event: a `dp_accounting.DpEvent` whose guarantee covers every
                release this ledger holds.
            earlier: optional DpEvents recorded once each beside it.

        Raises:
            ValueError: if no step ran yet (there is nothing a search chose).

        Example:

        >>> from tfdp.accounting import dpsgd_event
        >>> from tfdp.accounting.search import repeat_and_select_event
        >>> ledger = PrivacyLedger()
        >>> ledger.begin_steps(dpsgd_event(1.1, 0.01))
        >>> ledger.advance(100)
        >>> search = repeat_and_select_event(ledger.composed_event(), 5, "geometric")
        >>> ledger.charge_selection(search)
        >>> ledger.composed_event().events == [dp_accounting.SelfComposedDpEvent(search, 1)]
        True
        """
        _check_event(event)
        earlier = [_check_event(item, "earlier") for item in earlier]
        now = self.steps
        self._check_counter(now)
        if self._open is None or now == 0:
            raise ValueError(
                "A search's charge replaces the releases of the chosen trial's steps, but "
                f"this ledger has run no step. Received: steps={now}"
            )
        open_event, _, open_counting = self._open
        relation = self.relation
        self._segments = [(event, 0, now, Counting(now, relation))]
        self._records = [(item, 1) for item in earlier]
        self._open = (open_event, now, open_counting)
        self._lineage, self._resumed = [(_new_id(), 0, 0)], None  # a new history
        self._version += 1

    # -- composition ---------------------------------------------------------

    def _parts(self, now, extra_steps=0):
        """(event, count) for every release, in composed_event's order."""
        self._check_counter(now)
        parts = [
            (event, counting.releases(end - start))
            for event, start, end, counting in self._segments
        ]
        parts += list(self._records)
        if self._open is not None:
            event, start, counting = self._open
            count = counting.releases(now - start + extra_steps)
            if count > 0:
                parts.append((event, count))
        elif extra_steps:
            raise ValueError(
                "No step event is open, so there is no step to project: call "
                f"begin_steps(event) first. Received: extra_steps={extra_steps}"
            )
        for carried in self._carried.values():  # last: own_parts cuts them off
            parts += list(carried.parts)
        return parts

    def composed_event(self):
        """Everything released so far, as one dp_accounting event.

        Returns:
            `ComposedDpEvent` of `SelfComposedDpEvent(event, count)` for every
            closed segment, the one-off records, then the open segment up to
            `steps` (count: the segment's steps, or its rounds for a segment
            begun with `steps_per_round`). Zero counts are skipped; with no
            release the list is empty.
        """
        now = self.steps
        self._check_counter(now)
        events = [
            dp_accounting.SelfComposedDpEvent(event, counting.releases(end - start))
            for event, start, end, counting in self._segments
        ]
        events += [
            event if count == 1 else dp_accounting.SelfComposedDpEvent(event, count)
            for event, count in self._records
        ]
        if self._open is not None and now > self._open[1]:
            event, start, counting = self._open
            events.append(dp_accounting.SelfComposedDpEvent(event, counting.releases(now - start)))
        events += [dp_accounting.SelfComposedDpEvent(event, count)
                   for carried in self._carried.values() for event, count in carried.parts]
        return dp_accounting.ComposedDpEvent(events)

    @property
    def open_segment(self):
        """The open segment as (event, start step, steps_per_round,
        relation), or None before any `begin_steps`."""
        if self._open is None:
            return None
        event, start, counting = self._open
        return event, start, counting.steps_per_round, counting.relation

    @property
    def relation(self):
        """The neighbouring relation every epsilon of this ledger holds under.

        "add_or_remove" (adding or removing one record), "add_or_remove_user"
        (adding or removing one person with all their records: user-level
        DP, `fit(user_ids=...)`; a ledger's steps are all user-level or none
        are), or "zero_out" when a segment with
        steps ran under "zero_out" (one record replaced by one that
        contributes nothing: DP-BandMF in a fixed data order). Add-or-remove
        guarantees of the other segments imply zero-out ones (a record that
        contributes nothing is as good as absent), so the ledger's epsilon
        then holds under "zero_out" for the whole run.
        """
        relations = self._relations(self.steps)
        for relation in ("zero_out", _USER_RELATION):
            if relation in relations:
                return relation
        return "add_or_remove"

    def _spans(self, now):
        """(event, start, end, counting) of every segment, the open one ending `now`."""
        spans = list(self._segments)
        if self._open is not None:
            spans.append((self._open[0], self._open[1], now, self._open[2]))
        return spans

    def _spent_parts(self):
        """The releases so far as (event, count) pairs (for calibration)."""
        return self._parts(self.steps)

    # -- questions -----------------------------------------------------------

    def _cached(self, key, compute):
        if key not in self._cache:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = compute()
        return self._cache[key]

    def epsilon(self, delta, accountant="rdp", conversion="tight", extra_steps=0):
        """Epsilon spent at `delta`: a valid upper bound for every release.

        Cached: asking again with an unchanged ledger costs nothing.

        Args:
            delta: target delta in (0, 1).
            accountant: "rdp" (dp_accounting's RdpAccountant, the default,
                tensorflow-privacy's accountant) or "pld" (privacy loss
                distributions; usually tighter, slower).
            conversion: "tight" (dp_accounting's RDP to (epsilon, delta)
                conversion, the default) or "classic" (min over integer orders
                2..64 of RDP + log(1/delta)/(order - 1), as in the papers; only
                for reproducing them; needs accountant="rdp").
            extra_steps: also count this many more steps of the open event
                ("what if I train k more steps"), an integer >= 0.

        Returns:
            Epsilon as a float; 0.0 before any release; inf if a release is
            not private.

        Example:

        >>> from tfdp.accounting import dpsgd_event
        >>> ledger = PrivacyLedger()
        >>> ledger.epsilon(1e-5)
        0.0
        >>> ledger.begin_steps(dpsgd_event(1.0, 0.01))
        >>> ledger.epsilon(1e-5, extra_steps=1000) > ledger.epsilon(1e-5)
        True
        """
        delta = check_delta(delta)
        _check_accountant(accountant, conversion)
        extra_steps = check_int("extra_steps", extra_steps, minimum=0)
        now = self.steps
        self._check_counter(now)  # before the cache: a counter that went back is an error
        key = ("epsilon", self._version, now, delta, accountant, conversion, extra_steps)
        return self._cached(
            key,
            lambda: additive_delta.epsilon_with(
                self._parts(now, extra_steps), delta, self._additive_delta(), accountant,
                conversion),
        )

    def delta(self, epsilon, accountant="rdp"):
        """Smallest delta for which the releases so far are (epsilon, delta)-DP.

        Args:
            epsilon: a finite number >= 0.
            accountant: "rdp" or "pld".

        Returns:
            Delta as a float in [0, 1]; 0.0 before any release.
        """
        epsilon = check_real("epsilon", epsilon, low=0.0, low_inclusive=True)
        _check_accountant(accountant)
        now = self.steps
        self._check_counter(now)
        key = ("delta", self._version, now, epsilon, accountant)
        return self._cached(key, lambda: additive_delta.delta_with(
            self._parts(now), epsilon, self._additive_delta(), accountant))

    def steps_within_budget(self, epsilon, delta, accountant="rdp", max_steps=10**7):
        """How many more steps of the open event fit in (epsilon, delta).

        Exponential search then bisection, so O(log k) accountant calls. The
        answer never overshoots: `self.epsilon(delta, extra_steps=k) <= epsilon`
        always holds, and (below `max_steps`) k + 1 more steps exceed it.
        With accountant="pld" the search starts from the (cheap) RDP answer;
        settings PLD cannot evaluate (more than 10^6 releases in total, or
        noise below 1e-3) count as over budget.

        Args:
            epsilon: the budget, a finite number >= 0.
            delta: target delta in (0, 1).
            accountant: "rdp" or "pld".
            max_steps: the largest answer, an integer >= 0.

        Returns:
            The largest k in [0, max_steps] with epsilon after k more steps
            <= `epsilon`; 0 if the budget is already spent.

        Raises:
            ValueError: if no step event is open (call `begin_steps` first).

        Example:

        >>> from tfdp.accounting import dpsgd_event
        >>> ledger = PrivacyLedger()
        >>> ledger.begin_steps(dpsgd_event(1.1, 0.01))
        >>> k = ledger.steps_within_budget(epsilon=2.0, delta=1e-5)
        >>> ledger.epsilon(1e-5, extra_steps=k) <= 2.0 < ledger.epsilon(1e-5, extra_steps=k + 1)
        True
        """
        budget = check_real("epsilon", epsilon, low=0.0, low_inclusive=True)
        delta = check_delta(delta)
        _check_accountant(accountant)
        max_steps = check_int("max_steps", max_steps, minimum=0)
        if self._open is None:
            raise ValueError(
                "No step event is open, so there is no step to project: call "
                "begin_steps(event) before asking for the steps within a budget."
            )

        def fits(k):
            try:
                return self.epsilon(delta, accountant, extra_steps=k) <= budget
            except _engine.PLDUnavailable:
                return False  # epsilon beyond what PLD can represent: over budget

        if not fits(0):
            return 0
        guess = None
        if accountant == "pld":
            # The RDP answer (cheap) is usually close below the PLD one: search
            # around it. Every answer is still checked with PLD itself.
            try:
                guess = self.steps_within_budget(budget, delta, "rdp", max_steps)
            except ValueError:
                guess = None
        return _largest_fitting(fits, max_steps, guess)

    def statement(self, delta, accountant="rdp"):
        """A plain-language privacy statement for the releases so far.

        Args:
            delta: target delta in (0, 1).
            accountant: "rdp" or "pld".

        Returns:
            A few sentences: the guarantee, what it means, what it covers
            and what it does not (see `privacy_statement`).
        """
        if self.before_statement is not None:
            self.before_statement()
        epsilon = self.epsilon(delta, accountant)
        now = self.steps
        return privacy_statement(
            epsilon,
            delta,
            now,
            mechanism_description=self._description(now),
            accountant=accountant,
            relation=self.relation,
            search=any(is_search(event) for event, _ in self._parts(now)),
            preprocessing=self.preprocessing,
        )

    def _description(self, now):
        """`describe_releases` of the releases, with what a rounds segment means."""
        own = self._parts(now)
        text = describe_releases(own[:len(own) - self._carried_count()])
        rounds = [(end - start, c) for event, start, end, c in self._spans(now)
                  if end > start and (c.steps_per_round > 1 or c.relation == "zero_out")
                  and not is_search(event)]
        for steps, counting in rounds:
            every = counting.steps_per_round
            pattern = (
                f"each record takes part at most once every {every} steps (a fixed data order)"
                if counting.relation == "zero_out" else
                f"each record can be sampled at most once every {every} steps (cyclic Poisson "
                "sampling)"
            )
            text += (
                f" ({steps} steps of banded correlated noise (DP-BandMF) in which {pattern}: "
                f"{counting.releases(steps)} round(s), each counted as one release)"
            )
        for carried in self._carried.values():
            text += (
                f". These weights also carry the releases of the training of {carried.label}, "
                f"charged here too ({describe_releases(list(carried.parts))})"
            )
        return text

    # -- persistence -----------------------------------------------------------

    def to_json(self):
        """The ledger as a JSON string.

        Holds the closed segments, the open segment, the one-off records and
        the step count at save time, sealed with their SHA-256
        (`tfdp.accounting.integrity`); `from_json` checks and restores it.

        Raises:
            ValueError: if the step counter went back below a count the
                ledger already saw (saving it would un-count steps that ran).
        """
        now = self.steps
        self._check_counter(now)
        countings = [segment[3] for segment in self._segments]
        countings += [] if self._open is None else [self._open[2]]
        version = _VERSION if all(c.is_default for c in countings) else _ROUNDS_VERSION
        data = {
            "format": _FORMAT,
            "version": _EXTENDED_VERSION if self._preprocessing or self._carried else version,
            "steps": now,
            "segments": [
                _segment_dict(event, counting, start=start, end=end)
                for event, start, end, counting in self._segments
            ],
            "open": None
            if self._open is None
            else _segment_dict(self._open[0], self._open[2], start=self._open[1]),
            "records": [
                {"event": event_to_dict(event), "count": count} for event, count in self._records
            ],
            "lineage": [list(branch) for branch in self._branches(now)],
        }
        if self._preprocessing:
            data["preprocessing"] = self.preprocessing
        if self._carried:
            data["carried"] = [
                {"id": key, "label": c.label, "relation": c.relation,
                 "releases": [{"event": event_to_dict(e), "count": n,
                               **({"id": i} if i is not None else {})}
                              for e, n, i in c.history],
                 **({"additive_delta": c.additive_delta} if c.additive_delta else {})}
                for key, c in self._carried.items()
            ]
        return json.dumps(integrity.seal(data), allow_nan=False)

    @classmethod
    def from_json(cls, text, step_counter=None):
        """Restores a ledger written by `to_json`.

        Args:
            text: the JSON string (or UTF-8 bytes).
            step_counter: optional step counter of the restored model. It is
                trusted for the open segment, but refused if it reads fewer
                steps than the saved closed segments account for (the weights
                and the ledger come from different checkpoints), or more than
                zero for a ledger that never declared a step event. Without
                one, the ledger continues from the saved step count.

        Returns:
            The `PrivacyLedger`.

        Raises:
            ValueError: corrupt JSON (the message names the problem), a
                checksum that does not match (a damaged record), or a
                mismatched step counter. A ledger saved before checksums is
                read with an `integrity.UncheckedRecordWarning`.
        """
        if isinstance(text, (bytes, bytearray)):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"Corrupt privacy ledger: not UTF-8 text ({error}).") from None
        if not isinstance(text, str):
            raise TypeError(
                f"Expected `text` to be a JSON string. Received: text={show(text)} "
                f"(of type {type(text).__name__})"
            )
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"Corrupt privacy ledger: invalid JSON ({error}).") from None
        segments, open_segment, records, saved_steps = _parse(data)
        lineage = _parse_lineage(data, saved_steps, len(records))
        preprocessing = _parse_preprocessing(data)
        _check_seal(data)  # after the structure's checks, whose messages are more telling

        ledger = cls(step_counter=step_counter)
        ledger._preprocessing = preprocessing
        ledger._segments = segments
        ledger._open = open_segment
        ledger._records = records
        ledger._carried = _parse_carried(data)
        ledger._floors = {key: c.history for key, c in ledger._carried.items()}
        ledger._high_water = open_segment[1] if open_segment is not None else 0
        ledger._lineage = lineage
        ledger._resumed = (_new_id(), saved_steps, len(records))
        if step_counter is None:
            ledger._own_steps = saved_steps
            return ledger
        now = ledger.steps
        ledger._resumed = (ledger._resumed[0], min(now, saved_steps), len(records))
        floor = open_segment[1] if open_segment is not None else 0
        if now < floor:
            raise ValueError(
                f"Mismatched checkpoint: the step counter reads {now}, but the saved privacy "
                f"ledger's closed segments already account for {floor} steps. The weights and "
                "the ledger come from different checkpoints; refusing a ledger that would "
                f"under-count. Received: step_counter()={now}"
            )
        if open_segment is None and now > 0:
            raise ValueError(
                f"Mismatched checkpoint: the step counter reads {now}, but the saved privacy "
                "ledger declares no step event (it was saved before any private step). "
                f"Received: step_counter()={now}"
            )
        return ledger

    def __repr__(self):
        try:
            steps = self.steps
        except Exception:  # a repr must not raise; pylint: disable=broad-except
            steps = "?"
        segments = len(self._segments) + (self._open is not None)
        return f"PrivacyLedger(steps={steps}, segments={segments}, records={len(self._records)})"


def _segment_dict(event, counting, **span):
    """A segment's JSON object; the counting only when it is not per step
    (so a ledger without rounds is written exactly as by version 1)."""
    data = {"event": event_to_dict(event), **span}
    if not counting.is_default:
        data.update(steps_per_round=counting.steps_per_round, relation=counting.relation)
    return data


class Carried(collections.namedtuple(
        "Carried", ["label", "parts", "relation", "additive_delta", "ids"], defaults=(0.0, ()))):
    """Another training's releases that a ledger's weights carry: how the
    statement names it, its (event, count) parts, its relation, its
    preprocessing thresholds' failure probability, and the identity of each
    part (`carried_floor`; None, or no ids at all, where unknown)."""

    __slots__ = ()

    @property
    def history(self):
        """The parts as (event, count, identity) triples."""
        ids = self.ids or (None,) * len(self.parts)
        return tuple((event, count, identity) for (event, count), identity in zip(self.parts, ids))


def _new_id():
    return uuid.uuid4().hex


def _check_identity(identity):
    if identity is not None and not isinstance(identity, str):
        raise TypeError(
            f"Expected a release's identity to be a string or None. Received: {show(identity)}")
    return identity


def _parse_carried(data):
    """The validated "carried" trainings of a saved ledger (version 3)."""
    carried = {}
    if data["version"] != _EXTENDED_VERSION or "carried" not in data:
        return carried
    for i, item in enumerate(_get_list(data, "carried", "the ledger")):
        where = f"carried[{i}]"
        key, label = _get(item, "id", where), _get(item, "label", where)
        relation = _get(item, "relation", where)
        if not isinstance(key, str) or not isinstance(label, str) or relation not in RELATIONS:
            raise _corrupt(f"bad id, label or relation at {where}.")
        releases = _get_list(item, "releases", where)
        parts = tuple((_get_event(release, f"{where}.releases[{j}]"),
                       _get_int(release, "count", f"{where}.releases[{j}]", minimum=1))
                      for j, release in enumerate(releases))
        ids = tuple(release.get("id") for release in releases)
        if any(identity is not None and not isinstance(identity, str) for identity in ids):
            raise _corrupt(f"bad release id at {where}.")
        extra = item.get("additive_delta", 0.0)
        if not isinstance(extra, (int, float)) or isinstance(extra, bool) or not 0 <= extra < 1:
            raise _corrupt(f"bad additive_delta at {where}.")
        carried[key] = Carried(label, parts, relation, float(extra), ids)
    return carried


def _largest_fitting(fits, max_steps, guess=None):
    """Largest k in [0, max_steps] with fits(k), given fits(0) is True.

    Gallops from `guess` (or from 0) with doubling steps until it brackets
    the answer between a k that fits and one that does not, then bisects.
    Only a k for which `fits` returned True is ever returned.
    """
    if guess is None or not 0 < guess <= max_steps:
        feasible, infeasible, step = 0, None, 1
    elif fits(guess):
        feasible, infeasible, step = guess, None, max(1, guess // 32)
    else:
        feasible, infeasible, step = None, guess, max(1, guess // 32)
    while feasible is None:  # walk down from an infeasible guess
        k = infeasible - step
        if k <= 0:
            feasible = 0
        elif fits(k):
            feasible = k
        else:
            infeasible, step = k, 2 * step
    while infeasible is None:  # walk up from a feasible point
        if feasible >= max_steps:
            return max_steps
        k = min(feasible + step, max_steps)
        if fits(k):
            feasible, step = k, 2 * step
        else:
            infeasible = k
    while infeasible - feasible > 1:
        middle = (feasible + infeasible) // 2
        if fits(middle):
            feasible = middle
        else:
            infeasible = middle
    return feasible


# -- JSON parsing ------------------------------------------------------------------


def _corrupt(message):
    return ValueError(f"Corrupt privacy ledger: {message}")


def _get(mapping, key, where):
    if not isinstance(mapping, dict):
        raise _corrupt(f"expected {where} to be an object, got {show(mapping)}.")
    if key not in mapping:
        raise _corrupt(f"{where} has no {key!r}.")
    return mapping[key]


def _get_int(mapping, key, where, minimum=0):
    value = _get(mapping, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _corrupt(f"expected {where}.{key} to be an integer >= {minimum}, got {show(value)}.")
    return value


def _get_list(mapping, key, where):
    value = _get(mapping, key, where)
    if not isinstance(value, list):
        raise _corrupt(f"expected {where}.{key} to be a list, got {show(value)}.")
    return value


def _get_event(mapping, where):
    data = _get(mapping, "event", where)
    try:
        return event_from_dict(data)
    except (TypeError, ValueError) as error:
        raise _corrupt(f"bad event at {where}.event: {error}") from None


def _check_preprocessing(entry, where):
    """A validated copy of a preprocessing provenance entry."""
    if not isinstance(entry, dict) or not (
            set(_PREPROCESSING_KEYS) <= set(entry)
            <= set(_PREPROCESSING_KEYS) | set(_PREPROCESSING_OPTIONAL)):
        raise ValueError(
            f"Expected {where} to be a dict with the keys {list(_PREPROCESSING_KEYS)} "
            f"(and optionally {list(_PREPROCESSING_OPTIONAL)}). Received: {show(entry)}"
        )
    for key in [*_PREPROCESSING_KEYS[:-1], *(k for k in _PREPROCESSING_OPTIONAL if k in entry)]:
        if not isinstance(entry[key], str):
            raise ValueError(
                f"Expected {where}[{key!r}] to be a string. Received: {show(entry[key])}")
    check_choice(f"{where}['kind']", entry["kind"], _PREPROCESSING_KINDS)
    value = check_real(f"{where}['additive_delta']", entry["additive_delta"], low=0.0, high=1.0,
                       low_inclusive=True)
    return dict(entry, additive_delta=value)


def _parse_preprocessing(data):
    entries = data.get("preprocessing", []) if isinstance(data, dict) else []
    if not isinstance(entries, list):
        raise _corrupt(f"expected preprocessing to be a list, got {show(entries)}.")
    try:
        return [_check_preprocessing(item, f"preprocessing[{i}]") for i, item in enumerate(entries)]
    except (TypeError, ValueError) as error:
        raise _corrupt(str(error)) from None


def _get_counting(mapping, where, version):
    """A segment's Counting: per step unless version 2 names rounds."""
    if version == _VERSION:
        return PER_STEP
    steps_per_round = mapping.get("steps_per_round", 1)
    relation = mapping.get("relation", "add_or_remove")
    try:
        return _check_counting(steps_per_round, relation)
    except (TypeError, ValueError) as error:
        raise _corrupt(f"bad counting at {where}: {error}") from None


def _check_seal(data):
    """Checks a parsed ledger's checksum; an old ledger without one (and with
    no key a ledger never had: a flipped key name) is read with a warning."""
    if integrity.unseal(data, "Corrupt privacy ledger") is not None:
        return
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise _corrupt(f"unknown key(s) {unknown} and no checksum (a damaged record).")
    import warnings

    warnings.warn(
        "This privacy ledger was saved without a checksum (by an earlier tfdp): it is read "
        "unchecked. Save the model again to seal it.",
        integrity.UncheckedRecordWarning, stacklevel=4)


_KEYS = {"format", "version", "steps", "segments", "open", "records", "preprocessing",
         "carried", "lineage"}


def _parse_lineage(data, saved_steps, saved_records):
    """The validated branches [(id, first step, first record)] of a saved
    ledger; one new branch for a ledger saved before lineages."""
    if "lineage" not in data:
        return [(_new_id(), 0, 0)]
    lineage = []
    for i, item in enumerate(_get_list(data, "lineage", "the ledger")):
        if (not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str)
                or any(isinstance(n, bool) or not isinstance(n, int) for n in item[1:])):
            raise _corrupt(f"expected lineage[{i}] to be [id, step, record], got {show(item)}.")
        previous = lineage[-1] if lineage else (None, 0, 0)
        if (not lineage and item[1:] != [0, 0]) or not (
                previous[1] <= item[1] <= saved_steps and previous[2] <= item[2] <= saved_records):
            raise _corrupt(
                f"lineage[{i}] starts at step {item[1]}, record {item[2]}: out of order.")
        lineage.append(tuple(item))
    if not lineage:
        raise _corrupt("an empty lineage.")
    return lineage


def _parse(data):
    """Validated (segments, open, records, steps) of a saved ledger."""
    if _get(data, "format", "the ledger") != _FORMAT:
        raise _corrupt(f"expected format {_FORMAT!r}, got {show(data['format'])}.")
    version = _get(data, "version", "the ledger")
    if version not in (_VERSION, _ROUNDS_VERSION, _EXTENDED_VERSION):
        raise _corrupt(
            f"unsupported version {show(version)} (this tfdp reads {_VERSION} to "
            f"{_EXTENDED_VERSION})."
        )
    saved_steps = _get_int(data, "steps", "the ledger")

    segments = []
    end = 0
    for i, item in enumerate(_get_list(data, "segments", "the ledger")):
        where = f"segments[{i}]"
        start = _get_int(item, "start", where)
        stop = _get_int(item, "end", where)
        if start != end or stop <= start:
            raise _corrupt(
                f"{where} covers steps [{start}, {stop}), but segments must be non-empty "
                f"and follow each other from step 0 (expected start {end})."
            )
        segments.append((_get_event(item, where), start, stop, _get_counting(item, where, version)))
        end = stop

    open_data = _get(data, "open", "the ledger")
    if open_data is None:
        open_segment = None
        if segments:
            raise _corrupt("closed segments but no open segment.")
        if saved_steps != 0:
            raise _corrupt(f"{saved_steps} steps but no step event.")
    else:
        start = _get_int(open_data, "start", "open")
        if start != end:
            raise _corrupt(f"the open segment starts at step {start}, expected {end}.")
        if saved_steps < start:
            raise _corrupt(f"{saved_steps} steps, but the open segment starts at step {start}.")
        open_segment = (_get_event(open_data, "open"), start, _get_counting(open_data, "open", version))

    records = []
    for i, item in enumerate(_get_list(data, "records", "the ledger")):
        where = f"records[{i}]"
        records.append((_get_event(item, where), _get_int(item, "count", where, minimum=1)))
    return segments, open_segment, records, saved_steps

