"""README's numbers (issue 54): its flagship snippet, run as is, trains all
its planned steps within its own budget, and its test count is a command,
not a typed number."""

import importlib.util
import math
import re
from pathlib import Path

from tfdp import accounting

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _setting(name, text):
    return float(re.search(rf"{name}=([\d.e-]+)", text).group(1))


def test_the_flagship_snippet_is_not_stopped_by_its_own_budget():
    snippet = README[README.index("from tfdp.data import load_digits"):]
    snippet = snippet[:snippet.index("```")]
    sigma, batch, epochs = (_setting(n, snippet) for n in ("noise_multiplier", "batch_size", "epochs"))
    budget, delta = _setting("epsilon", snippet), _setting("delta", snippet)
    from tfdp.data import load_digits

    (x_train, _), _ = load_digits()
    spent = accounting.compute_dpsgd_epsilon(len(x_train), int(batch), sigma, int(epochs), delta)
    assert spent < budget, f"the snippet's {int(epochs)} epochs spend {spent:.3f} > {budget}"
    assert f"spend {math.ceil(spent * 100) / 100:.2f}" in README.replace("\n", " ")


def _count_script():
    spec = importlib.util.spec_from_file_location("count_tests", ROOT / ".ci" / "count_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_test_count_is_printed_by_a_command():
    for page in (README, (ROOT / "docs" / "development.md").read_text()):
        assert "python .ci/count_tests.py" in page.replace("\n", " ")
    count = _count_script().collected
    assert count("a.py::t\n\n2043 tests collected in 31.2s\n") == 2043
    assert count("1 test collected in 2s") == 1 and count("no tests ran") is None
