"""Starts every scenario process at once (they overlap), shared by the tests.

No wall-clock budget (the machine may be loaded): `_launch.run_all`'s
watchdog ends processes that hang or run away, by the CPU time they use.
"""

import pytest

import _launch


# The single-device references are seeded, so every process computes the
# same numbers (measured: bit for bit): they run once, in the R = 2 process,
# and the other runs' results name them as if they had computed them.
_WORKER_REFERENCES = {
    "exact_dpsgd_single": "exact_dpsgd_1", "steps_single": "steps_dpsgd_1",
    "epsilon_single": "epsilon_dpsgd_1", "bandmf_fixed_single": "bandmf_fixed_1",
    "bandmf_amplified_single": "bandmf_amplified_1",
}
SHARED_REFERENCES = {
    "mirrored_3": {key: key for key in (
        "exact_dpsgd_1", "steps_dpsgd_1", "epsilon_dpsgd_1", "logs_dpsgd_1", "noise_1")},
    "worker_0": _WORKER_REFERENCES,
    "worker_1": _WORKER_REFERENCES,
}


@pytest.fixture(scope="session")
def scenario_runs(tmp_path_factory):
    """Results of `scenarios.py`: mirrored_2, mirrored_3, worker_0, worker_1."""
    jobs = {**_launch.mirrored_jobs((2, 3)), **_launch.worker_jobs(2)}
    runs = _launch.run_all(jobs, tmp_path_factory.mktemp("scenarios"))
    for name, keys in SHARED_REFERENCES.items():
        for key, reference in keys.items():
            assert key not in runs[name], f"{name} computed {key} itself"
            runs[name][key] = runs["mirrored_2"][reference]
    return runs


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
