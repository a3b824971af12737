"""DP-BandMF's noise stream and its secret state file.

The noise of a DP-BandMF step depends on the last b - 1 noise vectors
(`tfdp.mechanisms.bandmf`). Whoever holds them can subtract them from the
released iterates, so they are never saved in a model file or an export
(the variables here are neither Keras nor TensorFlow-tracked): they are
written only to the file the user names (`DPBandMF(noise_state=path)`), a
secret to keep like a key (created with permissions 0600), and read back
from it to resume a run exactly.

A stream is one run of correlated noise: the noise vectors in a ring buffer,
the number of steps drawn, the model step it started at, its data layout
(a fixed order: steps per epoch P and batch size B; cyclic Poisson sampling:
N records, expected batch size B), the fixed order's label fingerprints
(`tfdp.data.fixed_order.OrderCheck`) and, for cyclic Poisson sampling, the
secret key of the record groups (`tfdp.data.cyclic_poisson`), so that a
resumed stream keeps every record in its group.

A stream also has a lineage (not secret): `[start, stream_id]`, then one
`[step, token]` per `fit` that drew from it, from model step `step` on. The
model keeps the lineage of the stream its steps ran, saved with its weights
(`tfdp.models.training_state.NoiseStreamRecord`), and every state file
holds its stream's: a resume takes only a state whose lineage is the
model's (`lineage_matches`). So a run never continues another run's noise
history or record groups (two runs that share a path), nor a branch of its
own run that its weights did not take (a model rolled back to an earlier
file after the run went on, then trained on with fresh noise).

A symbolic link at the path is followed (`resolved`): the files are
written where it points, atomically there, and the link stays.

Each save first moves the file it replaces to `<path>.prev`: a run killed
between writing the noise state and writing its last backup
(`keras.callbacks.BackupAndRestore`) resumes from that backup with the
previous state, which is at the backup's step. A save killed between its
two renames (no file at the path, the `.prev` in place, the new state whole
in its temporary file) is completed by the next `fit`'s probe
(`finish_interrupted_save`); without that file, the `.prev` alone is read.

The path is probed before the first step (`check_path`: a real write of a
temporary file next to it), and tfdp never replaces or renames a file that
is not its own noise state (a directory, another file): those are refused,
naming `noise_state`. The secrets live in three places, all in the path's
folder: the file, its `.prev`, and, while a save runs, a temporary file
`.<name>.<12 hex digits>.tmp` (0600) renamed over the file. A save killed
mid-write leaves its temporary file behind; the next save or `fit` of the
same path removes it (when no other save of that folder is running, as
`tfdp.models.atomic_save` does for model files).

Example:

```python
opt = tfdp.optimizers.DPBandMF(keras.optimizers.SGD(1.0), 1.0, 1.5, bands=8,
                               noise_state="run/noise_state.npz")
model.compile(optimizer=opt, loss=...)
model.fit(dataset, epochs=10, callbacks=[keras.callbacks.BackupAndRestore("run/b")])
# killed; rerun the same lines: the backup and the noise state resume together.
```
"""

import contextlib
import hashlib
import json
import os
import re
import secrets
import struct
import tempfile
import zipfile

try:
    import fcntl
except ImportError:  # not POSIX: no lock around the renames
    fcntl = None

import numpy as np
import tensorflow as tf

from tfdp.data.fixed_order import OrderCheck
from tfdp.models.atomic_save import _saving_in

FORMAT = "tfdp.DPBandMF.noise_state"
VERSION = 3
# Version 1 (fixed order only) has no "layout" and no "groups_key"; versions
# 1 and 2 no "lineage" (they cannot show which run wrote them: a resume
# from them is refused).
READABLE_VERSIONS = (1, 2, 3)
FIXED_ORDER = "fixed_order"
CYCLIC_POISSON = "cyclic_poisson"


def fixed_order_layout(steps_per_epoch, batch_size):
    """The layout of a fixed-order stream: P batches of B records."""
    return {"order": FIXED_ORDER, "steps_per_epoch": int(steps_per_epoch),
            "batch_size": int(batch_size)}


