"""Every ```python block of the documentation pages and README.md runs
(the convention: tests/docs/markdown_code.py).

A page's blocks run in order in one namespace, inside this test process, in
a fresh temporary folder; Keras's global settings a page may change (the
dtype policy) are put back afterwards. Pages use small data (the built-in
digits, a few epochs), so all of them together take a minute or two.
"""

import pathlib

import pytest

from markdown_code import code_blocks, python_blocks, run_blocks

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
PAGES_WITH_CODE = [page for page in PAGES if python_blocks(page.read_text())]


def _name(page):
    return str(page.relative_to(ROOT))


@pytest.fixture
def keras_settings_restored(tmp_path, monkeypatch):
    import keras

    policy = keras.config.dtype_policy()
    monkeypatch.chdir(tmp_path)
    yield
    keras.config.set_dtype_policy(policy)
    keras.backend.clear_session()


# Optional packages a page's code uses (all in the `test` extra): a page that
# needs a missing one is skipped locally and fails under CI=true.
OPTIONAL = {"keras_hub": "keras_hub", "TensorBoard(": "tensorboard", "tfdp.tuning": "keras_tuner"}


def _require_optional(blocks, require_installed):
    import importlib.util

    code = "".join(block.source for block in blocks if block.skip_reason is None)
    for marker, module in OPTIONAL.items():
        if marker in code and importlib.util.find_spec(module) is None:
            require_installed(f"<the {module} package>", "pip install -e '.[test]'")


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=_name)
def test_the_python_blocks_of_a_page_run(page, keras_settings_restored, installed):
    blocks = code_blocks(page.read_text())
    python = python_blocks(page.read_text())
    _require_optional(python, installed)
    ran = run_blocks(blocks, _name(page))
    assert ran == sum(1 for block in python if block.skip_reason is None)


def test_every_page_parses_and_every_guide_runs_code():
    """Skip markers carry a reason; each guide runs at least one block."""
    for page in PAGES:
        code_blocks(page.read_text())  # raises on a bad marker or an open fence
    guides = [page for page in PAGES if page.parent.name == "guides"]
    assert guides
    for page in guides + [DOCS / "getting-started.md"]:
        blocks = python_blocks(page.read_text())
        assert any(block.skip_reason is None for block in blocks), (
            f"{_name(page)} has no Python block that the tests run")


def test_a_failing_block_names_its_page_and_line():
    """Negative control: an error in a block fails the page's test."""
    page = "```python\nx = 1\n```\n\ntext\n\n```python\nraise ValueError('broken')\n```\n"
    with pytest.raises(AssertionError, match=r"page\.md: the code block at line 8 failed: ValueError"):
        run_blocks(python_blocks(page), "page.md")


def test_a_shown_output_is_what_the_block_prints():
    """Negative controls: an output the code no longer prints fails the page,
    naming the line; an approximate one allows other numbers, not other words."""
    page = "```python\nprint('epsilon', 2.5)\n```\n\n```text\nepsilon 2.4\n```\n"
    with pytest.raises(AssertionError, match=r"(?s)page\.md: the output shown at line 6 is not "
                                             r"what the code block at line 2 prints.*\+epsilon 2\.5"):
        run_blocks(code_blocks(page), "page.md")
    approximate = page.replace("```text", "<!-- docs-test: output: approximate: noise -->\n```text")
    assert run_blocks(code_blocks(approximate), "page.md") == 1
    with pytest.raises(AssertionError, match="is not what the code block"):
        run_blocks(code_blocks(approximate.replace("epsilon 2.4", "delta 2.4")), "page.md")
    with pytest.raises(ValueError, match="above a ```text block"):
        code_blocks("<!-- docs-test: output: approximate: noise -->\n```python\nx = 1\n```\n")


def test_an_output_after_prose_or_a_skipped_block_is_not_compared():
    after_prose = "```python\nprint(1)\n```\n\nThen:\n\n```text\n2\n```\n"
    assert run_blocks(code_blocks(after_prose), "page.md") == 1
    skipped = "```python\nprint(1)\n```\n<!-- docs-test: skip: a sketch -->\n```text\n2\n```\n"
    assert run_blocks(code_blocks(skipped), "page.md") == 1


def test_a_skip_marker_needs_a_reason_and_a_fence():
    """Negative controls: a bare marker, or one with no fence after it, is refused."""
    with pytest.raises(ValueError, match="needs a reason"):
        code_blocks("<!-- docs-test: skip -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="right above a code fence"):
        code_blocks("<!-- docs-test: skip: network -->\nSome text.\n```python\nx = 1\n```\n")


def test_the_runner_module_examples():
    import doctest

    import markdown_code

    result = doctest.testmod(markdown_code)
    assert result.failed == 0 and result.attempted > 0
