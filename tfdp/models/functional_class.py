"""`tfdp.DPModel(inputs, outputs)` builds an instance of a separate class.

Keras's `Model.__init__`, given `(inputs, outputs)` on a `Model` subclass,
rewrites that class's bases to put `Functional` in them
(`inject_functional_model_class` in keras/src/models/model.py), for the rest
of the process. Had `DPModel` been rewritten so, every later subclassed
`class MyModel(tfdp.DPModel)` with `super().__init__()` and `call()` would
call `Functional.__init__` without inputs and fail. So, as Keras does for
`Model` and `Functional`, `DPModel.__new__` hands a functional call to a
class that is both (`functional_dp_model_class`), and `DPModel` is never
rewritten. A user's own subclass built with `(inputs, outputs)` has its own
bases rewritten, as Keras does for any `Model` subclass, with `DPModel`
among them replaced by the functional class rather than rewritten itself
(`make_functional`).
"""

from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments


def wants_functional(cls, dp_model_class, args, kwargs):
    """True when `cls(*args, **kwargs)` builds a graph of `(inputs, outputs)`
    from a `DPModel` class that is not yet `Functional`."""
    return (issubclass(cls, dp_model_class) and not issubclass(cls, Functional)
            and functional_init_arguments(args, kwargs))


def make_functional(cls, dp_model_class, functional_class):
    """Rewrites a user's `DPModel` subclass (and its `DPModel` bases up to
    `DPModel`) to derive from `functional_class` instead of `DPModel`;
    returns `functional_class` for `DPModel` itself. `DPModel` is left as it
    is."""
    if cls is dp_model_class:
        return functional_class
    cls.__bases__ = tuple(
        make_functional(base, dp_model_class, functional_class)
        if isinstance(base, type) and issubclass(base, dp_model_class) else base
        for base in cls.__bases__
    )
    return cls

