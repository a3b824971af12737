"""Griffe extension: tfdp's doctest examples render as code blocks.

tfdp's docstrings write `Example:`, a blank line, then doctest lines at the
docstring's own indentation (so that `doctest` runs them, see
tests/test_docstring_examples.py). Griffe's Google-style parser reads such
lines as Markdown, where `>>>` is a block quote and `x[4][0]` a link. This
extension wraps each run of doctest lines (from a `>>>` line to the next
blank line) in a fenced `pycon` block before the docstring is parsed.
"""

import griffe


def fence_doctests(text):
    r"""Returns `text` with each run of doctest lines in a ```pycon fence.

    Example:

    >>> fence_doctests("Example:\n\n>>> 1 + 1\n2\n\nMore.").splitlines()
    ['Example:', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'More.']
    """
    out, indent, in_run, in_fence = [], "", False, False
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("```"):
            in_fence = not in_fence  # an example already fenced stays as it is
        if not in_fence and not in_run and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            in_run = True
        elif in_run and not stripped:
            out.append(f"{indent}```")
            in_run = False
        out.append(line)
    if in_run:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fences the doctest examples of every docstring griffe loads."""

    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
