"""Single-bit flips of saved privacy records are refused, never read as a
smaller charge (issue 55, item 1).

The fault round found 42 of 5,576 journal flips and 1 of 400 ledger flips
read back as a smaller epsilon, since only the step count was cross-checked.
Every journal line and every saved ledger now carries its SHA-256
(`tfdp.accounting.integrity`): each flip here is refused (ValueError or, for
HDF5 structure, OSError) or reads back the very same record.
"""

import json
import os

import keras
import numpy as np
import pytest

import tfdp
from tfdp.accounting import PrivacyLedger, dpsgd_event, event_to_dict
from tfdp.accounting.integrity import UncheckedRecordWarning
from tests.faults.ledger_files import read_ledger, rewrite_ledger, rewrite_ledger_in_archive

EVENT = dpsgd_event(1.1, 0.01)


def flipped(data, bit):
    data = bytearray(data)
    data[bit // 8] ^= 1 << (bit % 8)
    return bytes(data)


def sample_ledger():
    ledger = PrivacyLedger()
    ledger.begin_steps(dpsgd_event(0.9, 0.02))
    ledger.advance(40)
    ledger.begin_steps(EVENT, steps_per_round=4, relation="zero_out")
    ledger.advance(12)
    ledger.record(EVENT, count=3)
    return ledger


def test_every_bit_flip_of_a_ledger_is_refused_or_reads_the_same_ledger():
    ledger = sample_ledger()
    text = ledger.to_json().encode("utf-8")
    content = json.loads(text)
    refused = 0
    for bit in range(len(text) * 8):
        try:
            restored = PrivacyLedger.from_json(flipped(text, bit))
        except ValueError:
            refused += 1
            continue
        # Read back: the same content (e.g. "1e-05" -> "1E-05"), so the same charge.
        assert json.loads(restored.to_json()) == content, bit
    assert refused > 0.99 * len(text) * 8


def test_a_ledger_without_its_checksum_warns_and_a_renamed_checksum_is_refused():
    data = json.loads(sample_ledger().to_json())
    checksum = data.pop("sha256")
    with pytest.warns(UncheckedRecordWarning, match="without a checksum"):
        PrivacyLedger.from_json(json.dumps(data))  # saved by an earlier tfdp
    data["sha257"] = checksum  # a flipped key name is not an old ledger
    with pytest.raises(ValueError, match="Corrupt privacy ledger: unknown key"):
        PrivacyLedger.from_json(json.dumps(data))


def test_an_edited_ledger_is_refused_by_its_checksum():
    data = json.loads(sample_ledger().to_json())
    data["records"][0]["count"] = 1  # well formed, a smaller charge
    with pytest.raises(ValueError, match="checksum does not match"):
        PrivacyLedger.from_json(json.dumps(data))


def journal_with_two_entries(path):
    journal = tfdp.callbacks.PrivacyJournal(str(path))
    journal._append({"start": 0, "end": 40, "event": event_to_dict(dpsgd_event(0.9, 0.02))})
    journal._append({"start": 40, "end": 52, "event": event_to_dict(EVENT),
                     "steps_per_round": 4, "relation": "zero_out", "segment_start": 40})
    return journal


def test_every_bit_flip_of_a_journal_is_refused_or_reads_the_same_entries(tmp_path):
    path = tmp_path / "journal.jsonl"
    journal = journal_with_two_entries(path)
    original = path.read_bytes()
    entries = journal.entries()
    header = original.index(b"\n") + 1
    refused = 0
    bits = range(header * 8, len(original) * 8, 5)  # a fifth of both lines' bits, every bit position
    for bit in bits:
        path.write_bytes(flipped(original, bit))
        try:
            read = journal.entries()
        except ValueError:
            refused += 1
            continue
        assert read == entries, bit
    assert refused > 0.99 * len(bits)


def test_a_flipped_header_cannot_hide_a_line(tmp_path):
    """"version": 3 -> 2 or 1 makes an earlier journal's header: its lines
    still carry checksums, and are checked."""
    path = tmp_path / "journal.jsonl"
    journal = journal_with_two_entries(path)
    original = path.read_bytes()
    entries = journal.entries()
    for bit in range(original.index(b"\n") * 8):
        path.write_bytes(flipped(original, bit))
        try:
            read = journal.entries()
        except ValueError:
            continue
        assert read == entries, bit


def test_a_journal_line_without_its_checksum(tmp_path):
    path = tmp_path / "journal.jsonl"
    entry = {"start": 0, "end": 4, "event": event_to_dict(EVENT)}
    journal = tfdp.callbacks.PrivacyJournal(str(path))
    for version in (1, 2):  # an earlier tfdp's journal: read, with a warning
        path.write_text(json.dumps({"format": journal.FORMAT, "version": version}) + "\n"
                        + json.dumps(entry) + "\n")
        with pytest.warns(UncheckedRecordWarning, match=r"journal.jsonl.* 1 line\(s\) without a checksum"):
            assert journal.entries() == [entry]
    path.write_text(json.dumps({"format": journal.FORMAT, "version": 3}) + "\n"
                    + json.dumps(entry) + "\n")
    with pytest.raises(ValueError, match=r"journal.jsonl.*line 2 has no checksum"):
        journal.entries()


def test_a_damaged_newline_cannot_pass_a_whole_line_as_torn(tmp_path):
    path = tmp_path / "journal.jsonl"
    journal = journal_with_two_entries(path)
    data = path.read_bytes()
    for byte in (b"\x8a", b"*", b"\x0b"):
        path.write_bytes(data[:-1] + byte)
        with pytest.raises(ValueError, match="complete entry followed by other bytes"):
            journal.entries()
    path.write_bytes(data[:-30])  # a write cut short: ignored, as before
    assert len(journal.entries()) == 1


# -- the ledger inside a weights file ------------------------------------------


def build():
    model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="mse")
    return model


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    model = build()
    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    model.fit(x, x[:, :2], batch_size=8, epochs=1, steps_per_epoch=3, verbose=0)
    path = tmp_path_factory.mktemp("weights") / "model.weights.h5"
    model.save_weights(path)
    return path, json.loads(model.privacy.to_json())


