"""Running a private search in a child process, so that nothing counts its trials.

Every build and trace advances TensorFlow's process-wide uid counter, which
cannot be set back: after K trials in this process, the functions of an
exported model, any later `tf.Variable` and error messages would number
about 1,200 uids per trial. So `run(trials)` runs the whole search (draw
K, build, train and score every trial, choose, charge) in a fresh Python
process and takes back only the chosen model (a `.keras` file, loaded here
with `tfdp.load_model`: a fixed amount of work, whatever K), its
hyperparameters, its score and the search's event. The child's output is
discarded (its logs count the trials); an error in it comes back as its type
with a generic message, except a refusal raised before the number of trials
was drawn, or a search's own `hiding.Refusal`, which keep their message.

The child is a new interpreter (`python -c`) with this process's
`sys.path` and this copy of tfdp first on it, not `multiprocessing`'s spawn start, which would run the
caller's `__main__` script again in the child. The trials (the hypermodel,
the score function, the data) travel pickled by `cloudpickle`, so functions
defined in `__main__` or a notebook work; the temporary folder holding them
(made private by `tempfile.mkdtemp`) is deleted when the search returns;
the child reads and deletes them first thing, before it imports
TensorFlow. The child ends when this process does (`tfdp.parent_death`: a
pipe it watches, and on Linux a parent-death signal), removing that folder
itself: a SIGKILL or SIGTERM of the user's process, or of its whole process
group (the child runs in its own session), leaves neither a child training
the trials nor the chosen model on disk.

Example:

>>> error = _error_of({"error": ["builtins", "ZeroDivisionError"], "message": None})
>>> type(error).__name__, "withheld" in str(error)
('ZeroDivisionError', True)
"""

import importlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

import cloudpickle

from tfdp import parent_death

_JOB, _RESULT, _MODEL = "trials.pkl", "result.json", "chosen.keras"
# The child reads and deletes the pickled trials (private data) before it
# imports anything else: a child killed while importing TensorFlow leaves
# no copy of them on disk.
_CHILD = "import os, sys; job = os.path.join(sys.argv[1], 'trials.pkl'); " \
         "file = open(job, 'rb'); trials = file.read(); file.close(); os.remove(job); " \
         "sys.path[:0] = sys.argv[2:]; " \
         "from tfdp import parent_death; parent_death.watch(sys.argv[1]); " \
         "from tfdp.tuning import process; process.main(sys.argv[1], trials)"


def run(trials):
    """(model, hp, score, event) of the chosen trial, or None when none was
    drawn, from `trials` (`search.Trials`) run in a child process."""
    job = _pickled(trials)
    folder = tempfile.mkdtemp(prefix="tfdp-search-")
    try:
        with open(os.path.join(folder, _JOB), "wb") as file:
            file.write(job)
        del job
        # Until the child says otherwise, it may have drawn the number of trials
        # (a crash or Ctrl-C leaves no answer): a search that then fails counts.
        trials.count_drawn = True
        tfdp_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        child, pipe = parent_death.popen(
            [sys.executable, "-c", _CHILD, folder, tfdp_root, *sys.path],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            child.wait()
        finally:  # Ctrl-C here: the child and its trials go, unreported
            if child.poll() is None:
                child.kill()
                child.wait()
            os.close(pipe)
        return _outcome(folder, trials)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _pickled(trials):
    modules = _without_files(trials.build, getattr(trials.build, "__self__", None),
                             trials.score)
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        return _dumps(trials)
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)


def _without_files(*objects):
    """The modules of `objects` that the child cannot import (a docs runner's
    or a tool's module made in memory): their functions travel by value, as
    `__main__`'s do."""
    modules = []
    for item in objects:
        name = item.__module__ if callable(item) else type(item).__module__
        module = sys.modules.get(name)
        if module is not None and name != "__main__" and module not in modules \
                and getattr(module, "__file__", None) is None \
                and getattr(module, "__spec__", None) is None:
            modules.append(module)
    return modules


