"""Every Example in tfdp's docstrings runs and gives what it shows.

The modules are discovered (the package face, mechanisms, models, optimizers,
callbacks, recipes, training, ...), so a new module's examples are run too.
"""

import doctest
import importlib
import pkgutil

import pytest

import tfdp

MODULES = ["tfdp"] + sorted(info.name for info in pkgutil.walk_packages(tfdp.__path__, "tfdp."))


def test_the_examples_of_every_area_are_collected():
    for area in ("accounting", "auditing", "data", "mechanisms", "models", "optimizers",
                 "callbacks", "recipes", "training"):
        assert any(name.startswith(f"tfdp.{area}") for name in MODULES), area


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if name.endswith(".keras_hub"):  # the optional extra (CI installs it)
        pytest.importorskip("keras_hub")
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_a_wrong_example_fails(tmp_path, monkeypatch):
    """Negative control: an Example whose output is wrong is reported as failed."""
    (tmp_path / "wrong_example.py").write_text('"""\n>>> 1 + 1\n3\n"""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    result = doctest.testmod(importlib.import_module("wrong_example"), report=False)
    assert result == (1, 1)
