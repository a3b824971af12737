"""Keras callbacks that read the privacy ledger.

`PrivacyBudget` puts epsilon into the logs (progress bar, History,
TensorBoard, CSVLogger) and stops training before a budget is exceeded.
`PrivacyJournal` writes each step range to disk before it runs, so a run
killed mid-epoch and resumed from a checkpoint never under-counts.
`ProgbarLogger` is Keras's progress bar, except that an epoch cut short by
the budget ends at the steps that ran.
"""

import logging
import math

import keras
from keras.src.utils import io_utils

from tfdp.accounting._validation import warn_if_delta_exceeds_one_over_n

logger = logging.getLogger("tfdp")


class PrivacyBudget(keras.callbacks.Callback):
    """Shows epsilon as training goes and stops before the budget is spent.

    At the start of training and of every epoch it asks the ledger how many
    more steps of the current mechanism fit in (epsilon, delta); training
    stops after the last such step, so the final epsilon never exceeds the
    budget. A budget already spent stops training before its first step.
    `stopped_for_budget` is True only when the budget cut training short
    (not when the last planned step also used up the budget); then the
    stop is said once, as `stop_message` ("Epoch 2: the privacy budget
    stopped training after step 6: epsilon=2.9871 (delta=1e-05) of the
    budget epsilon=3.0000; one more step would spend epsilon=3.1042."): printed after
    the progress bar (verbose 1 or 2, like EarlyStopping's "early
    stopping"), logged to the logger "tfdp" (INFO), and in the stopping
    epoch's logs as "stopped_for_budget": 1.0 (History, CSVLogger,
    TensorBoard), next to its "epsilon".

    `DPModel.fit` runs this callback before all others, so every logger sees
    "epsilon": after every step (the live progress bar with verbose=1,
    TensorBoard with update_freq="batch") and every epoch. With
    accountant="pld" (about half a second a query) only epoch logs carry it.
    `DPModel.fit` tells it whether any callback reads step logs
    (`mark_step_log_readers`); when none does (verbose=0 or 2, no
    TensorBoard or custom batch callback), no epsilon is computed per step,
    and a budget without `epsilon` lets Keras run the step callbacks off the
    training thread (`async_safe`). A budget with `epsilon` always checks
    after every step on the training thread, so the stop is never late.
    It also keeps the training-data count "nonfinite_examples" out of the
    logs while it is 0 (it appears as soon as a row was non-finite).

    Args:
        epsilon: the budget, a float > 0, or None to only report epsilon.
        delta: the target delta in (0, 1) (default 1e-5); `fit` warns
            (`tfdp.accounting.LargeDeltaWarning`) when it is above 1/N.
        accountant: "rdp" (default) or "pld".

    Example:

    >>> import tfdp
    >>> budget = tfdp.callbacks.PrivacyBudget(epsilon=3.0, delta=1e-5)
    >>> # model.fit(x, y, batch_size=256, epochs=40, callbacks=[budget])
    """

    def __init__(self, epsilon=None, delta=1e-5, accountant="rdp"):
        super().__init__()
        if epsilon is not None and (
            isinstance(epsilon, bool)
            or not isinstance(epsilon, (int, float))
            or not math.isfinite(epsilon)
            or epsilon <= 0
        ):
            raise ValueError(
                f"Expected `epsilon` to be a finite number > 0 or None. Received: epsilon={epsilon!r}"
            )
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
            raise ValueError(f"Expected `delta` in (0, 1). Received: delta={delta!r}")
        self.epsilon = epsilon
        self.delta = delta
        self.accountant = accountant
        self.stopped_for_budget = False
        self.stop_message = None
        self.step_logs_read = True  # set by DPModel.fit (mark_step_log_readers)
        self._step_limit = None
        self._epoch = 0
        self._stop_epoch = None

    @property
    def async_safe(self):
        """True when Keras may run this callback's step hooks off the training
        thread: nothing it does there can change which steps run (no budget)
        or what a step's logs show (nobody reads them)."""
        return self.epsilon is None and not self.step_logs_read

    def _ledger(self):
        return self.model.privacy

    def _plan(self):
        if self.epsilon is None:
            return
        ledger = self._ledger()
        room = ledger.steps_within_budget(self.epsilon, self.delta, accountant=self.accountant)
        self._step_limit = ledger.steps + room
        if room == 0:
            self._stop()

    def _stop(self):
        self.stopped_for_budget = True
        self.model.stop_training = True
        self._stop_epoch = self._epoch

    def check_can_start(self, ledger, num_examples=None, optimizer=None):
        """Raises ValueError if the budget leaves no room for one more step.

        Args:
            ledger: the model's privacy ledger.
            num_examples: N, the training set's size, if known: a `delta`
                above 1/N gets a `tfdp.accounting.LargeDeltaWarning`.
            optimizer: the model's optimizer, if known: a `target_epsilon`
                above this budget is named in the advice.
        """
        if num_examples is not None:
            warn_if_delta_exceeds_one_over_n(self.delta, num_examples)
        if self.epsilon is None:
            return
        if ledger.steps_within_budget(self.epsilon, self.delta, accountant=self.accountant) == 0:
            spent = ledger.epsilon(self.delta, accountant=self.accountant, extra_steps=1)
            raise ValueError(
                f"The privacy budget epsilon={self.epsilon} (delta={self.delta}) "
                f"leaves no room for another step: one more step would reach "
                f"epsilon={spent:.4g}. Training was not started."
                + self._target_advice(optimizer)
            )

    @classmethod
    def for_noise_target(cls, target):
        """The budget `fit` adds for an optimizer's `target_epsilon` (its
        messages name that argument, not a PrivacyBudget the user never
        added)."""
        budget = cls(epsilon=target.epsilon, delta=target.delta)
        budget._named = f"The optimizer's target_epsilon={target.epsilon:g}"
        return budget

    def _target_advice(self, optimizer):
        """Advice for a budget below the optimizer's `target_epsilon` ("" if
        none): that target calibrated the noise to spend more than the budget."""
        target = getattr(optimizer, "target_epsilon", None)
        if target is None or self.epsilon is None or target <= self.epsilon:
            return ""
        return (
            f" The optimizer's target_epsilon={target:g} calibrated the noise to spend "
            f"{target:g} over this fit, more than this budget's epsilon={self.epsilon:g}: "
            f"give the optimizer target_epsilon={self.epsilon:g} (fit then stops at it, "
            "with no PrivacyBudget needed) or raise the budget to the target."
        )

    def on_train_begin(self, logs=None):
        if self.epsilon is not None and getattr(self.model, "steps_per_execution", 1) > 1:
            named = getattr(self, "_named", None)
            raise ValueError(
                f"{named or 'PrivacyBudget'} stops training between steps, at the "
                f"{'target' if named else 'budget'}, so it needs steps_per_execution=1: "
                "compile with steps_per_execution=1. Received: steps_per_execution="
                f"{self.model.steps_per_execution}"
            )
        self.stopped_for_budget = False
        self.stop_message = None
        self._stop_epoch = None
        self._first_epoch = None
        self._first_step = self._ledger().steps
        self._plan()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self._first_epoch is None:
            self._first_epoch = epoch
        self._plan()

    def _is_last_planned_step(self, batch):
        params = self.params or {}
        epochs, steps = params.get("epochs"), params.get("steps")
        return (
            epochs is not None and steps is not None
            and self._epoch == epochs - 1 and batch + 1 >= steps
        )

    def on_train_batch_end(self, batch, logs=None):
        ledger = self._ledger()
        if logs is not None:
            _hide_zero_count(logs)
            if self.accountant == "rdp" and self.step_logs_read:
                logs["epsilon"] = ledger.epsilon(self.delta, accountant=self.accountant)
        if self._step_limit is not None and ledger.steps >= self._step_limit:
            if self._is_last_planned_step(batch):
                self.model.stop_training = True  # training ends here anyway
            else:
                self._stop()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            _hide_zero_count(logs)
            logs["epsilon"] = self._ledger().epsilon(self.delta, accountant=self.accountant)
            if self._stop_epoch == epoch:
                logs["stopped_for_budget"] = 1.0

    def _short_plan(self, ran):
        """A sentence for a stop that cut the fit's plan short: the noise
        multiplier is too small for the planned steps."""
        params = self.params or {}
        epochs, steps = params.get("epochs"), params.get("steps")
        if epochs is None or steps is None or self._first_epoch is None:
            return ""
        planned = (epochs - self._first_epoch) * steps
        optimizer = getattr(self.model, "optimizer", None)
        sigma = getattr(optimizer, "noise_multiplier", None)
        if ran >= planned or sigma is None:
            return ""
        advice = self._target_advice(optimizer)
        if advice:
            return advice
        return (
            f" The noise multiplier is too small for this fit's plan: the budget affords "
            f"{ran} of its {planned} steps at noise_multiplier={sigma:.4g}. Calibrate the "
            "noise for the plan (the optimizer's target_epsilon and target_delta, or "
            "tfdp.accounting.calibrate_dpsgd) or plan fewer epochs."
        )

    def on_train_end(self, logs=None):
        if not self.stopped_for_budget:
            return
        ledger = self._ledger()
        spent = ledger.epsilon(self.delta, accountant=self.accountant)
        following = ledger.epsilon(self.delta, accountant=self.accountant, extra_steps=1)
        self.stop_message = (
            f"Epoch {self._stop_epoch + 1}: the privacy budget stopped training after step "
            f"{ledger.steps}: epsilon={spent:.4f} (delta={self.delta:g}) of the budget "
            f"epsilon={self.epsilon:.4f}; one more step would spend epsilon={following:.4f}."
            + self._short_plan(ledger.steps - self._first_step)
        )
        logger.info(self.stop_message)
        if (self.params or {}).get("verbose", 0) != 0:
            io_utils.print_msg(self.stop_message)


