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
* A ```text block right after a ```python block (blank lines between
  only) is what that block prints: the test compares them, line by line
  (trailing spaces ignored), so a page cannot show an output its code no
  longer gives. A line `...` stands for any lines, and a line ending in
  `...` for the rest of a long line. An output that varies from run to run
  (timings, unseeded noise) is marked
  `<!-- docs-test: output: approximate: REASON -->` above its fence: then
  its numbers (and the spaces that align them) may differ, but its words
  and lines must match.
  `<!-- docs-test: skip: REASON -->` above a text block leaves it unchecked.
* Blocks in any other language (bash, pycon) are never run.

Example:

>>> page = '''
... ```python
... x = 1 + 1
... print(x)
... ```
...
... ```text
... 2
... ```
... <!-- docs-test: skip: needs the network -->
... ```python
... download()
... ```
... '''
>>> [(block.line, block.skip_reason) for block in python_blocks(page)]
[(3, None), (12, 'needs the network')]
>>> run_blocks(code_blocks(page), "page.md")
1
"""

import contextlib
import difflib
import io
import linecache
import re
import sys
import types

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
MARKER = re.compile(
    r"^\s*<!--\s*docs-test:\s*(?P<kind>skip|output:\s*approximate)\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$"
)
# A number as Python prints it: an approximate output's numbers may differ.
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class Block:
    """One fenced code block: its language, source, first line (1-based, the
    line after the fence), skip reason, why its output is approximate (text
    blocks), and the code block it directly follows (or None)."""

    def __init__(self, language, source, line, skip_reason, approximate=None, follows=None):
        self.language = language
        self.source = source
        self.line = line
        self.skip_reason = skip_reason
        self.approximate = approximate
        self.follows = follows

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
    pending = None  # (line number, kind, reason) of a marker above
    adjacent = False  # only blank lines and markers since the last block closed
    while index < len(lines):
        line = lines[index]
        marker = MARKER.match(line)
        if marker:
            kind = "skip" if marker.group("kind") == "skip" else "approximate"
            if not marker.group("reason"):
                raise ValueError(f"line {index + 1}: a docs-test {kind} marker needs a reason")
            pending = (index + 1, kind, marker.group("reason"))
            index += 1
            continue
        fence = FENCE.match(line)
        if not fence:
            if pending and line.strip():
                raise ValueError(
                    f"line {pending[0]}: a docs-test {pending[1]} marker must stand on the "
                    "line right above a code fence"
                )
            adjacent = adjacent and not line.strip()
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
        kind, reason = pending[1:] if pending else (None, None)
        if kind == "approximate" and language != "text":
            raise ValueError(f"line {pending[0]}: an approximate output marker must stand above "
                             "a ```text block")
        blocks.append(Block(
            language, "\n".join(body) + "\n", start,
            skip_reason=reason if kind == "skip" else None,
            approximate=reason if kind == "approximate" else None,
            follows=blocks[-1] if blocks and adjacent else None,
        ))
        pending = None
        adjacent = True
        index += 1
    return blocks


def python_blocks(text):
    """The ```python blocks of a page (skipped ones included, marked)."""
    return [block for block in code_blocks(text) if block.language in ("python", "py")]


def _outputs(blocks):
    """{id(python block): the text block right after it, to compare}."""
    return {
        id(block.follows): block
        for block in blocks
        if block.language == "text" and block.skip_reason is None
        and block.follows is not None and block.follows.language in ("python", "py")
        and block.follows.skip_reason is None
    }


def squeezed(text):
    """`text` with runs of spaces as one, and none inside brackets' edges
    (numpy aligns an array's columns to the widths of its numbers)."""
    return re.sub(r"(?<=[\[(]) | (?=[\])])", "", re.sub(r" +", " ", text))


def _pattern(shown):
    """A regex for what `shown` allows: its lines, a line "..." standing for
    any lines, a line ending in "..." for any line that starts so, and (when
    approximate) any number where it has one."""
    def line(text):
        if not shown.approximate:
            return re.escape(text)
        pieces = NUMBER.split(squeezed(text))
        return NUMBER.pattern.join(re.escape(piece) for piece in pieces)

    parts = []
    for row in shown.source.strip("\n").splitlines():
        row = row.rstrip()
        if row == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        elif row.endswith("..."):
            parts.append(line(row[:-3]) + r"[^\n]*\n")
        else:
            parts.append(line(row) + r"\n")
    return "".join(parts)


def output_differences(printed, shown):
    """The lines where `printed` differs from the ```text block `shown`, as
    a unified diff (empty when `printed` is what `shown` allows)."""
    rows = [row.rstrip() for row in printed.strip("\n").splitlines()]
    compared = [squeezed(row) for row in rows] if shown.approximate else rows
    if re.fullmatch(_pattern(shown), "".join(row + "\n" for row in compared)):
        return ""
    return "\n".join(difflib.unified_diff(
        shown.source.strip("\n").splitlines(), rows,
        "the page shows", "the code prints", lineterm=""))


def run_blocks(blocks, name):
    """Runs the ```python blocks that are not skipped in one namespace, and
    checks each output shown right after one; returns how many ran.

    A failing block raises an error naming the page and the block's line;
    outputs that differ from the ```text blocks after them are all named,
    with a diff, after the page ran.
    """
    outputs = _outputs(blocks)
    # A real module, as a script's __main__ is: AutoGraph looks functions'
    # modules up in sys.modules.
    module = types.ModuleType("__docs_page__")
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    ran, wrong = 0, []
    try:
        for block in blocks:
            if block.language not in ("python", "py") or block.skip_reason is not None:
                continue
            filename = f"{name} (block at line {block.line})"
            # Registered as source, so tracebacks and inspect.getsource (which
            # AutoGraph reads) see the block's lines.
            linecache.cache[filename] = (
                len(block.source), None, block.source.splitlines(True), filename)
            code = compile(block.source, filename, "exec")
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    exec(code, namespace)
            except Exception as error:
                sys.stdout.write(printed.getvalue())  # in the failed test's report
                raise AssertionError(
                    f"{name}: the code block at line {block.line} failed: "
                    f"{type(error).__name__}: {error}"
                ) from error
            ran += 1
            shown = outputs.get(id(block))
            differences = shown and output_differences(printed.getvalue(), shown)
            if differences:
                wrong.append(f"the output shown at line {shown.line} is not what the code "
                             f"block at line {block.line} prints:\n{differences}")
    finally:
        sys.modules.pop(module.__name__, None)
    if wrong:
        raise AssertionError(
            f"{name}: " + "\n".join(wrong) + "\n(mark an output that varies from run to run "
            "`<!-- docs-test: output: approximate: REASON -->` above its fence)"
        )
    return ran