def resolved(path):
    """The file a `noise_state` path names: the target of a symbolic link
    at the path (followed, so the state, its `.prev` and the temporary
    files stay in the target's folder, and the link stays), else the path.
    A dangling link is left as it is (refused by `check_own_files`).

    Example:

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> target = os.path.join(folder, "state.npz")
    >>> open(target, "wb").close()
    >>> os.symlink(target, os.path.join(folder, "link.npz"))
    >>> resolved(os.path.join(folder, "link.npz")) == os.path.realpath(target)
    True
    """
    if os.path.islink(path) and os.path.exists(path):
        return os.path.realpath(path)
    return path


def previous_path(path):
    """Where a save keeps the state file it replaces."""
    return str(path) + ".prev"


def lineage_matches(saved, own, step):
    """Whether a state with lineage `saved` holds the noise history of the
    model whose lineage is `own`, at model step `step`: the same stream, and
    the same fits drew its noise before `step` (a fit that began at `step`
    or later drew nothing of it).

    Example:

    >>> lineage_matches([[0, "s"], [0, "a"], [8, "b"]], [[0, "s"], [0, "a"], [8, "c"]], 8)
    True
    >>> lineage_matches([[0, "s"], [0, "a"], [8, "b"]], [[0, "s"], [0, "a"], [8, "c"]], 16)
    False
    """
    if not saved or not own or list(saved[0]) != list(own[0]):
        return False
    return _drawn_before(saved, step) == _drawn_before(own, step)


def divergence(saved, own):
    """The first model step from which two lineages of one stream that
    `lineage_matches` tells apart were drawn by different fits."""
    saved, own = [list(e) for e in saved[1:]], [list(e) for e in own[1:]]
    for theirs, mine in zip(saved, own):
        if theirs != mine:
            return min(theirs[0], mine[0])
    return (saved[len(own):] or own[len(saved):])[0][0]


def _drawn_before(lineage, step):
    return [list(entry) for entry in lineage[1:] if entry[0] < step]


def cyclic_poisson_layout(num_examples, batch_size):
    """The layout of a cyclic Poisson stream: N records, expected batch B."""
    return {"order": CYCLIC_POISSON, "num_examples": int(num_examples),
            "batch_size": float(batch_size)}


