"""Every tfdp module that imports names on first use (a module `__getattr__`)
lists them in `dir()`, so that tab completion in a notebook or IPython shows
them: `dir(tfdp.auditing)` lacked `sensitivity_search`."""

import importlib
import pkgutil

import tfdp


def lazy_modules():
    for info in pkgutil.walk_packages(tfdp.__path__, "tfdp."):
        module = importlib.import_module(info.name)
        if "__getattr__" in vars(module):
            yield module
    if "__getattr__" in vars(tfdp):
        yield tfdp


def test_each_lazy_module_lists_its_public_names():
    modules = list(lazy_modules())
    assert {m.__name__ for m in modules} >= {"tfdp", "tfdp.auditing"}
    for module in modules:
        missing = sorted(set(module.__all__) - set(dir(module)))
        assert not missing, f"dir({module.__name__}) lacks {missing}"


def test_dir_names_resolve():
    from tfdp import auditing

    for name in ("sensitivity_search", "SensitivityResult", "audit_optimizer"):
        assert name in dir(auditing)
        getattr(auditing, name)
