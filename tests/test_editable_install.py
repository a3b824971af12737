"""`pip install -e .` works for a script beside a clone named `tfdp`.

`git clone ... tfdp` makes a folder `tfdp/` (the clone) holding the package
`tfdp/tfdp/`. A script written beside the clone has that folder on
`sys.path[0]`. Setuptools' default editable install for a flat layout is an
import hook appended to `sys.meta_path`, which Python asks only after its
path search has answered: the path search finds `./tfdp/` (no
`__init__.py`) and imports it as an empty namespace package, so
`tfdp.DPSequential` raised "module 'tfdp' has no attribute 'DPSequential'".
setup.cfg's `package_dir = =.` makes the editable install a path entry (a
`.pth` line naming the clone), so the path search finds the regular package
`tfdp/tfdp/__init__.py` there, which wins over a namespace folder found on
an earlier entry.

The test builds the editable wheel as pip does (setuptools' PEP 660 hook),
from a copy of this checkout in a folder named `tfdp`, installs it in a
private site directory, and runs a script beside the clone.
"""

import pathlib
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = """\
import site
import sys

site.addsitedir(sys.argv[1])        # the editable install, its .pth processed
sys.path.extend(sys.argv[2:])       # TensorFlow, Keras: the environment's packages
import tfdp
import keras

print(tfdp.__file__)
model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(1)])
print(type(model).__name__)
"""


def test_script_beside_a_clone_named_tfdp_imports_the_package(tmp_path):
    clone = tmp_path / "tfdp"
    clone.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, clone / name)
    shutil.copytree(ROOT / "tfdp", clone / "tfdp", ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build = subprocess.run(
        [sys.executable, "-c",
         f"from setuptools import build_meta; print(build_meta.build_editable({str(wheels)!r}))"],
        cwd=clone, capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    site_dir = tmp_path / "site"
    with zipfile.ZipFile(wheels / build.stdout.strip().splitlines()[-1]) as wheel:
        wheel.extractall(site_dir)
    (tmp_path / "script.py").write_text(SCRIPT)

    # -S: no site-packages .pth files, so an install of tfdp already in this
    # environment cannot answer in place of the one under test.
    run = subprocess.run(
        [sys.executable, "-S", "script.py", str(site_dir), *site.getsitepackages()],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert run.returncode == 0, textwrap.indent(run.stderr[-3000:], "    ")
    path, name = run.stdout.split()[-2:]
    assert pathlib.Path(path) == clone / "tfdp" / "__init__.py"
    assert name == "DPSequential"
