"""Import rules over kvwatch/ read from the source (AST), so they stay true:
no private name (`_x`) imported from another package, and no import upward
through the layers of the data flow (the diagnosis never reads the sidecar,
the pipeline never reads the HTTP surface)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvwatch"

# Lower layers never import higher ones (same layer: allowed, loops are
# tests/test_house.py's). Top-level modules by name, packages by their name.
LAYERS = {
    "units": 0, "snapshot": 0, "exposition": 0, "window": 0, "labels": 0, "stream_report": 0,
    "signals": 1, "engines": 1, "present": 1, "scrape": 1,
    "diagnose": 2, "kvevents": 2, "capacity": 2, "routing": 2,
    "pipeline": 3, "capture": 3, "history": 3, "settings": 3, "sim": 3, "sweep": 3,
    "sidecar": 4, "mixin": 4,
    "central": 5,
    "commands": 6, "cli": 6, "__main__": 6,
}


def unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "kvwatch" and len(parts) > 1 else None


def imports(path: Path):
    """(line, imported module, imported names) of every kvwatch import."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvwatch") and not node.level:
            yield node.lineno, node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvwatch."):
                    yield node.lineno, alias.name, []


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def package_of(module: str) -> str:
    return module.rpartition(".")[0] or module


def violations():
    private, upward = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_of(path)
        for line, module, names in imports(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            target_package = module if (PACKAGE.parent / module.replace(".", "/")).is_dir() else package_of(module)
            for name in names:
                if name.startswith("_") and not name.startswith("__") and target_package != package_of(me):
                    private.append(f"{where} imports {module}.{name}")
            mine, theirs = LAYERS.get(unit(me) or ""), LAYERS.get(unit(module) or "")
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{where}: {unit(me)} (layer {mine}) imports {module} (layer {theirs})")
    return private, upward


def test_every_part_of_kvwatch_has_a_layer():
    parts = {path.stem if path.parent == PACKAGE else path.relative_to(PACKAGE).parts[0]
             for path in PACKAGE.rglob("*.py")} - {"__init__"}
    assert parts - set(LAYERS) == set(), "give the new module or package a layer in LAYERS"


def test_no_private_name_is_imported_across_packages():
    assert violations()[0] == []


def test_no_import_goes_up_a_layer():
    assert violations()[1] == []


def test_the_rules_find_what_they_forbid(tmp_path, monkeypatch):
    """The checks see a private and an upward import where there are some."""
    fake = tmp_path / "kvwatch"
    (fake / "diagnose").mkdir(parents=True)
    (fake / "sidecar").mkdir()
    (fake / "sidecar" / "report.py").write_text("def _clean(v):\n    return v\n")
    (fake / "diagnose" / "timeline.py").write_text("from kvwatch.sidecar.report import _clean\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    private, upward = violations()
    assert private == ["kvwatch/diagnose/timeline.py:1 imports kvwatch.sidecar.report._clean"]
    assert upward == ["kvwatch/diagnose/timeline.py:1: diagnose (layer 2) imports kvwatch.sidecar.report (layer 4)"]