def mark_step_log_readers(callbacks, verbose):
    """Tells every `PrivacyBudget` in `callbacks` whether anything reads step logs.

    A reader is a callback other than a `PrivacyBudget` that overrides
    `on_train_batch_end` or `on_batch_end` (TensorBoard, a user's callback),
    except a progress bar, which reads them only with verbose=1 ("auto").
    Called by `DPModel.fit` with its final callback list.

    Example:

    >>> budget = PrivacyBudget()
    >>> mark_step_log_readers([budget, keras.callbacks.History()], verbose=0)
    >>> budget.step_logs_read
    False
    """
    from keras.src import utils

    def reads(callback):
        if isinstance(callback, PrivacyBudget):
            return False
        if isinstance(callback, keras.callbacks.ProgbarLogger):
            return verbose in (1, "auto")
        return not (
            utils.is_default(callback.on_train_batch_end) and utils.is_default(callback.on_batch_end)
        )

    read = any(reads(callback) for callback in callbacks)
    for callback in callbacks:
        if isinstance(callback, PrivacyBudget):
            callback.step_logs_read = read


def _hide_zero_count(logs):
    """Drops "nonfinite_examples" from `logs` while it is 0 (nothing to report)."""
    if logs.get("nonfinite_examples", None) == 0:
        del logs["nonfinite_examples"]


class ProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras's progress bar, ending an epoch cut short at the steps that ran.

    Keras's own bar always ends an epoch at its planned step count ("28/28")
    even when a callback stopped training mid-epoch; this one ends at the
    steps that ran ("21/28"). Pass it in `callbacks` (Keras then uses it
    instead of its own).

    Example:

    >>> import tfdp
    >>> progress = tfdp.callbacks.ProgbarLogger()
    >>> # model.fit(x, y, verbose=2, callbacks=[budget, progress])
    """

    def on_epoch_end(self, epoch, logs=None):
        if self.progbar is not None and self.target is not None and 0 < self.seen < self.target:
            self.progbar.update(self.seen, list((logs or {}).items()), finalize=True)
        else:
            super().on_epoch_end(epoch, logs)


def _valid_rounds(entry):
    """Whether a journal entry's optional round counting is well formed."""
    if "steps_per_round" not in entry and "relation" not in entry and "segment_start" not in entry:
        return True
    from tfdp.accounting.ledger import RELATIONS

    per_round, start = entry.get("steps_per_round"), entry.get("segment_start")
    return (
        isinstance(per_round, int) and not isinstance(per_round, bool) and per_round >= 1
        and entry.get("relation") in RELATIONS
        and isinstance(start, int) and not isinstance(start, bool) and 0 <= start <= entry["start"]
    )


