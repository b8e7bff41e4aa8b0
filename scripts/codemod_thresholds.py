"""Rewrites reads of the diagnosis' thresholds from the old dict form to the
Thresholds dataclass' attributes: `t["hit_ratio_low"]` and
`t.get("hit_ratio_low")` become `t.hit_ratio_low`.

Only a key that is a Thresholds field, read (not assigned) from a receiver
that holds resolved thresholds, is rewritten: `t`, `….t` (the engine
context's), `resolved`, `DEFAULT_THRESHOLDS`, a call of resolve_thresholds,
and any name or attribute the same file assigns from such a call. A config
mapping (`settings.diagnosis`, a test's `thresholds` dict) and the JSON
payload's `thresholds` stay dicts and are left alone, as does a name the
file assigns a dict (routing's own thresholds). Idempotent: run it
again on a tree that has new dict reads (a branch merged in) and only those
change.

    PYTHONPATH=$PWD python scripts/codemod_thresholds.py [paths...]

Paths default to kvwatch, tests and benchmarks; it prints each file it
rewrote and how many reads.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import fields
from pathlib import Path

from kvwatch.diagnose.thresholds import Thresholds

NAMES = frozenset(f.name for f in fields(Thresholds))
# Receivers that hold resolved thresholds wherever they appear.
RECEIVER = re.compile(r"^(?:t|(?:\w+\.)+t|resolved|DEFAULT_THRESHOLDS|(?:\w+\.)*resolve_thresholds\(.*\))$", re.S)


def _assigned_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names and attributes this file assigns from resolve_thresholds(...),
    and those it assigns a dict (another set of thresholds, as routing's)."""
    resolved, dicts = set(), set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        targets = {ast.unparse(target) for target in node.targets}
        value = node.value
        if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "resolve_thresholds":
            resolved |= targets
        elif isinstance(value, (ast.Dict, ast.DictComp)) or (isinstance(value, ast.Call)
                                                             and ast.unparse(value.func) == "dict"):
            dicts |= targets
    return resolved, dicts - resolved


def _key(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES:
        return node.value
    return None


def _reads(tree: ast.AST, receivers: set[str], dicts: set[str]):
    """(receiver node, whole node, key) of each dict read of a threshold."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            receiver, key = node.value, _key(node.slice)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and not node.keywords):
            receiver, key = node.func.value, _key(node.args[0])
        else:
            continue
        text = ast.unparse(receiver)
        if key is not None and text not in dicts and (RECEIVER.match(text) or text in receivers):
            yield receiver, node, key


def rewrite(source: str) -> tuple[str, int]:
    tree = ast.parse(source)
    receivers, dicts = _assigned_names(tree)
    lines = source.encode().splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    data = source.encode()
    edits = []
    for receiver, node, key in _reads(tree, receivers, dicts):
        assert receiver.end_lineno is not None and node.end_lineno is not None and node.end_col_offset is not None
        begin = starts[receiver.end_lineno - 1] + (receiver.end_col_offset or 0)
        end = starts[node.end_lineno - 1] + node.end_col_offset
        edits.append((begin, end, f".{key}".encode()))
    for begin, end, text in sorted(edits, reverse=True):
        data = data[:begin] + text + data[end:]
    return data.decode(), len(edits)


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in (argv or ["kvwatch", "tests", "benchmarks"])]
    files = [f for p in paths for f in (sorted(p.rglob("*.py")) if p.is_dir() else [p])]
    for path in files:
        if path.name == "codemod_thresholds.py":
            continue
        source = path.read_text()
        new, count = rewrite(source)
        if count:
            path.write_text(new)
            print(f"{path}: {count} reads")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
