"""The markers combine: `pytest -m "not slow"` (the developer loop) leaves the
real-engine tiers out as a plain run does, and `-m vllm` still selects them.
Checked on the selection itself: collecting the tiers for real would install
vLLM (tests/vllm_tier/conftest.py)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression
from conftest import TIERS, tier_items_left_out
from slow_tests import SLOW_MODULES, SLOW_TESTS

ROOT = Path(__file__).resolve().parent.parent


class Item:
    def __init__(self, *markers: str):
        self.markers = markers

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def test_the_markers_are_registered_and_no_addopts_filter_is_left_for_a_second_m_to_replace():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {marker.split(":")[0] for marker in options["markers"]}
    assert {"slow", *TIERS} <= registered
    assert "-m" not in options.get("addopts", "").split()


@pytest.mark.parametrize("markexpr, selected", [
    ("", {"plain", "slow"}),
    ("not slow", {"plain"}),
    ("slow", {"slow"}),
    ("vllm", {"vllm", "vllm slow"}),
    ("vllm and not slow", {"vllm"}),
    ("llamacpp", {"llamacpp"}),
    ("not vllm and not llamacpp", {"plain", "slow"}),
])
def test_a_tier_runs_only_when_the_expression_names_it(markexpr, selected):
    """What a run selects: the tiers' filter (tests/conftest.py), then -m as
    pytest evaluates it."""
    items = {"plain": Item(), "slow": Item("slow"), "vllm": Item("vllm"), "vllm slow": Item("vllm", "slow"),
             "llamacpp": Item("llamacpp")}
    left_out = tier_items_left_out(markexpr, list(items.values()))
    expression = Expression.compile(markexpr) if markexpr else None
    assert {name for name, item in items.items() if item not in left_out and
            (expression is None or expression.evaluate(lambda marker, item=item: marker in item.markers))} == selected


def test_every_slow_test_listed_is_still_a_test():
    tests = ROOT / "tests"
    for module in SLOW_MODULES:
        assert (tests / module).is_file(), module
    for module, functions in SLOW_TESTS.items():
        assert module not in SLOW_MODULES, module
        tree = ast.parse((tests / module).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        stale = sorted(set(functions) - defined)
        assert not stale, f"tests/slow_tests.py names tests {module} no longer has: {stale}"
