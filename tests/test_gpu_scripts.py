"""The GPU machine's scripts (benchmarks/gpu): they parse, `receive` takes
the carried parts out of the working tree, and `install` refuses parts
whose digests do not match before unpacking anything (a part lost or cut
in transfer would otherwise fail deep inside TensorFlow's import)."""

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "benchmarks" / "gpu"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.mark.parametrize("script", ["pack.sh", "device.sh"])
def test_the_scripts_parse(script):
    subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)


def _tree_with_parts(tmp_path, parts):
    """A copy of the scripts in a fresh tree whose .gpu/ holds `parts` and
    their digests; the device's store and site under tmp_path."""
    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True)
    shutil.copytree(SCRIPTS, tree / "benchmarks" / "gpu")
    (tree / ".gpu").mkdir()
    digests = []
    for name, data in parts.items():
        (tree / ".gpu" / name).write_bytes(data)
        digests.append(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    (tree / ".gpu" / "parts.sha256").write_text("".join(digests))
    env = {**os.environ, "TFDP_GPU_STORE": str(tmp_path / "store"),
           "TFDP_GPU_SITE": str(tmp_path / "site"), "OUT": str(tmp_path / "out")}
    return tree, env


def _device(tree, env, *steps):
    return subprocess.run(["bash", str(tree / "benchmarks" / "gpu" / "device.sh"), *steps],
                          env=env, capture_output=True, text=True)


def test_receive_moves_the_parts_out_of_the_tree(tmp_path):
    tree, env = _tree_with_parts(tmp_path, {"part00": b"a" * 10, "part01": b"b" * 10})
    done = _device(tree, env, "receive")
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path / "store" / "parts")) == ["part00", "part01", "parts.sha256"]
    assert os.listdir(tree / ".gpu") == []


def test_install_refuses_a_damaged_part_before_unpacking(tmp_path):
    tree, env = _tree_with_parts(tmp_path, {"part00": b"a" * 10, "part01": b"b" * 10})
    (tree / ".gpu" / "part01").write_bytes(b"c" * 10)  # changed after its digest
    done = _device(tree, env, "receive", "install")
    assert done.returncode == 1
    assert "parts damaged or missing" in done.stdout
    assert not (tmp_path / "site").exists()  # nothing unpacked


def test_unknown_steps_are_named(tmp_path):
    tree, env = _tree_with_parts(tmp_path, {})
    done = _device(tree, env, "benchmark")
    assert done.returncode == 2
    assert "unknown step: benchmark" in done.stdout
