"""Every Example in tfdp's docstrings runs and gives what it shows.

The modules are discovered (the package face, mechanisms, models, optimizers,
callbacks, recipes, training, ...), so a new module's examples are run too.
"""

import doctest
import importlib
import inspect
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
    run_examples(importlib.import_module(name))


def run_examples(module):
    """Runs a module's Examples; asserts none failed and every one in its source ran."""
    lines = (line.lstrip() for line in inspect.getsource(module).splitlines())
    written = sum(1 for line in lines if line.startswith(">>>") and not line.startswith(">>> #")
                  and "doctest: +SKIP" not in line)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted == written, (module.__name__, result.attempted, written)


def test_a_wrong_example_fails(tmp_path, monkeypatch):
    """Negative control: an Example whose output is wrong is reported as failed."""
    (tmp_path / "wrong_example.py").write_text('"""\n>>> 1 + 1\n3\n"""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    result = doctest.testmod(importlib.import_module("wrong_example"), report=False)
    assert result == (1, 1)


def test_an_example_that_is_never_collected_fails(tmp_path, monkeypatch):
    """Negative control: an Example doctest does not collect (a string that
    is not a docstring) fails the count."""
    (tmp_path / "hidden_example.py").write_text('NOTE = """\n>>> 1 + 1\n2\n"""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AssertionError, match="hidden_example"):
        run_examples(importlib.import_module("hidden_example"))
