"""Saving a file so that a crash never destroys the one it replaces.

Keras writes `model.save(path)` (and `ModelCheckpoint`) in place: a process
killed mid-write leaves a truncated `.keras` file where a good checkpoint
was, and `PrivacyJournal.recover` then has nothing to resume from. tfdp's
models write to a temporary file in the same folder, flush it to disk and
rename it over the target (`os.replace` is atomic on one file system): the
target is always either the old file or the new one. The new file gets the
permissions a plain Keras save gives it: the old file's mode when it
replaces one, else 0o666 less the umask (`tempfile.mkstemp` alone would
leave 0o600, unreadable by a serving process of another user or group).

A process killed mid-save leaves its temporary file (`.<name>.<hex>.tmp<ending>`)
behind. The next save of the same path removes those of that path, when no
other save is running in the folder: every save holds a shared `flock` on
the folder while it writes, and the removal takes it exclusively first (so
a save of another process is never disturbed; with a save running, the
leftovers wait for a later save). Other files are never touched.

Example:

>>> import os, tempfile
>>> folder = tempfile.mkdtemp()
>>> path = os.path.join(folder, "model.keras")
>>> def write(tmp):
...     with open(tmp, "w") as f:
...         f.write("new")
>>> atomic_write(path, write)
>>> open(path).read(), sorted(os.listdir(folder))
('new', ['model.keras'])
"""

import contextlib
import os
import re
import secrets
import stat

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so leftovers are left in place
    fcntl = None

# Keras checks the file name's ending, so the temporary file keeps it.
_ENDINGS = (".weights.h5", ".weights.json", ".keras", ".h5", ".hdf5")


def is_local_path(filepath):
    """True for a path on this machine's file system (not gs://, s3://, ...)."""
    return isinstance(filepath, (str, os.PathLike)) and "://" not in os.fspath(filepath)


def _create_temporary(folder, prefix, suffix):
    """Creates a new empty file in `folder` and returns its path.

    Opened with mode 0o666, so the kernel applies the umask (or the folder's
    default ACL) as for any new file; `tempfile.mkstemp` uses 0o600.
    """
    for _ in range(100):
        tmp = os.path.join(folder, f"{prefix}{secrets.token_hex(6)}{suffix}")
        try:
            handle = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(handle)
        return tmp
    raise FileExistsError(f"No free temporary file name in {folder} for {prefix}*{suffix}")


def _remove_leftovers(folder, name, ending):
    """Removes tfdp's temporary files of saves of `folder/name` (call it
    holding the folder's exclusive lock: they are then all leftovers)."""
    pattern = re.compile(re.escape(f".{name}.") + "[0-9a-f]{12}" + re.escape(f".tmp{ending}"))
    for entry in os.listdir(folder):
        if pattern.fullmatch(entry):
            os.remove(os.path.join(folder, entry))


@contextlib.contextmanager
def _saving_in(folder, name, ending):
    """Holds a shared lock on `folder` while a save of `name` runs, after
    removing that name's leftovers if no other save holds the lock.

    Best effort: where the folder cannot be locked (no `fcntl`, a file
    system without `flock` on folders) or a leftover cannot be removed, the
    save runs as without this."""
    if fcntl is None:
        yield
        return
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _remove_leftovers(folder, name, ending)
        except OSError:  # another save is running here, or no locks or rights
            pass
        try:
            fcntl.flock(handle, fcntl.LOCK_SH)
        except OSError:
            pass
        yield
    finally:
        os.close(handle)


def atomic_write(filepath, write):
    """Calls `write(tmp_path)`, then renames `tmp_path` over `filepath`.

    The result has the replaced file's mode, or a new file's (0o666 less the
    umask) when there was none.

    Args:
        filepath: the target, a local path.
        write: a function writing the whole file at the path it is given.
    """
    path = os.path.abspath(os.fspath(filepath))
    folder, name = os.path.split(path)
    ending = next((e for e in _ENDINGS if name.endswith(e)), os.path.splitext(name)[1])
    with _saving_in(folder, name, ending):
        tmp = _create_temporary(folder, f".{name}.", f".tmp{ending}")
        try:
            write(tmp)
            try:
                os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
            except FileNotFoundError:
                pass  # a new file: it keeps the mode it was created with
            with open(tmp, "rb") as written:
                os.fsync(written.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
