"""Edits of the privacy ledger inside saved files, shared by the fault tests.

A weights file (`.weights.h5`) holds the ledger as bytes at
`vars/privacy_ledger`; a `.keras` archive holds such a weights file. The
tests damage, edit or re-seal it there and check that loading refuses it.
"""

import json
import zipfile

import h5py
import numpy as np

from tfdp.accounting.integrity import seal

LEDGER = "vars/privacy_ledger"


def read_ledger(path):
    """The ledger's bytes in the weights file at `path`."""
    with h5py.File(path, "r") as file:
        return bytes(np.asarray(file[LEDGER]))


def rewrite_ledger(path, transform):
    """Replaces the ledger in the weights file at `path` by `transform(bytes)`."""
    with h5py.File(path, "r+") as file:
        text = bytes(np.asarray(file[LEDGER]))
        del file[LEDGER]
        file[LEDGER] = np.frombuffer(transform(text), dtype=np.uint8)


def rewrite_ledger_in_archive(source, target, transform, scratch):
    """Copies the `.keras` archive `source` to `target` with the ledger of its
    weights file replaced by `transform(bytes)` (the zip itself intact);
    `scratch` is a path for the weights file while it is edited."""
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(target, "w") as edited:
        for item in original.infolist():
            content = original.read(item)
            if item.filename == "model.weights.h5":
                scratch.write_bytes(content)
                rewrite_ledger(scratch, transform)
                content = scratch.read_bytes()
            edited.writestr(item, content)


def resealed(text, **changes):
    """The ledger JSON with `changes`, sealed again (a well-formed record)."""
    data = json.loads(text)
    del data["sha256"]
    return json.dumps(seal(dict(data, **changes))).encode("utf-8")
