"""The code blocks of the documentation pages, as the tests run them.

The convention for docs/**/*.md:

* A ```python block runs. A page's blocks run in page order, in one
  namespace (a later block uses what an earlier one defined), with a fresh
  temporary folder as the working directory.
* A block that must not run (it needs the network, a cluster, a GPU or an
  hour) is preceded, above its fence (blank lines between are allowed), by
  `<!-- docs-test: skip: REASON -->`; the reason is required and stays in
  the page source for the next reader. The marker is an HTML comment, so
  the published page does not show it.
* Blocks in any other language (bash, text, pycon) are never run.

Example:

>>> page = '''
... ```python
... x = 1 + 1
... ```
... <!-- docs-test: skip: needs the network -->
... ```python
... download()
... ```
... '''
>>> [(block.line, block.skip_reason) for block in python_blocks(page)]
[(3, None), (7, 'needs the network')]
>>> run_blocks(python_blocks(page), "page.md")
1
"""

import linecache
import re
import sys
import types

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
SKIP = re.compile(r"^\s*<!--\s*docs-test:\s*skip\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$")


class Block:
    """One fenced code block: its language, source, first line (1-based, the
    line after the fence) and skip reason."""

    def __init__(self, language, source, line, skip_reason):
        self.language = language
        self.source = source
        self.line = line
        self.skip_reason = skip_reason

    def __repr__(self):
        return f"Block({self.language!r}, line={self.line}, skip_reason={self.skip_reason!r})"


def code_blocks(text):
    """Every fenced code block of a Markdown page, in order.

    Raises:
        ValueError: a skip marker without a reason, or one that does not
            stand right above a fence, or a fence that is never closed.
    """
    lines = text.splitlines()
    blocks, index = [], 0
    pending_skip = None  # (line number, reason) of a marker on the line above
    while index < len(lines):
        line = lines[index]
        skip = SKIP.match(line)
        if skip:
            if not skip.group("reason"):
                raise ValueError(f"line {index + 1}: a docs-test skip marker needs a reason")
            pending_skip = (index + 1, skip.group("reason"))
            index += 1
            continue
        fence = FENCE.match(line)
        if not fence:
            if pending_skip and line.strip():
                raise ValueError(
                    f"line {pending_skip[0]}: a docs-test skip marker must stand on the line "
                    "right above a code fence"
                )
            index += 1
            continue
        marker, indent = fence.group("fence"), fence.group("indent")
        language = fence.group("info").split()[0].lower() if fence.group("info").strip() else ""
        body, start = [], index + 2  # the block's first line, counted from 1
        index += 1
        while index < len(lines) and not (
            lines[index].strip().startswith(marker[0] * len(marker))
            and not lines[index].strip().strip(marker[0])
        ):
            body.append(lines[index][len(indent):] if lines[index].startswith(indent) else lines[index])
            index += 1
        if index == len(lines):
            raise ValueError(f"line {start - 1}: a code fence is never closed")
        blocks.append(Block(language, "\n".join(body) + "\n", start, pending_skip and pending_skip[1]))
        pending_skip = None
        index += 1
    return blocks


def python_blocks(text):
    """The ```python blocks of a page (skipped ones included, marked)."""
    return [block for block in code_blocks(text) if block.language in ("python", "py")]


def run_blocks(blocks, name):
    """Runs the blocks that are not skipped in one namespace; returns how many ran.

    A failing block raises an error naming the page and the block's line.
    """
    # A real module, as a script's __main__ is: AutoGraph looks functions'
    # modules up in sys.modules.
    module = types.ModuleType("__docs_page__")
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    ran = 0
    try:
        for block in blocks:
            if block.skip_reason is not None:
                continue
            filename = f"{name} (block at line {block.line})"
            # Registered as source, so tracebacks and inspect.getsource (which
            # AutoGraph reads) see the block's lines.
            linecache.cache[filename] = (
                len(block.source), None, block.source.splitlines(True), filename)
            code = compile(block.source, filename, "exec")
            try:
                exec(code, namespace)
            except Exception as error:
                raise AssertionError(
                    f"{name}: the code block at line {block.line} failed: "
                    f"{type(error).__name__}: {error}"
                ) from error
            ran += 1
    finally:
        sys.modules.pop(module.__name__, None)
    return ran
