"""Starts every scenario process at once (they overlap), shared by the tests."""

import pytest

import _launch


@pytest.fixture(scope="session")
def scenario_runs(tmp_path_factory):
    """Results of `scenarios.py`: mirrored_2, mirrored_3, worker_0, worker_1."""
    jobs = {**_launch.mirrored_jobs((2, 3)), **_launch.worker_jobs(2)}
    return _launch.run_all(jobs, tmp_path_factory.mktemp("scenarios"), timeout=300)


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`), the tests that read the
    scenario processes' results share one worker, so they start once."""
    for item in items:
        if "scenario_runs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("distribute_scenarios"))