def test_bit_flips_of_the_ledger_inside_a_weights_file_are_refused_naming_it(weights_file, tmp_path):
    path, ledger = weights_file
    data = path.read_bytes()
    start = data.index(b'{"format": "tfdp.PrivacyLedger"')
    end = data.index(b"}", data.index(b'"sha256"', start)) + 1
    model = build()
    model.build((None, 3))
    damaged = tmp_path / "damaged.weights.h5"
    for bit in range(start * 8, end * 8, 29):  # a sample: every 29th bit
        damaged.write_bytes(flipped(data, bit))
        try:
            model.load_weights(damaged)
        except ValueError as error:
            assert "damaged.weights.h5" in str(error)
            continue
        assert json.loads(model.privacy.to_json()) == ledger, bit


def test_an_edited_ledger_inside_a_weights_file_is_refused(weights_file, tmp_path):
    path, _ = weights_file
    damaged = tmp_path / "edited.weights.h5"
    damaged.write_bytes(path.read_bytes())
    before = read_ledger(damaged)
    rewrite_ledger(damaged, lambda t: t.replace(b'"sampling_probability": 0.5',
                                                b'"sampling_probability": 0.4'))
    assert read_ledger(damaged) != before
    model = build()
    model.build((None, 3))
    with pytest.raises(ValueError, match=f"(?s){os.path.basename(damaged)}.*checksum does not match"):
        model.load_weights(damaged)


def test_an_edited_ledger_inside_a_keras_file_is_refused_naming_it(weights_file, tmp_path):
    path, _ = weights_file
    model = build()
    model.load_weights(path)
    model.save(tmp_path / "model.keras")
    rewrite_ledger_in_archive(tmp_path / "model.keras", tmp_path / "edited.keras",
                              lambda t: t.replace(b'"steps": 3', b'"steps": 2'),
                              tmp_path / "model.weights.h5")
    with pytest.raises(ValueError, match=r"(?s)edited\.keras.*checksum does not match"):
        tfdp.load_model(tmp_path / "edited.keras")
