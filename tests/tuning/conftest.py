"""Fixtures of the private-search tests: where a search runs, and how many
trials it draws."""

import pytest


def _search_module():
    pytest.importorskip("keras_tuner")
    from tfdp.tuning import search

    return search


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    """Searches run in this process (patched fits, fast); `in_child` undoes it."""
    monkeypatch.setattr(_search_module(), "_IN_PROCESS", True)


@pytest.fixture
def in_child(monkeypatch):
    """Searches run in their child process, as everyone else's."""
    monkeypatch.setattr(_search_module(), "_IN_PROCESS", False)


@pytest.fixture
def trials(monkeypatch):
    """Sets the number of trials the next searches draw."""
    def set_count(count):
        monkeypatch.setattr(_search_module(), "draw_trial_count",
                            lambda rng, mean, shape: count)
    return set_count
