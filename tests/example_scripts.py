"""Loads a script of examples/ as a module, so tests call its functions.

Example:

>>> module = load_example("dpsgd_imdb")  # doctest: +SKIP
"""

import importlib.util
import os

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load_example(name):
    """The module examples/`name`.py, freshly executed."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
