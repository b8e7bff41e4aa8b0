"""The layout is a picture of the data flow: no import loops inside kvwatch,
a short list of top-level modules (the shared pipeline), the catalogue owning
the names kvwatch exports, and dashboard panel ids that do not move."""

import ast
import json
from pathlib import Path

from kvwatch.commands.generate import to_json
from kvwatch.mixin.config import MixinConfig
from kvwatch.mixin.dashboards import Board, PanelSpec
from kvwatch.mixin.metrics_doc import render
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from kvwatch.sidecar.app import create_app
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from kvwatch.signals import ENGINE_SERIES, HEALTH, SIGNALS
from pageserver import Answer, PageServer

PACKAGE = Path(__file__).resolve().parent.parent / "kvwatch"
# (The window, shared too, is a package: kvwatch/window/.) The stream's report is the event
# stream's counterpart of the page's Snapshot: a type every later stage reads.
SHARED_PIPELINE = {"cli", "units", "scrape", "exposition", "snapshot", "stream_report", "settings", "present",
                   "labels"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, known: set[str]) -> set[str]:
    """kvwatch modules a module imports, at module level, inside a function
    (a lazy import still loops, only later) or under TYPE_CHECKING (a
    type-only loop is still two modules that cannot be read apart)."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(path) for path in paths}
    graph = {}
    for path in paths:
        name = module_name(path)
        # A package's modules import their package's __init__ implicitly.
        graph[name] = {m for m in module_imports(path, known) if m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == 1:
                return stack[stack.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_loop_inside_kvwatch():
    graph = import_graph()
    assert "kvwatch.diagnose" in graph and "kvwatch.settings" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_a_type_only_import_counts(tmp_path):
    """An import under TYPE_CHECKING, or inside a function, is an edge of the
    graph like any other: a loop through one fails the test above."""
    path = tmp_path / "module.py"
    path.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from kvwatch.window import Window\n\n\n"
                    "def later():\n    import kvwatch.snapshot\n")
    assert module_imports(path, {"kvwatch.window", "kvwatch.snapshot", "kvwatch.units"}) == {
        "kvwatch.window", "kvwatch.snapshot"}


def test_top_level_modules_are_the_shared_pipeline_alone():
    top = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    assert top == SHARED_PIPELINE, f"move {sorted(top - SHARED_PIPELINE)} into the package of its job"


def test_the_documented_families_are_those_a_running_kvwatch_exports(fixtures_dir):
    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(page), Answer(page)]) as server:
        settings = load_settings(overrides={"target": server.url, "poll_interval": "1s", "timeout": "0.5s"},
                                 environ={})
        monitor = Monitor(settings)
        monitor.poll_once()
        monitor.poll_once()
    assert monitor.state.up
    exported = set()
    # The app's exposition, not make_registry's: the app adds collectors of its own.
    with TestClient(create_app(monitor)) as client:
        text = client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kvwatch_"):
            exported.add(family.name + "_total" if family.type == "counter" else family.name)
    documented = ({f.sample_name for f in HEALTH} | {s.sample_name for s in ENGINE_SERIES}
                  | {s.name for s in SIGNALS} | {"kvwatch_model_" + s.name[len("kvwatch_"):] for s in SIGNALS})
    assert exported - documented == set(), "exported but not in docs/metrics.md"
    # Every documented family is exported, bar signals with nothing to compute in two polls.
    missing = documented - exported
    assert {f.sample_name for f in HEALTH} & missing == set()
    assert all(f"`{name}`" in render() for name in {f.sample_name for f in HEALTH})


def panel_ids(specs: list[PanelSpec]) -> dict[str, int]:
    board = Board("overview", MixinConfig())
    board.row("Findings")
    for spec in specs:
        board.add(spec)
    data = json.loads(to_json(board.build().to_json_data()))
    return {panel["title"]: panel["id"] for panel in data["panels"]}


def test_adding_a_panel_changes_only_that_panel():
    specs = [PanelSpec(f"key_{n}", f"Panel {n}", "", "short", [("up", "")]) for n in range(4)]
    before = panel_ids(specs)
    after = panel_ids(specs[:1] + [PanelSpec("new", "New panel", "", "short", [("up", "")])] + specs[1:])
    assert set(after) - set(before) == {"New panel"}
    assert {title: after[title] for title in before} == before
    assert len(set(after.values())) == len(after)


def test_an_engine_is_recognised_from_its_page_through_the_adapter_registry(fixtures_dir):
    from kvwatch.engines import ENGINES, make_adapter, recognize

    assert recognize((fixtures_dir / "vllm-0.32-cpu" / "metrics-idle.txt").read_text()) == "vllm"
    assert recognize((fixtures_dir / "public" / "vllm-v0-0.5.txt").read_text()) == "vllm"
    assert recognize((fixtures_dir / "public" / "sglang-0.5.10-trimmed.txt").read_text()) == "sglang"
    assert recognize("# TYPE tgi_queue_size gauge\ntgi_queue_size 0\n") is None
    assert set(ENGINES) == {"vllm", "sglang", "llamacpp", "trtllm"}
    assert make_adapter("vllm", max_series=3).max_series == 3
    try:
        make_adapter("tgi")
    except ValueError as error:
        assert "unknown engine 'tgi' (known: vllm, sglang, llamacpp, trtllm)" in str(error)
    else:
        raise AssertionError("an unknown engine must be refused")


def test_every_unit_of_the_catalogue_has_one_entry_for_every_surface():
    from kvwatch.signals import UNITS

    used = {s.unit for s in SIGNALS} | {s.unit for s in ENGINE_SERIES}
    assert used <= set(UNITS), f"units without an entry: {sorted(used - set(UNITS))}"
