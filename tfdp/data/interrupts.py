"""Stopping record reads: at Ctrl-C during `fit`, and when `fit` ends.

A record read runs in a `tf.numpy_function` on tf.data's threads. While the
training step waits for its batch, the main thread is inside TensorFlow, so
Python's SIGINT handler (KeyboardInterrupt) cannot run until the batch is
read: with a slow source (a network disk) Ctrl-C waited for every record of
the batch and of the batches read ahead, and tearing the input pipeline
down waited for them again.

Here each input pipeline that reads records gets a stop event
(`stop_event`); a source checks it before each record (`check`) and, once
it is set, raises `ReadsStopped` instead of reading. `fit` runs in a
`reading_scope`: while it is open, a SIGINT sets the stop events of the
pipelines made in it (a watcher thread learns of the signal through
`signal.set_wakeup_fd`, so it does not wait for the main thread), and when
training ends (or fails) they are set too, so the reads left in flight end
after the record each is reading. Python's own handler still raises
KeyboardInterrupt in the main thread, as soon as the step returns.

Example:

>>> with reading_scope() as scope:
...     stop = stop_event()          # made by the pipeline `fit` builds
...     check(stop)                  # a read goes on
>>> stop.is_set()                    # the scope's end stops its reads
True
"""

import contextlib
import os
import signal
import threading

import keras

__all__ = ["ReadsStopped", "stop_event", "check", "reading_scope"]


class ReadsStopped(RuntimeError):
    """A record read refused because its input pipeline was stopped."""


class _Scope:
    """The stop events of the pipelines made during one `fit`."""

    def __init__(self):
        self.events = []
        self.interrupted = False

    def stop(self):
        for event in self.events:
            event.set()

    def interrupt(self):
        self.interrupted = True
        self.stop()

    def callback(self):
        """A Keras callback that stops the scope's reads when training ends
        (before Keras deletes the iterator, which waits for reads in flight)."""
        scope = self

        class StopReadsAtTrainEnd(keras.callbacks.Callback):
            def on_train_end(self, logs=None):
                scope.stop()

        return StopReadsAtTrainEnd()


_local = threading.local()


def _open_scopes():
    if not hasattr(_local, "scopes"):
        _local.scopes = []
    return _local.scopes


def stop_event():
    """A new stop event for an input pipeline, owned by the open scope.

    Outside a `reading_scope` the event is never set by this module.

    Returns:
        A `threading.Event`.
    """
    event = threading.Event()
    scopes = _open_scopes()
    if scopes:
        scopes[-1].events.append(event)
    return event


def check(stop):
    """Raises `ReadsStopped` if `stop` (an event or None) is set."""
    if stop is not None and stop.is_set():
        raise ReadsStopped(
            "Record reads were stopped: training was interrupted (SIGINT) or ended."
        )


class _SigintWatcher:
    """Sets the open scopes' stop events when SIGINT arrives.

    Armed (by the main thread, while SIGINT raises KeyboardInterrupt) through
    `signal.set_wakeup_fd`: Python's C-level handler writes the signal number
    to a pipe, which a daemon thread reads, whatever the main thread is
    doing. A wakeup fd set before (asyncio's) gets every byte forwarded, and
    is put back when the last scope closes.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._scopes = set()
        self._users = 0
        self._armed = None  # (write fd, the wakeup fd it replaced)

    def enter(self, scope):
        with self._lock:
            self._scopes.add(scope)
            self._users += 1
            if self._armed is None and self._can_arm():
                self._arm()

    def leave(self, scope):
        with self._lock:
            self._scopes.discard(scope)
            self._users -= 1
            if self._users == 0 and self._armed is not None:
                self._disarm()

    @staticmethod
    def _can_arm():
        return (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )

    def _arm(self):
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        try:
            previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except (ValueError, OSError):  # not possible here: read without it
            os.close(read_end)
            os.close(write_end)
            return
        self._armed = (write_end, previous)
        threading.Thread(
            target=self._watch, args=(read_end, previous), daemon=True,
            name="tfdp-sigint-watcher",
        ).start()

    def _disarm(self):
        write_end, previous = self._armed
        self._armed = None
        if threading.current_thread() is threading.main_thread():
            current = signal.set_wakeup_fd(previous)
            if current != write_end:  # someone set theirs meanwhile: keep it
                signal.set_wakeup_fd(current)
        os.close(write_end)  # the watcher reads EOF and ends

    def _watch(self, read_end, forward_to):
        try:
            while True:
                data = os.read(read_end, 512)
                if not data:
                    return
                if forward_to >= 0:
                    with contextlib.suppress(OSError):
                        os.write(forward_to, data)
                if signal.SIGINT in data:
                    with self._lock:
                        scopes = list(self._scopes)
                    for scope in scopes:
                        scope.interrupt()
        finally:
            os.close(read_end)


_WATCHER = _SigintWatcher()


@contextlib.contextmanager
def reading_scope():
    """Context for one training run's input pipelines (see the module doc).

    Yields:
        The scope: `interrupted` (a SIGINT arrived), `stop()`, and
        `callback()` (a Keras callback that stops the reads at train end).
        Leaving the scope stops its reads.
    """
    scope = _Scope()
    _open_scopes().append(scope)
    _WATCHER.enter(scope)
    try:
        yield scope
    finally:
        scope.stop()
        _open_scopes().remove(scope)
        _WATCHER.leave(scope)
