"""The documentation site builds with `mkdocs build --strict`, offline, and
documents every public name.

The build (about 10 s) runs once per test process, into a temporary folder;
any warning fails it: a broken link or anchor, a page missing from the nav, a
snippet file that does not exist, a docstring mkdocstrings cannot render.
"""

import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
INSTALL = "pip install -e '.[docs]'"

# The packages whose public names the API reference must show.
PACKAGES = (
    "tfdp",
    "tfdp.optimizers",
    "tfdp.callbacks",
    "tfdp.accounting",
    "tfdp.auditing",
    "tfdp.data",
    "tfdp.per_example",
    "tfdp.layers",
    "tfdp.preprocessing",
    "tfdp.recipes",
    "tfdp.tuning",
)

pytestmark = pytest.mark.xdist_group("docs_site")


def _require_mkdocs():
    """Skips without the docs packages (fails under CI=true, as tests/conftest.py does)."""
    missing = [name for name in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers")
               if importlib.util.find_spec(name) is None]
    if not missing:
        return
    message = f"{', '.join(missing)} not installed; install with: {INSTALL}"
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        pytest.fail(f"CI=true and an install step did not run: {message}", pytrace=False)
    pytest.skip(message)


def mkdocs_build(config, site_dir):
    """Runs `mkdocs build --strict`; returns (exit code, output)."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    completed = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
         "--site-dir", str(site_dir)],
        cwd=config.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    return completed.returncode, completed.stdout + completed.stderr


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    _require_mkdocs()
    site_dir = tmp_path_factory.mktemp("site")
    code, output = mkdocs_build(ROOT / "mkdocs.yml", site_dir)
    assert code == 0, f"mkdocs build --strict failed:\n{output[-6000:]}"
    assert "WARNING" not in output, output[-6000:]
    return site_dir


def _reference_ids(site):
    ids = set()
    for page in (site / "reference").rglob("*.html"):
        ids.update(re.findall(r'\bid="([A-Za-z_][\w.]*)"', page.read_text()))
    return ids


def public_names(module):
    """`__all__`, or the classes and functions a module defines without `_`."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == module.__name__
    ]


def undocumented(package, ids):
    """The public names of `package` that have no entry among the page `ids`.

    An entry is the name's own path (`tfdp.data.RecordSource`) or any path
    that resolves to the same object (`tfdp.models.DPModel` for
    `tfdp.DPModel`); a class or function also needs a docstring.
    """
    module = importlib.import_module(package)
    missing = []
    for name in public_names(module):
        value = getattr(module, name)
        documented = f"{package}.{name}" in ids
        for entry in ids:
            if documented:
                break
            head, _, tail = entry.rpartition(".")
            if tail != name or not head:
                continue
            try:
                documented = getattr(importlib.import_module(head), tail, None) is value
            except ImportError:
                continue
        if (inspect.isclass(value) or inspect.isfunction(value)) and not inspect.getdoc(value):
            documented = False
        if not documented:
            missing.append(name)
    return missing


def test_the_site_builds_strictly(site):
    assert (site / "index.html").exists()
    assert (site / "reference" / "optimizers.html").exists()


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_in_the_api_reference(site, package):
    assert undocumented(package, _reference_ids(site)) == []


def test_the_site_loads_nothing_from_the_network(site):
    """Offline: no web fonts, scripts or styles from another host."""
    external = re.compile(
        r'<(?:script|link|img)\b[^>]*\b(?:src|href)="(?:https?:)?//(?!github\.com)[^"]*"')
    for page in site.rglob("*.html"):
        text = page.read_text()
        assert not external.findall(text), (page, external.findall(text)[:3])
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, page


def test_every_table_renders_as_a_table(site):
    """A table included from a benchmark's output that Markdown did not read
    as a table (no blank line before it) shows up as literal `|---|` text."""
    broken = [str(page.relative_to(site)) for page in site.rglob("*.html")
              if "|---" in page.read_text()]
    assert broken == []


