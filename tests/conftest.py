"""Shared fixtures and the test run's behaviour.

`installed`: tests that need a file an install step provides call
`installed(path, how)`. Locally a missing install skips the test; under
CI=true it fails the run, so CI never goes green with a silently skipped test.

The run itself (README's test command, with or without `-n 2`):

* TensorFlow's native INFO and WARNING lines are off (TF_CPP_MIN_LOG_LEVEL=2,
  as CI sets it), set here before any test module imports TensorFlow.
* A failing test is named as it fails ("FAILED <test id>" on its own line,
  while the run goes on), not only in the summary at the end.
* Ctrl-C (SIGINT) stops the run, also when it was started from a shell that
  made it ignore SIGINT (a background job of a script: Python keeps an
  ignored SIGINT ignored, and the run could then only be killed).
* Python's full garbage collections run less often and scan fewer
  objects: from the start, a full collection waits for
  `FULL_COLLECTION_EVERY` collections of the middle generation instead of
  10; after collection (TensorFlow, Keras, tfdp and the test modules
  imported, about 380,000 objects that live as long as the run) the
  survivors are frozen out of every later collection. A worker's tracked
  objects grow to 700,000-900,000 (traced graphs, fitted models), and a
  full collection of them takes 0.3-1.4 s (`benchmarks/pytest_gc_time.py`
  prints the collector's time). Tests that need garbage gone call
  `gc.collect()`, which still collects everything not frozen.
* The modules holding the longest single tests (`RUN_FIRST`) are collected
  first. Under `-n 2 --dist loadgroup` the groups go out first (largest
  first), then single tests in collection order, so a long test collected
  last (tests/tuning sorts last) ran while the other worker had nothing
  left; collected early, the tail is short tests. Only the order changes.
"""

import gc
import os
import signal

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Collections of the middle generation between two full collections
# (Python's default: 10).
FULL_COLLECTION_EVERY = 50
_youngest, _middle, _ = gc.get_threshold()
gc.set_threshold(_youngest, _middle, FULL_COLLECTION_EVERY)

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def require_installed(path, how):
    """Skips (fails under CI=true) unless `path` exists; `how` installs it."""
    if os.path.exists(path):
        return
    message = f"{path} is missing; install it with: {how}"
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        pytest.fail(f"CI=true and an install step did not run: {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture
def installed():
    return require_installed


# Files holding single tests of 10 s or more (the suite's --durations on a
# 2-core machine); their tests keep their order within the file.
RUN_FIRST = (
    "tests/faults/test_stress_fits.py",
    "tests/faults/test_pipeline_python.py",
    "tests/faults/test_long_run.py",
    "tests/faults/test_kill_resume_bandmf.py",
    "tests/faults/test_truncated_memmap.py",
    "tests/optimizers/test_sadpsgd.py",
    "tests/models/test_keras_io_recipes.py",
    "tests/models/test_augmentation.py",
    "tests/mechanisms/test_key_bits.py",
    "tests/tuning/test_search_leaks.py",
    "tests/auditing/test_sensitivity_search.py",
)


def pytest_collection_modifyitems(items):
    """Moves the tests of `RUN_FIRST` to the front (see the module docstring)."""
    rank = {path: i for i, path in enumerate(RUN_FIRST)}
    first = len(RUN_FIRST)
    items[:] = sorted(items, key=lambda item: rank.get(item.nodeid.split("::", 1)[0], first))


_run = {}


def pytest_collection_finish(session):
    """Freezes what collection left alive (see the module docstring)."""
    gc.collect()
    gc.freeze()


def pytest_configure(config):
    _run["config"] = config


def pytest_runtest_logreport(report):
    """Names a failing test at once, in the process that prints the run
    (the controller under pytest-xdist, which receives the workers' reports)."""
    config = _run.get("config")
    if not report.failed or config is None or hasattr(config, "workerinput"):
        return
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is None:
        return
    kind = "FAILED" if report.when == "call" else f"ERROR (at {report.when})"
    terminal.ensure_newline()
    terminal.write_line(f"{kind} {report.nodeid}", red=True, bold=True)
