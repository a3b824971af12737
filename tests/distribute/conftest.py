"""Starts every scenario process at once (they overlap), shared by the tests."""

import pytest

import _launch


@pytest.fixture(scope="session")
def scenario_runs(tmp_path_factory):
    """Results of `scenarios.py`: mirrored_2, mirrored_3, worker_0, worker_1."""
    jobs = {**_launch.mirrored_jobs((2, 3)), **_launch.worker_jobs(2)}
    return _launch.run_all(jobs, tmp_path_factory.mktemp("scenarios"), timeout=300)