def test_the_config_uses_no_plugin_that_fetches():
    """The build itself must work without a network: only plugins that read
    local files, and no mkdocstrings inventories (downloaded objects.inv)."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    names = [next(iter(p)) if isinstance(p, dict) else p for p in config["plugins"]]
    assert set(names) <= {"search", "mkdocstrings"}, names
    assert config["theme"]["font"] is False
    mkdocstrings = next(p for p in config["plugins"] if isinstance(p, dict) and "mkdocstrings" in p)
    for handler in mkdocstrings["mkdocstrings"]["handlers"].values():
        assert "inventories" not in handler and "import" not in handler


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """Negative control: the same strict build refuses a page linking to a missing page."""
    _require_mkdocs()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\nSee [the guide](guide.md).\n")
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: control\ntheme:\n  name: material\n  font: false\n")
    code, output = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert code != 0 and "guide.md" in output, output[-3000:]


def test_an_undocumented_name_is_caught(tmp_path, monkeypatch):
    """Negative control for `undocumented`: a name without an entry, and a
    function without a docstring, are both reported."""
    (tmp_path / "fake_docs_package.py").write_text(
        "__all__ = ['shown', 'missing', 'bare']\n"
        "def shown():\n    'Documented.'\n"
        "def missing():\n    'Documented, but no page shows it.'\n"
        "def bare():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ids = {"fake_docs_package.shown", "fake_docs_package.bare"}
    assert undocumented("fake_docs_package", ids) == ["missing", "bare"]


def _documented_callables():
    seen = set()
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in public_names(module):
            value = getattr(module, name)
            if inspect.ismodule(value) or id(value) in seen:
                continue
            if inspect.isfunction(value):
                seen.add(id(value))
                yield f"{package}.{name}", value
            elif inspect.isclass(value):
                seen.add(id(value))
                yield f"{package}.{name}", value
                for attr, member in vars(value).items():
                    if inspect.isfunction(member) and not attr.startswith("_"):
                        yield f"{package}.{name}.{attr}", member


def unknown_parameters(function, docstring):
    """Names in the docstring's Args section that `function` does not take.

    A line may document several parameters at once ("inputs, outputs:"); a
    function with *args or **kwargs accepts any name.
    """
    import griffe

    parsed = griffe.Docstring(docstring, parser="google").parse(warnings=False)
    documented = [
        name.strip()
        for section in parsed if section.kind.value == "parameters"
        for parameter in section.value
        for name in parameter.name.split(",")
    ]
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []
    kinds = {p.kind for p in signature.parameters.values()}
    if inspect.Parameter.VAR_POSITIONAL in kinds or inspect.Parameter.VAR_KEYWORD in kinds:
        return []
    names = set(signature.parameters)
    return [name.lstrip("*") for name in documented if name.lstrip("*") not in names]


def test_documented_parameters_exist():
    """Every name an Args section documents is a parameter of its callable."""
    _require_mkdocs()
    problems = []
    for path, value in _documented_callables():
        docstring = inspect.getdoc(value)
        if not docstring:
            continue
        function = value.__init__ if inspect.isclass(value) else value  # a class documents __init__
        unknown = unknown_parameters(function, docstring)
        if unknown:
            problems.append(f"{path}: {unknown}")
    assert problems == []


def test_an_unknown_parameter_is_caught():
    """Negative control for `unknown_parameters`."""

    def function(alpha, beta):
        """Adds.

        Args:
            alpha, beta: numbers.
            gamma: not a parameter.
        """

    assert unknown_parameters(function, inspect.getdoc(function)) == ["gamma"]


def test_the_doctest_fences_extension():
    """docs/_site_tools/griffe_doctests.py turns doctest runs into code blocks."""
    import doctest
    import importlib.util

    _require_mkdocs()
    path = ROOT / "docs" / "_site_tools" / "griffe_doctests.py"
    spec = importlib.util.spec_from_file_location("griffe_doctests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0


def test_readme_links_resolve():
    """README.md's relative links (to the docs pages, RESULTS.md, plots) exist."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "README links to no page"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == []


def test_the_condensed_gpu_table_is_what_its_script_prints():
    """docs/results/tables/throughput_gpu_h100_summary.md is the output of
    benchmarks/throughput_summary.py on the kept GPU run, not a typed copy."""
    completed = subprocess.run(
        [sys.executable, "benchmarks/throughput_summary.py",
         "benchmarks/results/throughput_gpu_h100.md"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )
    kept = (ROOT / "docs" / "results" / "tables" / "throughput_gpu_h100_summary.md").read_text()
    table = "\n".join(line for line in kept.splitlines() if line.startswith("|"))
    assert table.strip() == completed.stdout.strip()


def run_script_in_process(script, *args, monkeypatch):
    """`python <script> <args>` run in this process: the script's `main()`
    with `sys.argv` set. `sys.path` and the modules imported from the
    script's folder are restored after. (A subprocess would start
    TensorFlow and Keras again, 10 to 40 s, for what reads JSON files.)"""
    folder = str(script.parent)
    monkeypatch.syspath_prepend(folder)  # restores sys.path after the test
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    before = set(sys.modules)
    spec = importlib.util.spec_from_file_location(f"_script_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        module.main()
    finally:
        for name in set(sys.modules) - before:
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(folder):
                del sys.modules[name]


def test_the_tuned_table_is_what_its_script_prints_from_the_kept_searches(tmp_path, monkeypatch):
    """benchmarks/results/tuned_fashion_mnist.md (RESULTS.md shows it) is what
    `tuned_fashion_mnist.py report` prints from the committed JSON files."""
    written = tmp_path / "tuned.md"
    run_script_in_process(ROOT / "benchmarks" / "tuned_fashion_mnist.py", "report",
                          "--output", str(written), monkeypatch=monkeypatch)
    kept = (ROOT / "benchmarks" / "results" / "tuned_fashion_mnist.md").read_text()
    assert written.read_text() == kept


def source_page_references(root):
    """(file, page, anchor) for every `docs/....md[#anchor]` that tfdp's source names."""
    pattern = re.compile(r"docs/([\w/.-]+?\.md)(?:#([\w-]+))?")
    found = []
    for path in sorted((root / "tfdp").rglob("*.py")):
        for page, anchor in pattern.findall(path.read_text()):
            found.append((path.relative_to(root), page, anchor))
    return found


def test_the_source_points_at_pages_that_exist(site):
    """Docstrings and comments send the reader to docs/ pages (they used to
    name MECHANISMS.md, which is not in the repository): each page and
    anchor they name exists in the built site."""
    references = source_page_references(ROOT)
    assert len(references) >= 20
    missing = []
    for source, page, anchor in references:
        html = site / page.replace(".md", ".html")
        if not html.exists():
            missing.append(f"{source}: docs/{page}")
        elif anchor and f'id="{anchor}"' not in html.read_text():
            missing.append(f"{source}: docs/{page}#{anchor}")
    assert missing == []
    mentions = [str(path.relative_to(ROOT)) for path in (ROOT / "tfdp").rglob("*.py")
                if "MECHANISMS.md" in path.read_text()]
    assert mentions == []
