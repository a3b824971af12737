"""Every install instruction in the repository works as written.

tfdp is installed from its checkout (`pip install -e .` in the repository
root), not from a package index, so `pip install tfdp`, `pip install
'tfdp[hub]'` or `pip install tfdp[examples]` fail for a reader who copies
them: each must name the checkout, e.g. `pip install -e ".[hub]"`.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ["tfdp", "examples", "tests", "benchmarks", "docs", ".ci", "setup.cfg", "pyproject.toml"]
FROM_AN_INDEX = re.compile(r"""pip3? install\s+(?:-\w+\s+)*['"]?tfdp\b""")


def text_files():
    for name in SCANNED:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
        for file in files:
            if file.is_file() and file.suffix in (".py", ".md", ".cfg", ".toml", ".txt", ".sh", ""):
                yield file


def test_no_install_string_asks_an_index_for_tfdp():
    found = [
        f"{file.relative_to(ROOT)}:{number}: {line.strip()}"
        for file in text_files()
        for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1)
        if FROM_AN_INDEX.search(line) and file.name != "test_install_strings.py"
    ]
    assert found == []


def test_the_pattern_finds_what_fails_and_passes_what_works():
    """Controls for the pattern itself."""
    for failing in ("pip install 'tfdp[hub]'", "pip install tfdp[examples]", "pip install -q tfdp"):
        assert FROM_AN_INDEX.search(failing), failing
    for working in ('pip install -e ".[hub]"', "pip install -e '.[test]'",
                    'python3 -m pip install -q -e ".[test]"'):
        assert not FROM_AN_INDEX.search(working), working