class PrivacyJournal(keras.callbacks.Callback):
    """A write-ahead journal of private steps: a crash never under-counts.

    A checkpoint's ledger covers the steps before it was saved. When training
    is killed, the steps that ran after the last checkpoint are gone from the
    weights, but they ran: their outputs may have been seen (progress logs,
    TensorBoard, a later checkpoint that was copied elsewhere). This callback
    appends, BEFORE steps run, a line "steps [start, end) of the step counter
    release this event" to a journal file (flushed and fsynced). After a crash,
    `recover(model)` charges every journaled step the loaded checkpoint does
    not cover to its ledger, so epsilon covers every step that ran. It may
    over-count (steps journaled ahead that never ran: up to one epoch with
    `frequency="epoch"`, none with "batch" unless the data ran out within a
    call of `steps_per_execution` steps), never under-count. With
    `compile(steps_per_execution=k)` Keras runs k steps per call and the
    callback journals each call's k steps ahead of it ("batch"), or the
    epoch's calls (its steps rounded up to a multiple of k: Keras runs that
    many). A segment
    counted in rounds (DP-BandMF: one release per P or b steps, under its
    neighbouring relation) is journaled with its rounds, its relation and
    the step its noise stream began at, so a replay charges what the ledger
    charged: the rounds of a stream that began before the checkpoint go on
    counting from its start, and two streams are counted apart.

    While training, a model whose ledger counts fewer steps than the journal
    records is refused before its first step (call `recover` first), and so
    is a journal that records fewer steps than the model has (it belongs to
    another run). Keep one journal per training run, next to its checkpoints.
    With `keras.callbacks.BackupAndRestore` in the same `fit`, `fit` calls
    `recover` itself right after restoring a backup.

    Args:
        path: the journal file (JSON lines; created if missing).
        frequency: "epoch" (default: one fsync per epoch, for its planned
            steps) or "batch" (one fsync per step, or per call of
            `steps_per_execution` steps: exact, slower).

    Example:

    ```python
    journal = tfdp.callbacks.PrivacyJournal("run/journal.jsonl")
    model.fit(x, y, epochs=10, callbacks=[journal,
              keras.callbacks.ModelCheckpoint("run/last.keras")])
    # ... killed; later:
    model = tfdp.load_model("run/last.keras")
    journal.recover(model)            # charges the steps lost with the kill
    model.fit(x, y, epochs=10, initial_epoch=..., callbacks=[journal, ...])
    ```
    """

    FORMAT = "tfdp.PrivacyJournal"
    # Version 2 entries may carry "steps_per_round", "relation" and
    # "segment_start" (a segment counted in rounds); version 3 entries all
    # carry "sha256" (tfdp.accounting.integrity). Versions 1 and 2 are read.
    VERSION = 3
    READABLE = (1, 2, 3)
    FREQUENCIES = ("epoch", "batch")

    def __init__(self, path, frequency="epoch"):
        super().__init__()
        if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
            raise TypeError(f"Expected `path` to be a file path. Received: path={path!r}")
        if frequency not in self.FREQUENCIES:
            raise ValueError(
                f"Expected `frequency` in {self.FREQUENCIES}. Received: frequency={frequency!r}"
            )
        self.path = path
        self.frequency = frequency

    # -- the file ----------------------------------------------------------

    def entries(self):
        """The journal's entries: dicts with "start", "end" and "event" (and,
        for a segment counted in rounds, "steps_per_round", "relation" and
        "segment_start").

        Every line carries the SHA-256 of its content
        (`tfdp.accounting.integrity`), so a damaged line is refused instead
        of read as a smaller charge; lines of a journal begun by an earlier
        tfdp (version 1 or 2) have none and are read with a warning.

        A last line cut short (the process was killed, or the disk filled,
        while writing it) is ignored: its steps had not started, since they
        start only after the line is written. The next entry the callback
        writes first cuts that fragment off. Any other damage raises
        ValueError naming the file.
        """
        import json
        import os

        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as file:
            data = file.read()
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        elif lines:
            self._check_torn(lines.pop())  # written without its newline
        entries = []
        version = None
        unchecked = 0
        for number, line in enumerate(lines, 1):
            try:
                entry = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise ValueError(
                    f"Corrupt privacy journal {self.path!r}: line {number} is not JSON ({error})."
                ) from None
            if number == 1:
                if entry not in [{"format": self.FORMAT, "version": v} for v in self.READABLE]:
                    raise ValueError(
                        f"Corrupt privacy journal {self.path!r}: expected a "
                        f"{self.FORMAT} header on line 1. Received: {line[:80]!r}"
                    )
                version = entry["version"]
                continue
            entry, checked = self._unseal(entry, number, version, line)
            unchecked += not checked
            if not (
                isinstance(entry.get("start"), int)
                and isinstance(entry.get("end"), int)
                and 0 <= entry["start"] < entry["end"]
                and isinstance(entry.get("event"), dict)
                and _valid_rounds(entry)
            ):
                raise ValueError(
                    f"Corrupt privacy journal {self.path!r}: line {number} is not an entry "
                    f"with 0 <= start < end and an event. Received: {line[:80]!r}"
                )
            entries.append(entry)
        if unchecked:
            import warnings

            from tfdp.accounting.integrity import UncheckedRecordWarning

            warnings.warn(
                f"The privacy journal {self.path!r} has {unchecked} line(s) without a checksum "
                "(written by an earlier tfdp): they are read unchecked. A new journal file "
                "seals every line.", UncheckedRecordWarning, stacklevel=2)
        return entries

    _KEYS = {"start", "end", "event", "steps_per_round", "relation", "segment_start"}

    def _unseal(self, entry, number, version, line):
        """A line's entry without its checksum, checked, and whether it had one."""
        from tfdp.accounting import integrity

        if not isinstance(entry, dict):
            raise ValueError(
                f"Corrupt privacy journal {self.path!r}: line {number} is not an entry "
                f"with 0 <= start < end and an event. Received: {line[:80]!r}"
            )
        where = f"Corrupt privacy journal {self.path!r}: line {number}"
        content = integrity.unseal(entry, where)
        if content is not None:
            return content, True
        unknown = sorted(set(entry) - self._KEYS)
        if version == self.VERSION or unknown:
            raise ValueError(
                f"{where} has no checksum"
                + (f" and unknown key(s) {unknown}" if unknown else "")
                + f" (a damaged line). Received: {line[:80]!r}"
            )
        return entry, False

    def _check_torn(self, fragment):
        """Refuses a last line without its newline that is not a cut-short
        write: a whole JSON object followed by more bytes (a damaged newline
        that would hide a complete entry)."""
        import json

        text = fragment.decode("latin-1")  # any byte: a damaged newline may not be UTF-8
        try:
            _, end = json.JSONDecoder().raw_decode(text)
        except json.JSONDecodeError:
            return  # a prefix of a line: its steps had not started
        if end < len(text):
            raise ValueError(
                f"Corrupt privacy journal {self.path!r}: its last line holds a complete entry "
                f"followed by other bytes instead of a newline (a damaged line). Received: "
                f"{fragment[-80:]!r}"
            )

    def journaled_steps(self):
        """The highest step count the journal records (0 if empty)."""
        return max((entry["end"] for entry in self.entries()), default=0)

    def _cut_torn_line(self):
        """Truncates a last line written without its newline (a kill or a full
        disk mid-write), so that the next entry starts a line of its own."""
        import os

        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            return
        with open(self.path, "rb+") as file:
            file.seek(-1, os.SEEK_END)
            if file.read(1) == b"\n":
                return
            file.seek(0)
            data = file.read()
            file.truncate(data.rfind(b"\n") + 1)  # 0 when the header itself is torn
            file.flush()
            os.fsync(file.fileno())

    def _append(self, entry):
        import json
        import os

        from tfdp.accounting.integrity import seal

        self._cut_torn_line()
        new = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        with open(self.path, "ab") as file:
            if new:
                header = {"format": self.FORMAT, "version": self.VERSION}
                file.write(json.dumps(header).encode() + b"\n")
            file.write(json.dumps(seal(entry), allow_nan=False).encode("utf-8") + b"\n")
            file.flush()
            os.fsync(file.fileno())

    # -- recovery ----------------------------------------------------------

    def recover(self, model):
        """Charges `model`'s ledger with every journaled step it does not cover.

        Call it after loading a checkpoint, before `fit`. The lost steps are
        charged with the events the journal recorded for them, and the model's
        step counter moves to the journal's count (steps that ran are never
        un-counted; the next steps continue from there).

        Args:
            model: a `tfdp.DPModel` / `DPSequential` (its `privacy` ledger).

        A DP-BandMF run (`tfdp.optimizers.DPBandMF`) cannot continue its
        noise stream after charged steps whose noise was lost with the kill:
        its next `fit` starts a new stream (a new ledger segment) at the
        journal's count, with a warning, unless its `noise_state` holds the
        stream at that very step.

        Returns:
            The number of steps charged (0 if the checkpoint covers all).

        Raises:
            ValueError: corrupt journal, or a journal recording fewer steps
                than the model has run (it belongs to another run).
        """
        import json

        from tfdp.accounting import event_from_dict

        ledger = model.privacy
        now = ledger.steps
        entries = self.entries()
        high = max((entry["end"] for entry in entries), default=0)
        self._check_belongs(now, high)
        if high <= now:
            return 0
        saved_open = json.loads(ledger.to_json())["open"]
        position = now
        replaying = None  # the journal's segment the ledger's open one replays
        for entry in sorted(entries, key=lambda e: e["start"]):
            if entry["end"] <= position:
                continue
            event = event_from_dict(entry["event"])
            counting = (entry.get("steps_per_round", 1), entry.get("relation", "add_or_remove"))
            segment = (event, entry.get("segment_start")) + counting
            # Rounds go on counting only within the same stream: the checkpoint's
            # open segment, or the one this replay opened for it; any other
            # segment starts anew (at worst over-counting, never under).
            open_segment = ledger.open_segment
            continues = open_segment is not None and (
                open_segment == segment or (open_segment[2:] == counting and replaying == segment))
            ledger.begin_steps(event, steps_per_round=counting[0], relation=counting[1],
                               new_segment=not continues)
            replaying = segment
            position = entry["end"]
            model._dp_steps.assign(position)
        if saved_open is not None:
            ledger.begin_steps(
                event_from_dict(saved_open["event"]),
                steps_per_round=saved_open.get("steps_per_round", 1),
                relation=saved_open.get("relation", "add_or_remove"),
            )
        # The model's weights are still at step `now`: what comes next (a
        # DP-BandMF noise stream, `DPBandMF`) may need to know.
        object.__setattr__(model, "_journal_recovery", (now, high))
        return high - now

    def _check_belongs(self, now, high):
        if high and now > high:
            raise ValueError(
                f"Mismatched privacy journal: the model's ledger counts {now} steps but the "
                f"journal {self.path!r} records only {high}: the journal belongs to another "
                "run (or steps ran without it). Use this run's journal or a new file."
            )

    # -- the callback ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        now = self.model.privacy.steps
        high = self.journaled_steps()
        self._check_belongs(now, high)
        if high > now:
            raise ValueError(
                f"The privacy journal {self.path!r} records {high} steps, but this model's "
                f"ledger counts {now}: {high - now} steps ran after the checkpoint it was "
                "loaded from. Call `journal.recover(model)` before fit() so epsilon covers "
                "them. Training was not started."
            )

    def _write_ahead(self, steps):
        import json

        ledger = self.model.privacy
        saved = json.loads(ledger.to_json())
        if saved["open"] is None:
            raise ValueError("No step event is open: nothing to journal.")
        now = saved["steps"]
        entry = {"start": now, "end": now + steps, "event": saved["open"]["event"]}
        if "steps_per_round" in saved["open"]:  # counted in rounds (DP-BandMF)
            entry.update(steps_per_round=saved["open"]["steps_per_round"],
                         relation=saved["open"]["relation"],
                         segment_start=saved["open"]["start"])
        self._append(entry)

    def _steps_per_call(self):
        """The steps Keras runs between two batch callbacks: steps_per_execution."""
        return int(getattr(self.model, "steps_per_execution", 1) or 1)

    def _planned_steps(self):
        """The steps an epoch runs, or None if Keras does not know them.

        Keras starts a call of k = steps_per_execution steps at batches 0,
        k, 2k, ... below its `steps`; the last call runs k steps too (past
        `steps`) unless the data runs out.
        """
        steps = (self.params or {}).get("steps")
        if not steps:
            return None
        per_call = self._steps_per_call()
        return -(-int(steps) // per_call) * per_call

    def on_epoch_begin(self, epoch, logs=None):
        if self.frequency == "epoch" and self._planned_steps() is not None:
            self._write_ahead(self._planned_steps())

    def on_train_batch_begin(self, batch, logs=None):
        # Every call's steps, before they run (an epoch of unknown length
        # is journaled call by call).
        if self.frequency == "batch" or self._planned_steps() is None:
            self._write_ahead(self._steps_per_call())
