"""Former home of per-example gradients; they live in `tfdp.per_example`."""

from tfdp.per_example import (  # noqa: F401
    METHODS,
    LinearGrads,
    MaterializedGrads,
    PerExampleGradients,
    check_per_example_support,
    compute_per_example_gradients,
)
