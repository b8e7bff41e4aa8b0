"""The generated dashboards and recording rules work unchanged on every
engine: three simulators (SGLang, llama.cpp and TensorRT-LLM dialects), each
polled by a kvwatch that picks the engine from the page, one real Prometheus
with kvwatch's recording rules scraping all three. Every dashboard query and
every recorded series returns data for each engine, except where it reads a
signal or series the engine's adapter cannot provide (its dark signals)."""

from __future__ import annotations

import contextlib
import time

import pytest

from kvwatch.engines import ENGINES
from kvwatch.engines.coverage import dark_signals, provided
from kvwatch.sidecar.app import create_app
from kvwatch.sidecar.monitor import Monitor
from kvwatch.sidecar.settings import load_settings
from kvwatch.signals import ENGINE_SERIES, SIGNALS
from kvwatch.sim.server import start_background
from mixin_support import GRAFANA_VARIABLES, RULES, dashboard_exprs, load_dashboards, load_rules, metric_names
from pageserver import serving
from promstack import prometheus, query, query_range

# dialect -> the model_name its page gives kvwatch (llama.cpp's page names no model).
DIALECTS = {"sglang": "m-sglang", "llamacpp": "unknown", "trtllm": "m-trtllm"}
RUN_SECONDS = 25


def unavailable_names(engine: str) -> set[str]:
    """Series names kvwatch cannot export for this engine, and the recorded
    series built on them."""
    keys = provided(ENGINES[engine], older_builds=False)
    names: set[str] = set()
    for series in ENGINE_SERIES:
        if series.key not in keys:
            base = series.sample_name
            names |= {base, base + "_bucket", base + "_sum", base + "_count", series.name}
    for name in dark_signals(ENGINES[engine]):
        names |= {name, "kvwatch_model_" + name[len("kvwatch_"):]}
    for signal in SIGNALS:
        if signal.name in names and signal.record[0]:
            names.add(signal.record[0])
    return names


def _reads(expr: str, names: set[str]) -> bool:
    found = metric_names(expr)
    return any(name in names or any(part in names for part in name.split(":")) for name in found)


@pytest.fixture
def stack():
    with contextlib.ExitStack() as running:
        targets, monitors = [], []
        for dialect, model in DIALECTS.items():
            sim = start_background("exhaustion", speed=20, dialect=dialect, model_name=model)
            running.callback(sim.stop)
            settings = load_settings(overrides={"target": sim.metrics_url, "port": 0, "poll_interval": "0.5s",
                                                "window": "5m"}, environ={})
            monitor = Monitor(settings)
            kvwatch = running.enter_context(serving(create_app(monitor, settings), start_timeout_s=10))
            monitor.start()
            running.callback(monitor.stop)
            monitors.append(monitor)
            targets.append(f"127.0.0.1:{kvwatch.port}")
            # The simulator sends itself requests (its scenario's workload), so nothing else drives it.
        prom = running.enter_context(prometheus(targets, rule_files=[RULES], interval="1s"))
        begin = float(int(time.time()))
        time.sleep(RUN_SECONDS)
        yield {"prometheus": prom.url, "started": begin, "monitors": monitors}


def _depends_on_the_workload(expr: str) -> bool:
    """Queries that hold data only after something happened, whatever the
    engine: an active finding, a restart (resets()), a healthy hit ratio
    remembered, or a fleet of several replicas (one simulator per engine here).
    tests/test_e2e_alerting.py and the promtool cases check those."""
    names = metric_names(expr)
    return ("kvwatch_finding" in names or "resets(" in expr
            or any("last_healthy" in name or "fleet" in name for name in names) or "last_healthy" in expr)


def test_every_engine_feeds_the_dashboards_and_rules_where_it_has_the_inputs(stack):
    prom, start, now = stack["prometheus"], stack["started"], float(int(time.time()))
    assert sorted(m.state.engine for m in stack["monitors"]) == ["llamacpp", "sglang", "trtllm"]
    rules = [rule for rule in load_rules() if "record" in rule]
    empty: list[str] = []
    skipped = checked = 0
    for dialect, model in DIALECTS.items():
        names = unavailable_names(dialect)
        variables = dict(GRAFANA_VARIABLES, **{"$model": model, "$__rate_interval": "10s", "$__range": "20s"})
        for dashboard in load_dashboards().values():
            for where, expr in dashboard_exprs(dashboard):
                if _reads(expr, names) or _depends_on_the_workload(expr):
                    skipped += 1
                    continue
                for variable in sorted(variables, key=len, reverse=True):
                    expr = expr.replace(variable, variables[variable])
                if not query_range(prom, expr, start, now, step=2):
                    empty.append(f"{dialect}: {where}")
                checked += 1
        for rule in rules:
            if _reads(rule["expr"], names) or _depends_on_the_workload(rule["record"] + " " + rule["expr"]):
                skipped += 1
                continue
            if not query_range(prom, f'{rule["record"]}{{model_name="{model}"}}', start, now, step=2):
                empty.append(f"{dialect}: recorded {rule['record']}")
            checked += 1
    assert not empty, f"queries without data: {empty}"
    assert checked > 200 and skipped > 0
    # Each engine's canonical series reach Prometheus under kvwatch's names.
    for dialect, model in DIALECTS.items():
        assert query(prom, f'kvwatch_engine_generation_tokens_total{{model_name="{model}"}}'), dialect
        assert query(prom, f'kvwatch_prefix_cache_hit_ratio{{model_name="{model}"}}'), dialect