class NoiseStream:
    """A noise stream's state (a plain holder: nothing in it is tracked).

    Args:
        variables: the model's trainable variables (the noise's shapes).
        bands: b.
        start: the model step the stream started at.
        layout: its data layout (`fixed_order_layout` or
            `cyclic_poisson_layout`).
        groups_key: int64 [2], the secret key of the record groups (cyclic
            Poisson sampling), or None.
        stream_id: the id naming the stream (not secret); default random.
        strategy: the model's `tf.distribute.Strategy` when it has several
            replicas, else None. Each replica then keeps its own copy of the
            ring buffer and of the step (variables synchronized on read: a
            replica writes only its copy, a read outside the replicas gives
            the first replica's, a write there sets every copy). Every
            replica draws the same noise and runs the same recurrence, so
            the copies hold the same values (`DPBandMF.noisy_gradients`).
    """

    def __init__(self, variables, bands, start, layout, groups_key=None, stream_id=None,
                 strategy=None):
        self.bands = int(bands)
        self.start = int(start)
        self.layout = dict(layout)
        self.groups_key = None if groups_key is None else np.asarray(groups_key, np.int64)
        self.stream_id = stream_id or secrets.token_hex(8)
        self.shapes = [tuple(v.shape) for v in variables]
        self.per_replica = strategy is not None
        per_replica = dict(
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        ) if self.per_replica else {}
        with strategy.scope() if self.per_replica else contextlib.nullcontext():
            self.history = [
                tf.Variable(tf.zeros((self.bands - 1,) + shape, tf.float32), trainable=False,
                            **per_replica)
                for shape in self.shapes
            ] if self.bands > 1 else []
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, **per_replica)
        self.order_check = OrderCheck(self.layout.get("steps_per_epoch", 1))
        self.lineage = [[self.start, self.stream_id]]

    def begin_fit(self, step, token):
        """Records that a `fit` draws from model step `step` on (`token`
        names it); fits recorded at `step` or later drew nothing of the
        history there and are dropped. Returns the lineage (a copy)."""
        self.lineage = self.lineage[:1] + _drawn_before(self.lineage, step) + [[int(step), token]]
        return [list(entry) for entry in self.lineage]

    def write(self, index, value, slot):
        """Puts w_t (`value`) in ring-buffer slot `slot` of variable `index`'s
        history: in place, or, with a copy per replica (which cannot be
        updated in place), by writing the whole buffer."""
        history = self.history[index]
        if self.per_replica:
            return history.assign(tf.tensor_scatter_nd_update(
                history.read_value(), slot[None, None], value[None]))
        return history.scatter_update(tf.IndexedSlices(value[None], slot[None]))

    @property
    def steps_per_epoch(self):
        """P of a fixed order (None for cyclic Poisson sampling)."""
        return self.layout.get("steps_per_epoch")

    @property
    def batch_size(self):
        """B: the fixed order's batch size, or the expected batch size."""
        return self.layout["batch_size"]

    def model_step(self):
        """The model step the next noise draw belongs to."""
        return self.start + int(self.step.numpy())

    def matches(self, variables, bands, layout):
        """Whether this stream can continue on these variables and data."""
        return (
            [tuple(v.shape) for v in variables] == self.shapes
            and self.bands == bands
            and self.layout == layout
        )

    def reset(self, start, layout, groups_key=None, stream_id=None):
        """Starts a new stream on the same variables (zero history)."""
        self.start = int(start)
        self.layout = dict(layout)
        self.groups_key = None if groups_key is None else np.asarray(groups_key, np.int64)
        self.stream_id = stream_id or secrets.token_hex(8)
        for history in self.history:
            history.assign(tf.zeros_like(history))
        self.step.assign(0)
        self.order_check = OrderCheck(self.layout.get("steps_per_epoch", 1))
        self.lineage = [[self.start, self.stream_id]]


def save(stream, path, settings):
    """Writes `stream` to `path` atomically (a temporary file renamed), 0600.

    The file it replaces is kept as `previous_path(path)`, unless it holds
    this stream at this very step (a save at an epoch's end and at the end of
    training): then the previous one stays. Refuses (`check_own_files`) to
    replace or rename a file that is not a noise state.

    Args:
        stream: the `NoiseStream`.
        path: the file (".npz" is appended by NumPy if missing: give it).
        settings: dict of the optimizer's privacy settings, stored to be
            checked on load.
    """
    path = resolved(path)
    fingerprints, recorded = stream.order_check.state()
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "stream_id": stream.stream_id,
        "lineage": stream.lineage,
        "start": stream.start,
        "steps": int(stream.step.numpy()),
        "steps_per_epoch": stream.steps_per_epoch,
        "batch_size": stream.batch_size,
        "layout": stream.layout,
        "groups_key": None if stream.groups_key is None else [int(w) for w in stream.groups_key],
        "recorded_positions": recorded,
        "settings": settings,
    }
    arrays = {f"history_{i}": h.numpy() for i, h in enumerate(stream.history)}
    arrays["fingerprints"] = fingerprints
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), np.uint8)
    check_own_files(path)

    def write(file):
        np.savez(file, **arrays)

    def replace(temporary):
        # Workers that share the path save the same moment at once: the check
        # and the two renames are one step, or one worker's .prev could be
        # the other's file of that very moment.
        with _renames_of(path):
            if os.path.lexists(path) and not _same_moment(path, meta):
                os.replace(path, previous_path(path))
            os.replace(temporary, path)

    _write_beside(path, write, replace)


