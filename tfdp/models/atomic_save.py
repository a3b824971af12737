"""Saving a file so that a crash never destroys the one it replaces.

Keras writes `model.save(path)` (and `ModelCheckpoint`) in place: a process
killed mid-write leaves a truncated `.keras` file where a good checkpoint
was, and `PrivacyJournal.recover` then has nothing to resume from. tfdp's
models write to a temporary file in the same folder, flush it to disk and
rename it over the target (`os.replace` is atomic on one file system): the
target is always either the old file or the new one.

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

import os
import tempfile

# Keras checks the file name's ending, so the temporary file keeps it.
_ENDINGS = (".weights.h5", ".weights.json", ".keras", ".h5", ".hdf5")


def is_local_path(filepath):
    """True for a path on this machine's file system (not gs://, s3://, ...)."""
    return isinstance(filepath, (str, os.PathLike)) and "://" not in os.fspath(filepath)


def atomic_write(filepath, write):
    """Calls `write(tmp_path)`, then renames `tmp_path` over `filepath`.

    Args:
        filepath: the target, a local path.
        write: a function writing the whole file at the path it is given.
    """
    path = os.path.abspath(os.fspath(filepath))
    folder, name = os.path.split(path)
    ending = next((e for e in _ENDINGS if name.endswith(e)), os.path.splitext(name)[1])
    handle, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=f".tmp{ending}", dir=folder)
    os.close(handle)
    try:
        write(tmp)
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
