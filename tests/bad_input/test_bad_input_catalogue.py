"""docs/bad_input.md and the bad-input tests name each other: a case is not in the
catalogue without a test, and a test is not added without its row."""
import ast
import re

from tests.support.bad_input import ROOT

CATALOGUE = ROOT / "docs" / "bad_input.md"


def _named_in_catalogue() -> set[tuple[str, str]]:
    return set(re.findall(r"`(tests/(?:\w+/)?test_\w+\.py)::(test_\w+)`", CATALOGUE.read_text()))


def _tests_in(path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_catalogued_test_exists():
    named = _named_in_catalogue()
    assert len(named) > 20
    for file, test in named:
        assert test in _tests_in(ROOT / file), f"{file}::{test} is in {CATALOGUE.name} but not in {file}"


def test_every_bad_input_test_is_catalogued():
    named = _named_in_catalogue()
    for path in sorted((ROOT / "tests" / "bad_input").glob("test_bad_input_*.py")):
        if path.name == "test_bad_input_catalogue.py":
            continue
        file = f"tests/bad_input/{path.name}"
        missing = sorted(t for t in _tests_in(path) if (file, t) not in named)
        assert not missing, f"{file}: {missing} missing from docs/bad_input.md"
