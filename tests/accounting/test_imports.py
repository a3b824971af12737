"""tfdp.accounting must load without TensorFlow or Keras (the CLI relies on it)."""

import pathlib
import subprocess
import sys
import textwrap

import tfdp.accounting

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[2] / "tfdp"


def test_accounting_imports_neither_tensorflow_nor_keras():
    # Load tfdp.accounting under an empty stand-in for the tfdp package, so
    # that only the accounting modules (and what they import) are loaded.
    code = textwrap.dedent(
        f"""
        import sys, types
        package = types.ModuleType("tfdp")
        package.__path__ = [{str(PACKAGE_ROOT)!r}]
        sys.modules["tfdp"] = package
        import tfdp.accounting
        assert tfdp.accounting.compute_epsilon(1.0, 0.1, 10, 1e-5) > 0
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras", "tf_keras"))
        print(",".join(heavy))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"tfdp.accounting imported: {result.stdout.strip()}"


def test_public_names():
    assert sorted(tfdp.accounting.__all__) == sorted(
        [
            "LargeDeltaWarning",
            "PrivacyLedger",
            "bandmf",
            "dpsgd_event",
            "event_to_dict",
            "event_from_dict",
            "compute_epsilon",
            "compute_dpsgd_epsilon",
            "calibrate_noise_multiplier",
            "calibrate_dpsgd",
            "privacy_statement",
        ]
    )
    for name in tfdp.accounting.__all__:
        assert getattr(tfdp.accounting, name).__doc__
