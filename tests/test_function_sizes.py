"""No function in kvwatch/ over 80 lines: a function that long does several
jobs, has many exits, and the next change to one of them reads all of them.
Every kvwatch/**/*.py counts, bar generated files (the same first-line mark
as tests/test_file_sizes.py); a function's lines run from its `def` to its
last line, nested functions and methods counted each on their own too. A
function over the limit is split into small named steps, not squeezed."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from test_file_sizes import is_generated

REPO = Path(__file__).resolve().parent.parent
LIMIT = 80
# Functions still over the limit, with their length today: each may shrink,
# never grow, and fails the test once it is at most LIMIT lines or gone (take
# it out then), so the list only shrinks.
OVER_FOR_NOW: dict[str, int] = {
    "kvwatch/capacity/arithmetic.py:kv_structure": 140,
    "kvwatch/capacity/arithmetic.py:compute_capacity": 101,
    "kvwatch/capacity/hardware.py:count_weights": 202,
    "kvwatch/central/app.py:create_central_app": 95,
    "kvwatch/commands/capture.py:run": 101,
    "kvwatch/commands/diagnose.py:run": 129,
    "kvwatch/commands/diagnose.py:print_report": 90,
    "kvwatch/commands/sim.py:run": 107,
    "kvwatch/diagnose/hit_rate.py:_judge_hit_rate": 219,
    "kvwatch/engines/vllm.py:VllmAdapter._read_page": 162,
    "kvwatch/engines/vllm_plan.py:_PagePlan.__init__": 153,
    "kvwatch/kvevents/source.py:KVEventSource.report": 83,
    "kvwatch/mixin/alerts.py:alert_specs": 315,
    "kvwatch/mixin/config.py:_check_field": 125,
    "kvwatch/mixin/dashboards.py:overview": 113,
    "kvwatch/pipeline/monitor.py:Monitor._ingest": 92,
    "kvwatch/settings.py:load_settings": 83,
    "kvwatch/sidecar/app.py:create_app": 94,
    "kvwatch/sim/dialects.py:render_sglang": 88,
    "kvwatch/sim/engine.py:Engine._schedule": 108,
    "kvwatch/sim/render.py:render_vllm": 81,
    "kvwatch/sim/scenario.py:parse_scenario": 97,
}


def function_lengths(source: str) -> dict[str, int]:
    """qualified name (Class.method, outer.inner) -> lines from `def` to the end, for every function."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                # A redefinition (a property's setter) keeps the longer of the two.
                found[name] = max(found.get(name, 0), child.end_lineno - child.lineno + 1)
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


@functools.lru_cache(maxsize=4)  # the three checks read the package once
def too_long(root: Path = REPO, limit: int = LIMIT) -> dict[str, int]:
    """'path:qualified name' -> lines, for each function of kvwatch/ over `limit`."""
    over = {}
    for path in sorted(root.glob("kvwatch/**/*.py")):
        text = path.read_text(encoding="utf-8")
        if is_generated(text):
            continue
        relative = path.relative_to(root).as_posix()
        over.update({f"{relative}:{name}": lines for name, lines in function_lengths(text).items() if lines > limit})
    return over


def test_no_function_is_over_the_limit():
    over = {name: lines for name, lines in too_long().items() if name not in OVER_FOR_NOW}
    assert not over, "split these into small named steps (at most %d lines each): %s" % (
        LIMIT, ", ".join(f"{name} ({lines} lines)" for name, lines in sorted(over.items())))


def test_no_function_allowed_over_the_limit_grew():
    grown = {name: lines for name, lines in too_long().items() if lines > OVER_FOR_NOW.get(name, lines)}
    assert not grown, "over the limit and longer than allowed (split it rather): " + ", ".join(
        f"{name} ({lines} lines, allowed {OVER_FOR_NOW[name]})" for name, lines in sorted(grown.items()))


def test_every_function_allowed_over_the_limit_still_is():
    over = too_long()
    back = sorted(name for name in OVER_FOR_NOW if name not in over)
    assert not back, f"now at most {LIMIT} lines (or gone): take {', '.join(back)} out of OVER_FOR_NOW"


def test_lengths_name_methods_and_nested_functions():
    source = ("def outer():\n    def inner():\n        return 1\n    return inner\n\n"
              "class Box:\n    async def fill(self):\n        x = 1\n\n        return x\n")
    assert function_lengths(source) == {"outer": 4, "outer.inner": 2, "Box.fill": 4}


@pytest.mark.parametrize("body_lines, generated, expected", [
    (79, False, {}),
    (80, False, {"kvwatch/big.py:long": 81}),
    (200, True, {}),
])
def test_the_check_names_the_function_and_its_length(tmp_path, body_lines, generated, expected):
    (tmp_path / "kvwatch" / "sub").mkdir(parents=True)
    head = "# Generated by `kvwatch generate`; do not edit.\n" if generated else ""
    (tmp_path / "kvwatch" / "big.py").write_text(head + "def long():\n" + "    x = 1\n" * body_lines)
    (tmp_path / "kvwatch" / "sub" / "small.py").write_text("def short():\n    return 1\n")
    assert too_long(tmp_path) == expected
