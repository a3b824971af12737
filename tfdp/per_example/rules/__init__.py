"""Per-example gradient rules, one module per layer family (importing this
package registers them all)."""

from tfdp.per_example.rules import conv, dense, embedding, normalization, recurrent  # noqa: F401