def _dumps(trials):
    try:
        return cloudpickle.dumps(trials)
    except Exception as error:  # noqa: BLE001 - name the object that cannot travel
        for name, value in [("hypermodel", trials.build), ("score", trials.score),
                            ("x, y and the validation data", trials.validation)]:
            try:
                cloudpickle.dumps(value)
            except Exception as culprit:  # noqa: BLE001
                error = culprit
                break
        else:
            name, value = "search", trials
        raise TypeError(
            f"A private search runs its trials in a child process, so its `{name}` must be "
            f"picklable with cloudpickle ({type(error).__name__}: {error}). Define it with "
            "plain Python, Keras and tfdp objects. Received: "
            f"{name}={_short(value)}"
        ) from None


def _short(value):
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _outcome(folder, trials):
    try:
        with open(os.path.join(folder, _RESULT), encoding="utf-8") as file:
            result = json.load(file)
    except (OSError, ValueError):
        result = None
    if result is None:
        raise RuntimeError(
            "The private search's child process ended without a result (it was killed or "
            "crashed, for example out of memory); its output is withheld because it can "
            "reveal how many trials ran. " + _HINT
        )
    if "error" in result:
        trials.count_drawn = result.get("drawn", True)
        raise _error_of(result)
    if not result["chosen"]:
        return None
    import keras_tuner

    from tfdp.accounting.events import event_from_dict
    from tfdp.models import load_model

    model = load_model(os.path.join(folder, _MODEL))
    model.history = None  # as `Trials.run` leaves it: no trial's training history
    hp = keras_tuner.HyperParameters.from_config(result["hyperparameters"])
    return model, hp, result["score"], event_from_dict(result["event"])


_HINT = ("To debug, build and fit one model of your hypermodel outside the search (for "
         "example with keras_tuner.HyperParameters() and your fit arguments), and, if you "
         "passed a custom `score`, call it on that model's predictions one validation "
         "example at a time, as the search does (score(y_true[i:i + 1], "
         "model.predict(x_val[i:i + 1])), one value returned); or run the search on data "
         "you may publish.")


def _error_of(result):
    """The exception to raise for the child's error `result`."""
    from tfdp.tuning.hiding import rebuilt

    module, name = result["error"]
    kind = _exception_type(module, name)
    if result["message"] is not None:
        return rebuilt(kind, result["message"])
    return rebuilt(kind, (
        f"A trial of the private search failed with {name}; its message is withheld "
        "because it can reveal how many trials ran. " + _HINT))


def _exception_type(module, name):
    try:
        kind = importlib.import_module(module)
        for part in name.split("."):
            kind = getattr(kind, part)
    except Exception:  # noqa: BLE001 - a type this process cannot import
        return RuntimeError
    return kind if isinstance(kind, type) and issubclass(kind, BaseException) else RuntimeError


# -- in the child ------------------------------------------------------------


def main(folder, job):
    """Runs the pickled trials `job` (read from `folder` and deleted there)
    and writes the result in `folder`."""
    trials = None
    try:
        trials = pickle.loads(job)
        del job
        result = _chosen(trials, folder)
    except BaseException as error:  # noqa: BLE001 - the parent re-raises it
        result = _failure(error, trials)
    with open(os.path.join(folder, _RESULT), "w", encoding="utf-8") as file:
        json.dump(result, file)


def _chosen(trials, folder):
    from tfdp.accounting.events import event_to_dict
    from tfdp.tuning import hiding

    with hiding.quiet_trials():
        outcome = trials.run(hiding.NameCounters())
    if outcome is None:
        return {"chosen": False}
    model, hp, score, event, _ = outcome
    model.save(os.path.join(folder, _MODEL))
    return {"chosen": True, "hyperparameters": json.loads(json.dumps(hp.get_config(),
                                                                     default=_plain)),
            "score": float(score), "event": event_to_dict(event)}


def _plain(value):
    return value.item()  # a numpy scalar drawn by KerasTuner


def _failure(error, trials):
    """The error's type, its message only when it cannot count the trials,
    and whether the number of trials was drawn before it."""
    from tfdp.tuning.hiding import Refusal

    drawn = trials is not None and trials.count_drawn
    if isinstance(error, Refusal):
        return {"error": ["builtins", "ValueError"], "message": str(error), "drawn": drawn}
    kind = type(error)
    return {"error": [kind.__module__, kind.__qualname__],
            "message": None if drawn else str(error), "drawn": drawn}
