"""The Examples in tfdp.accounting's docstrings run and give what they show."""

import doctest
import importlib

import pytest

MODULES = [
    "tfdp.accounting",
    "tfdp.accounting._validation",
    "tfdp.accounting._engine",
    "tfdp.accounting.events",
    "tfdp.accounting.ledger",
    "tfdp.accounting.calibration",
    "tfdp.accounting.statement",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
