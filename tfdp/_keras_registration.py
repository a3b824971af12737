"""tfdp's Keras classes are registered as soon as a program imports Keras.

A `.keras` file that tfdp saved names its classes by their registered names
("tfdp>DPSequential", "tfdp>DPSGD", ...). Keras finds such a class only if
the module defining it has run its `register_keras_serializable` decorator:
it imports the module a file names only for classes of keras and keras_hub
(keras/src/saving/serialization_lib.py, `_retrieve_class_or_fn`). And
`import tfdp` imports neither TensorFlow nor Keras, so that the accountant
(`tfdp epsilon`) starts in a fraction of a second.

So `import tfdp` calls `install()`: if Keras is already imported it imports
the modules of `SERIALIZABLE_MODULES` at once; otherwise it puts an import
hook in `sys.meta_path` that does so once Keras is imported and the imports
of keras, tensorflow (which imports Keras itself) and of every tfdp module
have all finished, so that none of them is half-initialised (e.g.
`from tfdp.models import DPModel` imports Keras from inside tfdp). Then the
hook removes itself. A program that never imports Keras never pays for it.

Example (in a fresh process, after `tfdp.DPSequential(...).save(path)`):

    import tfdp, keras
    model = keras.models.load_model(path)  # tfdp>DPSequential and its optimizer
"""

import importlib
import sys
import threading
import warnings

# The modules that define tfdp's Keras-serializable classes (tests/models/
# test_keras_load_model.py checks that importing them registers every one).
SERIALIZABLE_MODULES = ("tfdp.models.dp_model", "tfdp.optimizers", "tfdp.layers.scattering")

_lock = threading.Lock()
_executing = 0  # watched modules whose code is running now, in any thread
_registered = False


def _watched(name):
    return name in ("keras", "tensorflow") or name.startswith("tfdp.")


class _Loader:
    """Runs a module through its own loader, then registers if it was the
    last watched import in progress. Every other attribute is the wrapped
    loader's (get_source, get_resource_reader, ...)."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        global _executing
        with _lock:
            _executing += 1
        try:
            self._loader.exec_module(module)
        finally:
            with _lock:
                _executing -= 1
        register_if_keras_is_loaded()


class _Hook:
    """A `sys.meta_path` finder: watched modules get a `_Loader`."""

    def find_spec(self, name, path=None, target=None):
        if _registered or not _watched(name):
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def register_if_keras_is_loaded():
    """Imports `SERIALIZABLE_MODULES` once Keras is imported and no watched
    import is in progress; does nothing before, and after the first time.

    A failure to import them is a warning, not an error: it happens inside
    the user's `import keras`, which must not break for tfdp's sake
    (`tfdp.load_model` then raises the error itself).
    """
    global _registered
    if _registered or "keras" not in sys.modules:
        return
    with _lock:
        if _registered or _executing:
            return
        _registered = True
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _Hook)]
    try:
        for name in SERIALIZABLE_MODULES:
            importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 (reported, see above)
        warnings.warn(
            f"tfdp could not register its Keras classes, so keras.models.load_model cannot "
            f"read files tfdp saved in this process: {type(error).__name__}: {error}",
            stacklevel=2,
        )


def install():
    """Registers tfdp's classes now if Keras is loaded, else when it is."""
    if _registered:
        return
    if not any(isinstance(finder, _Hook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
    register_if_keras_is_loaded()
