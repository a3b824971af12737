"""A pytest plugin that prints how long Python's garbage collector ran.

At the end of the run it prints, on stderr, a line per process (each
pytest-xdist worker prints its own): the number of collections of each
generation and the seconds they took, the objects still tracked, the
objects frozen (`tests/conftest.py` freezes what collection leaves alive),
and the process's CPU seconds, so that the collector's share of the run
can be read against it.

    PYTHONPATH=benchmarks python -m pytest -q -p pytest_gc_time tests/models/test_dp_model.py
"""

import gc
import sys
import time

_collections = {generation: [0, 0.0] for generation in range(3)}
_started = [0.0]


def _timer(phase, info):
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    entry = _collections[info["generation"]]
    entry[0] += 1
    entry[1] += time.perf_counter() - _started[0]


gc.callbacks.append(_timer)


def pytest_sessionfinish(session):
    spent = " ".join(f"generation {generation}: {count} in {seconds:.2f} s"
                     for generation, (count, seconds) in _collections.items())
    sys.__stderr__.write(
        f"garbage collector: {spent}; {len(gc.get_objects())} objects tracked, "
        f"{gc.get_freeze_count()} frozen; process CPU {time.process_time():.1f} s\n")
