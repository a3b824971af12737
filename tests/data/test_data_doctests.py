"""The Examples in tfdp.data's docstrings run and give what they show."""

import doctest
import importlib

import pytest

MODULES = ["tfdp.data.poisson", "tfdp.data.importance", "tfdp.data.datasets"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