def check_path(path):
    """Probes the `noise_state` path before the first step: refuses an empty
    path, a directory or a file that is not tfdp's own noise state (at the
    path or its `.prev`), and a folder where a real write fails; removes
    the temporary files of killed saves of this path.

    Raises:
        ValueError or OSError, naming `noise_state`.

    Example:

    >>> import os, tempfile
    >>> check_path(os.path.join(tempfile.mkdtemp(), "noise_state.npz"))
    >>> check_path(tempfile.mkdtemp())
    Traceback (most recent call last):
    ...
    ValueError: The noise_state path '...' is a directory: ...
    """
    if not path:
        raise ValueError(
            "Expected `noise_state` to be the path of a file (tfdp writes the secret noise "
            f"state there). Received: noise_state={path!r}"
        )
    path = resolved(path)
    check_own_files(path)
    finish_interrupted_save(path)

    def write(file):
        file.write(b"tfdp noise_state probe")

    _write_beside(path, write, os.remove)


def finish_interrupted_save(path):
    """Completes a save killed between its two renames: no file at `path`,
    its `.prev` in place, and the new state whole in the save's temporary
    file (written and flushed before the renames). That file is renamed to
    `path`, as the save would have; a rerun then resumes from whichever of
    the two is at the model's step (`DPBandMF`). Done only when no other save
    of the folder runs and exactly one temporary file of `path` is a
    readable noise state; otherwise the leftovers are removed as before and
    the `.prev` alone is read.

    Returns:
        True when it renamed a temporary file to `path`.
    """
    if os.path.lexists(path) or not os.path.isfile(previous_path(path)) or fcntl is None:
        return False
    folder, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(f".{name}.") + "[0-9a-f]{12}" + re.escape(".tmp"))
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other save of this folder
        complete = []
        for entry in sorted(os.listdir(folder)):
            candidate = os.path.join(folder, entry)
            if pattern.fullmatch(entry) and os.path.isfile(candidate):
                try:
                    load(candidate)
                except ValueError:
                    continue  # cut short: a leftover, removed by the probe
                complete.append(candidate)
        if len(complete) != 1:
            return False
        with _renames_of(path):
            if os.path.lexists(path):
                return False
            os.replace(complete[0], path)
        return True
    except OSError:
        return False
    finally:
        os.close(handle)


def check_own_files(path):
    """Refuses `path` or its `.prev` where either is a directory or a file
    that is not a readable noise state: tfdp replaces and renames only its
    own files."""
    for candidate in (path, previous_path(path)):
        if os.path.isdir(candidate):
            raise ValueError(
                f"The noise_state path {candidate!r} is a directory: tfdp writes the noise "
                "state to a file (and keeps the one it replaces as <file>.prev), and never "
                "replaces or renames anything that is not its own. Give noise_state a file "
                f"path, for instance {os.path.join(path, 'noise_state.npz')!r}. Training was "
                f"not started or stopped before the next step. Received: noise_state={path!r}"
            )
        if os.path.lexists(candidate) and not os.path.isfile(candidate):
            raise ValueError(
                f"The noise_state path {candidate!r} exists and is not a regular file (a "
                "FIFO, a device, a socket or a broken link): reading it could block or read "
                "another program's data, and tfdp never replaces anything that is not its "
                "own. Choose another noise_state path. Training was not started or stopped "
                f"before the next step. Received: noise_state={path!r}"
            )
        if os.path.lexists(candidate):
            try:
                load(candidate)
            except ValueError as error:
                raise ValueError(
                    f"The file {candidate!r} is not a DP-BandMF noise state that tfdp can read "
                    f"({error}), and tfdp never replaces or renames a file that is not its "
                    "own. Move it away or choose another noise_state path (a damaged noise "
                    "state cannot resume its stream: DPBandMF(..., "
                    "fresh_noise_history=True) starts a new one). Received: "
                    f"noise_state={path!r}"
                ) from error


