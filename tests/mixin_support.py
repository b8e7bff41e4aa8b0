"""Helpers for the mixin tests: read the committed dashboards and rules, pull
metric names out of PromQL, substitute Grafana's variables, and list the
series kvwatch really exports (by running the exporter on real captures)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import generate_latest

REPO = Path(__file__).resolve().parent.parent
DASHBOARDS = REPO / "dashboards"
RULES = REPO / "alerts" / "kvwatch-rules.yaml"
PROMETHEUS_RULE = REPO / "alerts" / "kvwatch-prometheusrule.yaml"
GRAFANA_RULES = REPO / "alerts" / "grafana" / "kvwatch-alert-rules.json"

# Values a Grafana variable may take; `.*` is what "All" sends.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "30s",
    "$__range": "1h",
    "$namespace": ".*",
    "$job": ".*",
    "$model": ".*",
    "$engine": ".*",
}
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
            "bool", "inf", "nan", "Inf", "NaN", "atan2"}


def load_dashboards() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def iter_panels(dashboard: dict):
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expr) of every panel target."""
    found = []
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            found.append((f"{dashboard['uid']} panel {panel['id']} {panel['title']!r} {target['refId']}",
                          target["expr"]))
    return found


def annotation_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expr) of every Prometheus annotation query."""
    return [(f"{dashboard['uid']} annotation {a['name']!r}", a["expr"])
            for a in dashboard.get("annotations", {}).get("list", []) if "expr" in a]


def variable_selectors(dashboard: dict) -> list[tuple[str, str]]:
    """The series selector inside each label_values(...) variable query."""
    found = []
    for variable in dashboard["templating"]["list"]:
        match = re.match(r"label_values\((.*),\s*\w+\)$", str(variable.get("query", "")))
        if match:
            found.append((f"{dashboard['uid']} variable {variable['name']}", match.group(1)))
    return found


def substitute(expr: str) -> str:
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    return expr


def load_rules(path: Path = RULES) -> list[dict]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers that are not
    functions, keywords, label names (inside {} or grouping lists) or part of
    numbers and durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "{}", text)
    text = re.sub(r"\[[^\]]*\]", "[]", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text)
    names = set()
    for match in re.finditer(r"(?<![\w.:$])[a-zA-Z_:][\w:]*", text):
        name = match.group(0)
        rest = text[match.end():].lstrip()
        # Functions, and aggregations written `sum by (...) (...)`.
        if name in KEYWORDS or rest.startswith("(") or re.match(r"(by|without)\b", rest):
            continue
        names.add(name)
    return names


def exported_names(fixtures_dir: Path) -> set[str]:
    """Every sample name kvwatch's /metrics carries after polling the real
    vLLM 0.32 captures (the burst brings findings) beside the handwritten
    LMCache page (the tier's series), plus the names implied by each family's
    type (so families empty here still count)."""
    from kvwatch.sidecar.collector import make_registry
    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings
    from pageserver import Answer, PageServer

    pages = [(fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()
             for name in ("idle", "prefix-load", "load", "long-load")]
    lmcache = (fixtures_dir / "handwritten" / "lmcache-a.txt").read_text()
    router = (fixtures_dir / "handwritten" / "router-llm-d.txt").read_text()
    with PageServer([Answer(page) for page in pages]) as server, PageServer([Answer(lmcache)]) as tier, \
            PageServer([Answer(router)]) as router_page:
        monitor = Monitor(load_settings(overrides={"target": server.url, "lmcache_target": tier.url,
                                                   "router_target": router_page.url,
                                                   "kv_events": "tcp://127.0.0.1:1"}, environ={}))
        # The KV-cache event stream's series (never started: its events are fed here).
        from kvwatch.kvevents import wire

        batches = [[wire.stored([1, 2], 16)], [wire.removed([1])], [wire.stored([1], 16)]]
        for seq, events in enumerate(batches):
            monitor.kv_events.feed(seq, wire.encode_batch(0.0, events), now=monitor.clock())
        for _ in pages:
            monitor.poll_once()
        text = generate_latest(make_registry(monitor)).decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                        "summary": ("_sum", "_count")}.get(kind, ("",))
            names.update(family + suffix for suffix in suffixes)
            if kind == "counter":
                names.add(family if family.endswith("_total") else family + "_total")
        elif line and not line.startswith("#"):
            names.add(re.match(r"[^{ ]+", line).group(0))
    return names


def capture_names(fixtures_dir: Path) -> set[str]:
    names = set()
    for path in fixtures_dir.rglob("*.txt"):
        for line in path.read_text(errors="replace").splitlines():
            if line and not line.startswith("#"):
                match = re.match(r"[a-zA-Z_:][\w:]*", line)
                if match:
                    names.add(match.group(0))
    return names
