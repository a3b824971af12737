"""Checksums of saved privacy records: a damaged record is refused.

A privacy ledger's JSON (`PrivacyLedger.to_json`, saved in every weights
file) and every line of a `tfdp.callbacks.PrivacyJournal` carry "sha256",
the SHA-256 of their canonical content (the JSON object without that key,
keys sorted, no spaces). A single flipped bit anywhere changes the content
(its hash no longer matches), the hash (it no longer matches the content),
the key's name (an unknown key is refused), or breaks the JSON: none is
read as another, smaller charge, which a check of the step count alone let
through.

Records written before checksums (tfdp's earlier files) have no "sha256"
and are read with a warning (`UncheckedRecordWarning`): refusing them would
strand a run's privacy record, and a flip cannot turn a sealed record into
one without its key.

Example:

>>> sealed = seal({"steps": 4})
>>> sorted(sealed)
['sha256', 'steps']
>>> unseal(dict(sealed), "a ledger")
{'steps': 4}
>>> unseal(dict(sealed, steps=3), "a ledger")
Traceback (most recent call last):
...
ValueError: a ledger: its SHA-256 checksum does not match its content ...
"""

import hashlib
import json

KEY = "sha256"


class UncheckedRecordWarning(UserWarning):
    """A privacy record written before checksums was read unchecked."""


def digest(data):
    """The SHA-256 (hex) of `data`'s canonical JSON."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def seal(data):
    """`data` (a dict) with its checksum added under "sha256"."""
    return dict(data, **{KEY: digest(data)})


def unseal(data, where):
    """`data` without its checksum, after checking it.

    Args:
        data: a dict read from JSON.
        where: names the record in the error ("Corrupt privacy ledger ...").

    Returns:
        `data` without "sha256", or None when it has none (an old record:
        the caller decides).

    Raises:
        ValueError: the checksum is not a 64-digit hex string or does not
            match the content.
    """
    if KEY not in data:
        return None
    content = {key: value for key, value in data.items() if key != KEY}
    claimed = data[KEY]
    if not isinstance(claimed, str) or claimed != digest(content):
        raise ValueError(
            f"{where}: its SHA-256 checksum does not match its content (the saved record "
            "was altered or damaged, for instance a flipped bit on disk); tfdp refuses a "
            "privacy record it cannot trust, since it could under-count the privacy spent."
        )
    return content