@contextlib.contextmanager
def _renames_of(path):
    """Holds an exclusive lock, among this machine's processes, for renaming
    `path` and its `.prev`: a lock file in the temporary folder named by the
    path's hash (none in the state's own folder). Best effort: without
    `fcntl` or a writable temporary folder, nothing is held."""
    if fcntl is None:
        yield
        return
    name = hashlib.sha256(os.path.abspath(path).encode("utf-8")).hexdigest()[:32]
    try:
        handle = os.open(os.path.join(tempfile.gettempdir(), f"tfdp-noise-state-{name}.lock"),
                         os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


def _write_beside(path, write, finish):
    """Writes a temporary file (0600) in `path`'s folder with `write(file)`,
    flushed to disk, then calls `finish(temporary)`; removes the temporary
    file if it is left, and the leftovers of killed writes first. An OSError
    is raised again naming `noise_state`."""
    folder, name = os.path.split(os.path.abspath(path))
    temporary = None
    try:
        os.makedirs(folder, exist_ok=True)
        with _saving_in(folder, name, ""):
            for _ in range(100):
                temporary = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
                try:
                    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    break
                except FileExistsError:
                    continue
            try:
                os.fchmod(handle, 0o600)
                with os.fdopen(handle, "wb") as file:
                    write(file)
                    file.flush()
                    os.fsync(file.fileno())
                finish(temporary)
            finally:
                if os.path.exists(temporary):
                    os.remove(temporary)
    except OSError as error:
        raise OSError(
            error.errno,
            f"The noise_state path {path!r} cannot be written ({error.strerror or error}"
            f"{'' if error.filename is None else ': ' + str(error.filename)}). The secret "
            "DP-BandMF noise state must be written at each epoch's end; give noise_state a "
            f"file path in a folder this process can write. Received: noise_state={path!r}",
        ) from error


def _same_moment(path, meta):
    """Whether the state file at `path` is this stream at this step."""
    try:
        saved, _, _ = load(path)
    except ValueError:
        return False
    return (saved.get("stream_id"), saved.get("steps")) == (meta["stream_id"], meta["steps"])


def load(path):
    """Reads a noise state file: (meta dict, list of history arrays, fingerprints).

    Raises:
        ValueError: if the file is not a DP-BandMF noise state (the message
            names the file).
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(bytes(data["meta"]).decode("utf-8"))
            count = sum(1 for key in data.files if key.startswith("history_"))
            history = [data[f"history_{i}"] for i in range(count)]
            fingerprints = data["fingerprints"]
    except (OSError, KeyError, ValueError, UnicodeDecodeError, EOFError, zipfile.BadZipFile,
            struct.error, NotImplementedError) as error:
        # empty (EOFError), truncated or bit-flipped (BadZipFile: a bad CRC-32)
        raise ValueError(
            f"Cannot read the DP-BandMF noise state {path!r} (empty, truncated, altered or "
            f"not a noise state: {type(error).__name__}: {error}). Received: "
            f"noise_state={path!r}"
        ) from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or (
            meta.get("version") not in READABLE_VERSIONS):
        raise ValueError(
            f"{path!r} is not a DP-BandMF noise state file ({FORMAT} version {VERSION}). "
            f"Received: noise_state={path!r}"
        )
    if "layout" not in meta:
        meta["layout"] = fixed_order_layout(meta["steps_per_epoch"], meta["batch_size"])
    return meta, history, fingerprints


def restore(stream, meta, history, fingerprints):
    """Puts a loaded state into `stream` (shapes already checked)."""
    stream.start = int(meta["start"])
    stream.stream_id = meta["stream_id"]
    stream.lineage = [[int(step), str(token)] for step, token in meta["lineage"]]
    groups_key = meta.get("groups_key")
    stream.groups_key = None if groups_key is None else np.asarray(groups_key, np.int64)
    for variable, value in zip(stream.history, history):
        variable.assign(value)
    stream.step.assign(int(meta["steps"]))
    stream.order_check = OrderCheck(
        stream.layout.get("steps_per_epoch", 1), fingerprints, meta["recorded_positions"]
    )
