"""Starts every scenario process at once (they overlap), shared by the tests.

No wall-clock budget (the machine may be loaded): `_launch.run_all`'s
watchdog ends processes that hang or run away, by the CPU time they use.
"""

import pytest

import _launch


@pytest.fixture(scope="session")
def scenario_runs(tmp_path_factory):
    """Results of `scenarios.py`: mirrored_2, mirrored_3, worker_0, worker_1."""
    jobs = {**_launch.mirrored_jobs((2, 3)), **_launch.worker_jobs(2)}
    return _launch.run_all(jobs, tmp_path_factory.mktemp("scenarios"))


# pytest-timeout's limit for the tests that start the scenarios: a backstop
# for a watchdog that fails itself, far beyond the 104 s they take on 2 quiet
# cores (the limit counts the session fixture's set-up in the first test).
SCENARIO_TIMEOUT_SECONDS = 3600


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`), the tests that read the
    scenario processes' results share one worker, so they start once."""
    for item in items:
        if "scenario_runs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("distribute_scenarios"))
            item.add_marker(pytest.mark.timeout(SCENARIO_TIMEOUT_SECONDS))
