"""`keras.models.load_model` reads a file tfdp saved, in a fresh process,
after a plain `import tfdp`, whatever the order of the imports.

`import tfdp` loads no Keras (the accountant commands stay fast), so tfdp's
Keras classes ("tfdp>DPSequential", "tfdp>DPSGD", ...) are registered when
Keras is imported (tfdp/_keras_registration.py). Each check runs in a fresh
process: in this one the classes are long registered.
"""

import pathlib
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import tfdp

ROOT = pathlib.Path(tfdp.__file__).resolve().parents[1]

# Prints the loaded model's class, its optimizer's class and its ledger's steps.
LOAD = "m = keras.models.load_model(PATH); print(type(m).__name__, type(m.optimizer).__name__, m.privacy.steps)"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    model.fit(rng.random((16, 4), dtype=np.float32), rng.integers(0, 2, 16), batch_size=8,
              epochs=1, verbose=0)
    path = tmp_path_factory.mktemp("saved") / "private.keras"
    model.save(path)
    return str(path), model.privacy.steps


def run_python(code, path):
    code = f"PATH = {path!r}\n" + textwrap.dedent(code)
    env_code = "import os; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\n"
    return subprocess.run([sys.executable, "-c", env_code + code], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


def test_import_tfdp_then_keras_loads_the_file_and_registers_every_class(saved):
    path, steps = saved
    result = run_python(
        f"""
        import tfdp
        import keras
        {LOAD}
        registered = sorted(k for k in keras.saving.get_custom_objects() if k.startswith("tfdp>"))
        # Every module of tfdp imported: no class registers that was missing above.
        import importlib, pkgutil
        for info in pkgutil.walk_packages(tfdp.__path__, "tfdp."):
            if not info.name.endswith(".keras_hub"):
                importlib.import_module(info.name)
        everything = sorted(k for k in keras.saving.get_custom_objects() if k.startswith("tfdp>"))
        print(registered == everything, len(everything))
        """,
        path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.split("\n")
    assert lines[0].split() == ["DPSequential", "DPSGD", str(steps)]
    complete, count = lines[1].split()
    assert complete == "True" and int(count) >= 8  # DPModel, DPSequential, 6 optimizers, ...


@pytest.mark.parametrize("imports", [
    "import keras\nimport tfdp",  # Keras first: tfdp registers at once
    "import tfdp\nimport tensorflow as tf\nimport keras",  # TensorFlow imports Keras itself
    "from tfdp.models import DPModel\nimport keras",  # Keras imported by tfdp's own import
])
def test_any_import_order_loads_the_file(saved, imports):
    path, steps = saved
    result = run_python(f"{imports}\n{LOAD}", path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["DPSequential", "DPSGD", str(steps)]
