"""Threads that read records and never keep the interpreter from exiting.

`concurrent.futures.ThreadPoolExecutor` joins its workers when Python exits,
so a record read that never returns (a hung network filesystem, a source
waiting on a lock, a KeyboardInterrupt while a read blocks) keeps the
process alive after its main thread ended (a test run once stalled 14
minutes in `Py_FinalizeEx -> wait_for_thread_shutdown`). `ReadThreads` maps
a function over items on daemon threads instead: at exit they are
abandoned, not waited for. Like the executor's, its threads end when the
pool is garbage-collected.

Example:

>>> pool = ReadThreads(2, name="example")
>>> list(pool.map(lambda i: i * i, range(5)))
[0, 1, 4, 9, 16]
"""

import concurrent.futures
import queue
import threading
import weakref


def _work(tasks):
    while True:
        task = tasks.get()
        if task is None:  # the pool was collected
            return
        future, function, item = task
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(function(item))
        except BaseException as error:  # noqa: BLE001 (handed to the caller)
            future.set_exception(error)


def _stop(tasks, threads):
    for _ in threads:
        tasks.put(None)


class ReadThreads:
    """`map` over at most `num_threads` daemon threads, started on first use.

    Args:
        num_threads: int >= 1.
        name: the threads' name prefix.
    """

    def __init__(self, num_threads, name):
        self.num_threads = num_threads
        self.name = name
        self._tasks = queue.SimpleQueue()
        self._threads = []
        self._lock = threading.Lock()
        weakref.finalize(self, _stop, self._tasks, self._threads)

    def _start(self, wanted):
        with self._lock:
            while len(self._threads) < min(wanted, self.num_threads):
                thread = threading.Thread(
                    target=_work, args=(self._tasks,), daemon=True,
                    name=f"{self.name}_{len(self._threads)}",
                )
                thread.start()
                self._threads.append(thread)

    def map(self, function, items):
        """`function(item)` for each item, in order, computed in the threads.

        As `Executor.map`: the first exception is raised when its result is
        reached, and the items not started yet are cancelled when the
        iteration stops early.

        Returns:
            An iterator of the results.
        """
        futures = []
        for item in items:
            future = concurrent.futures.Future()
            self._tasks.put((future, function, item))
            futures.append(future)
        self._start(len(futures))
        return self._results(futures)

    @staticmethod
    def _results(futures):
        try:
            for future in futures:
                yield future.result()
        finally:
            for future in futures:
                future.cancel()
