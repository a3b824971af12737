"""The Examples in tfdp.auditing's docstrings run and give what they show."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["tfdp.auditing", "tfdp.auditing.bounds", "tfdp.auditing.audit"])
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
