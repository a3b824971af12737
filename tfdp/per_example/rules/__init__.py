"""Per-example gradient rules, one module per layer family (importing this
package registers them all; KerasHub's with `load_optional` once keras_hub
is imported)."""

import sys

from tfdp.per_example.rules import (  # noqa: F401
    batch_normalization,
    conv,
    dense,
    embedding,
    group_normalization,
    lora,
    normalization,
    recurrent,
    reversible_embedding,
)


def load_optional():
    """Registers the KerasHub rules if the user's program imported keras_hub
    (tfdp never imports it itself: it is an optional extra)."""
    if "keras_hub" in sys.modules:
        from tfdp.per_example.rules import keras_hub  # noqa: F401
