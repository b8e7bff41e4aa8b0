"""The generated dashboards and recording rules work unchanged on every
engine: three simulators (SGLang, llama.cpp and TensorRT-LLM dialects), each
polled by a kvwatch that picks the engine from the page, one real Prometheus
with kvwatch's recording rules scraping all three. Every dashboard query and
every recorded series returns data for each engine, except where it reads a
signal or series the engine's adapter cannot provide (its dark signals).

Some queries hold data only in one phase of the workload: the exhaustion ETA
(its dashboard panel, its recorded series and the sidecar's own signal) exists
only while usage rises, over the last 5 minutes, and is at least its mean then.
So the test fixes the phase rather than hoping for it: the simulators' clocks
stand still until Prometheus scrapes every kvwatch, then the test steps them
through the light phase until Prometheus holds every engine's low usage, and
only then through the climb, the overload and the recovery. Every ETA query
then has Prometheus samples from before the climb and from the full plateau
after it, and must return data. Their absence on flat, falling or just-emptied
usage is proven in tests/promtool/eta.test.yaml (the recorded series) and
tests/test_vllm_newer_families.py (the sidecar's signal).

The LMCache tier's panels read series kvwatch exports only with
--lmcache-target: without one they are classed as needing that source, not
as failures, and a second stack (a simulator with its LMCache tier, a kvwatch
reading the tier's page, a real Prometheus) checks that each returns data."""

from __future__ import annotations

import contextlib
import re
import time

import pytest

from kvwatch.engines import ENGINES
from kvwatch.engines.coverage import dark_signals, provided
from kvwatch.sidecar.app import create_app
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from kvwatch.signals import ENGINE_SERIES, SIGNALS
from kvwatch.sim.scenario import load_scenario
from kvwatch.sim.server import start_background
from mixin_support import (GRAFANA_VARIABLES, RULES, dashboard_exprs, iter_panels, load_dashboards, load_rules,
                           metric_names)
from pageserver import serving
from promstack import free_port, prometheus, query, query_range, wait_until

# dialect -> the model_name its page gives kvwatch (llama.cpp's page names no model).
DIALECTS = {"sglang": "m-sglang", "llamacpp": "unknown", "trtllm": "m-trtllm"}
# The exhaustion scenario's light phase (1 min), overload (3 min) and most of
# its recovery, stepped LIGHT_STEP, then SIM_STEP simulated seconds every
# STEP_PAUSE s: at most 5x, then 20x wall time. A loaded machine slows the
# simulators with the test, so Prometheus's 1 s scrapes see each phase at
# least as often as on an idle one.
SIMULATED_SECONDS = 500
SIM_STEP = 2.0
STEP_PAUSE = 0.1
LIGHT_STEP = 0.5
USAGE = "kvwatch_engine_kv_cache_usage_ratio"


def advance(sims, seconds: float) -> float:
    """Step every simulator's clock, pause, and say where the clocks stand."""
    for sim in sims:
        sim.advance(seconds)
    time.sleep(STEP_PAUSE)
    return sims[0].sim.now


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
    # The objectives' recorded error ratios (kvwatch/mixin/objectives.py) need
    # the TTFT histogram, and finished requests split by reason.
    from kvwatch.mixin.objectives import OBJECTIVE_ALERTS

    needs = {"first_token": "ttft", "availability": "finished/*", "aborts": "finished/*"}
    names |= {metric for objective, (_, _, metric) in OBJECTIVE_ALERTS.items() if needs[objective] not in keys}
    return names


def _reads(expr: str, names: set[str]) -> bool:
    found = metric_names(expr)
    return any(name in names or any(part in names for part in name.split(":")) for name in found)


@pytest.fixture
def stack():
    with contextlib.ExitStack() as running:
        targets, monitors, sims = [], [], []
        for dialect, model in DIALECTS.items():
            # Speed 0: the clock stands still until the test steps it.
            sim = start_background("exhaustion", speed=0, dialect=dialect, model_name=model)
            running.callback(sim.stop)
            sims.append(sim)
            settings = load_settings(overrides={"target": sim.metrics_url, "port": 0, "poll_interval": "0.5s",
                                                "window": "5m"}, environ={})
            monitor = Monitor(settings)
            kvwatch = running.enter_context(serving(create_app(monitor, settings), start_timeout_s=10))
            monitor.start()
            running.callback(monitor.stop)
            monitors.append(monitor)
            targets.append(f"127.0.0.1:{kvwatch.port}")
        prom = running.enter_context(prometheus(targets, rule_files=[RULES], interval="1s"))
        begin = float(int(time.time()))
        reporting = {model for dialect, model in DIALECTS.items() if USAGE not in unavailable_names(dialect)}
        wait_until(lambda: len(query(prom.url, "up == 1")) == len(targets), 60, "Prometheus to scrape every kvwatch")
        # The light phase, slowly (TensorRT-LLM's usage exists only while
        # requests complete), until Prometheus holds every engine's usage from
        # before the climb.
        light = load_scenario("exhaustion").phases[0].duration
        stepped = 0.0
        while not {series["metric"]["model_name"] for series in query(prom.url, USAGE)} >= reporting:
            assert stepped + LIGHT_STEP < light, f"Prometheus scraped no usage of {sorted(reporting)} in the light phase"
            stepped = advance(sims, LIGHT_STEP)
        # Then the climb, the overload and the recovery. The simulators send
        # themselves requests (the scenario's workload); nothing else drives them.
        while stepped < SIMULATED_SECONDS:
            stepped = advance(sims, SIM_STEP)
        yield {"prometheus": prom.url, "started": begin, "monitors": monitors, "reporting": reporting}


def _depends_on_the_workload(expr: str) -> bool:
    """Queries that hold data only after something happened, whatever the
    engine: an active finding, a restart (resets()), a healthy hit ratio
    remembered, a fleet of several replicas (one simulator per engine here),
    or a cause's condition (kvwatch-causes.rules: present only while it holds),
    or an alert firing (the routes' records read ALERTS).
    tests/test_e2e_alerting.py and the promtool cases check those."""
    names = metric_names(expr)
    return ("kvwatch_finding" in names or "resets(" in expr or ":condition" in expr or "ALERTS" in names
            or ":firing" in expr
            or any("last_healthy" in name or "fleet" in name for name in names) or "last_healthy" in expr)


def _needs_lmcache(expr: str) -> bool:
    """The LMCache tier's queries: series kvwatch exports only while it reads
    an LMCache page (--lmcache-target), checked by the LMCache stack below."""
    return any(name.startswith("kvwatch_lmcache_") for name in metric_names(expr))


def _needs_kv_events(expr: str) -> bool:
    """The KV-cache event stream's queries: series kvwatch exports only while it
    reads an engine's stream (--kv-events), checked by the stream's stack below."""
    return any(name.startswith("kvwatch_kv_events_") for name in metric_names(expr))


def _needs_router(expr: str) -> bool:
    """The router's and tenants' queries: series kvwatch exports only while it
    reads a router's page (--router-target), checked by tests/test_e2e_alerting.py's
    routed engine and tests/test_tenants.py, or per LoRA adapter while it reads a
    stream whose events name adapters (tests/test_tenant_evictions.py)."""
    return any(name.startswith(("kvwatch_router_", "kvwatch_tenant_")) for name in metric_names(expr))


def _needs_rising_usage(expr: str) -> bool:
    """The exhaustion ETA: data only while the usage trend is rising
    (deriv(...) > 0). The fixture runs the climb inside the query range."""
    return "deriv(" in expr and "> 0" in expr


def test_every_engine_feeds_the_dashboards_and_rules_where_it_has_the_inputs(stack):
    prom, start, now = stack["prometheus"], stack["started"], float(int(time.time()))
    assert sorted(m.state.engine for m in stack["monitors"]) == ["llamacpp", "sglang", "trtllm"]
    rules = [rule for rule in load_rules() if "record" in rule]
    empty: list[str] = []
    skipped = checked = 0
    rising: set[str] = set()
    with_data: set[str] = set()
    lmcache: set[str] = set()
    events: set[str] = set()
    for dialect, model in DIALECTS.items():
        names = unavailable_names(dialect)
        variables = dict(GRAFANA_VARIABLES, **{"$model": model, "$__rate_interval": "10s", "$__range": "20s"})
        for dashboard in load_dashboards().values():
            for where, expr in dashboard_exprs(dashboard):
                if _needs_lmcache(expr):
                    lmcache.add(where)
                    continue
                if _needs_kv_events(expr):
                    events.add(where)
                    continue
                if _needs_router(expr):
                    skipped += 1
                    continue
                if _reads(expr, names) or _depends_on_the_workload(expr):
                    skipped += 1
                    continue
                for variable in sorted(variables, key=len, reverse=True):
                    expr = expr.replace(variable, variables[variable])
                if not query_range(prom, expr, start, now, step=2):
                    empty.append(f"{dialect}: {where}")
                else:
                    with_data.add(f"{dialect}: {where}")
                checked += 1
                if _needs_rising_usage(expr):
                    rising.add(f"{dialect}: {where}")
        for rule in rules:
            assert not _needs_lmcache(rule["expr"]), rule["record"]
            if _reads(rule["expr"], names) or _depends_on_the_workload(rule["record"] + " " + rule["expr"]):
                skipped += 1
                continue
            if not query_range(prom, f'{rule["record"]}{{model_name="{model}"}}', start, now, step=2):
                empty.append(f"{dialect}: recorded {rule['record']}")
            checked += 1
            if _needs_rising_usage(rule["expr"]):
                rising.add(f"{dialect}: recorded {rule['record']}")
    assert not empty, f"queries without data: {empty}"
    # Every cache tier in one view: SGLang's tiers (prefill_effective_tokens) on the prefix-cache board.
    assert any(where.startswith("sglang: ") and "by the cache tier" in where for where in with_data), \
        sorted(w for w in with_data if w.startswith("sglang: "))
    assert checked > 200 and skipped > 0
    # Without an LMCache target the tier's panels need that source: classed so, not failed.
    assert lmcache == set(lmcache_exprs()), sorted(lmcache)
    # Likewise the KV-cache event stream's panels without --kv-events.
    assert events == set(kv_events_exprs()), sorted(events)
    # The ETA queries were among those checked (panel, engine and model series)
    # for every engine that reports usage, and the sidecar's own ETA signal
    # (absent too unless usage rises) had data in the same run.
    assert len(rising) == 3 * len(stack["reporting"]), sorted(rising)
    for model in sorted(stack["reporting"]):
        assert query_range(prom, f'kvwatch_kv_cache_exhaustion_eta_seconds{{model_name="{model}"}}', start, now,
                           step=2), model
    # Each engine's canonical series reach Prometheus under kvwatch's names.
    for dialect, model in DIALECTS.items():
        assert query(prom, f'kvwatch_engine_generation_tokens_total{{model_name="{model}"}}'), dialect
        assert query(prom, f'kvwatch_prefix_cache_hit_ratio{{model_name="{model}"}}'), dialect


# -- the LMCache tier ----------------------------------------------------------

# The exhaustion scenario's overload evicts prefixes that later requests bring
# back: the simulated tier serves them from about 100 simulated seconds on.
LMCACHE_BEFORE = 90.0
LMCACHE_UNTIL = 300.0
LMCACHE_MODEL = "m-lmcache"


def lmcache_exprs() -> dict[str, str]:
    """Every dashboard query that reads the LMCache tier's series."""
    return {where: expr for dashboard in load_dashboards().values() for where, expr in dashboard_exprs(dashboard)
            if _needs_lmcache(expr)}


def _kvwatch_scraped(running: contextlib.ExitStack, sim, **overrides):
    """A kvwatch polling the simulator (with the extra sources in overrides),
    scraped by a real Prometheus with the generated rules; returns Prometheus."""
    settings = load_settings(overrides={"target": sim.metrics_url, "port": 0, "poll_interval": "0.5s",
                                        "window": "5m", **overrides}, environ={})
    monitor = Monitor(settings)
    kvwatch = running.enter_context(serving(create_app(monitor, settings), start_timeout_s=10))
    monitor.start()
    running.callback(monitor.stop)
    return running.enter_context(prometheus([f"127.0.0.1:{kvwatch.port}"], rule_files=[RULES], interval="1s"))


@pytest.fixture
def lmcache_stack():
    with contextlib.ExitStack() as running:
        sim = start_background("exhaustion", speed=0, model_name=LMCACHE_MODEL, lmcache_tokens=16384)
        running.callback(sim.stop)
        sim.advance(LMCACHE_BEFORE)
        prom = _kvwatch_scraped(running, sim, lmcache_target=sim.lmcache_metrics_url)
        begin = float(int(time.time()))
        wait_until(lambda: query(prom.url, "kvwatch_lmcache_up == 1"), 60, "Prometheus to scrape kvwatch's LMCache up")
        stepped = sim.sim.now
        while stepped < LMCACHE_UNTIL:
            stepped = advance([sim], SIM_STEP)
        yield {"prometheus": prom.url, "started": begin, "sim": sim}


def test_the_lmcache_panels_return_data_when_kvwatch_reads_an_lmcache_tier(lmcache_stack):
    prom, start, now = lmcache_stack["prometheus"], lmcache_stack["started"], float(int(time.time()))
    assert lmcache_stack["sim"].sim.lmcache.hit_tokens > 0
    exprs = lmcache_exprs()
    # The row's panels: up, hit ratio, prompt tokens served, retrieved and stored.
    assert len(exprs) >= 5, sorted(exprs)
    variables = dict(GRAFANA_VARIABLES, **{"$model": LMCACHE_MODEL, "$__rate_interval": "10s", "$__range": "20s"})
    empty, unlabelled = [], []
    legends = {where: target.get("legendFormat") or "" for dashboard in load_dashboards().values()
               for where, target in dashboard_targets(dashboard)}
    for where, expr in exprs.items():
        for variable in sorted(variables, key=len, reverse=True):
            expr = expr.replace(variable, variables[variable])
        series = query_range(prom, expr, start, now, step=2)
        if not series:
            empty.append(where)
        # A legend names only labels its series carry.
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legends[where]):
            if any(label not in one["metric"] for one in series):
                unlabelled.append(f"{where}: {label}")
    assert not empty, f"LMCache queries without data: {empty}"
    assert not unlabelled, f"legends naming labels their series lack: {unlabelled}"


def dashboard_targets(dashboard: dict):
    """(where, target) of every panel target, named as dashboard_exprs names them."""
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            yield f"{dashboard['uid']} panel {panel['id']} {panel['title']!r} {target['refId']}", target


# -- the KV-cache event stream ---------------------------------------------------

EVENTS_MODEL = "m-events"
EVENTS_UNTIL = 240.0  # simulated seconds of eviction pressure: prefixes evicted, then stored again


def kv_events_exprs() -> dict[str, str]:
    """Every dashboard query that reads the KV-cache event stream's series."""
    return {where: expr for dashboard in load_dashboards().values() for where, expr in dashboard_exprs(dashboard)
            if _needs_kv_events(expr)}


@pytest.fixture
def kv_events_stack():
    with contextlib.ExitStack() as running:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        # kvwatch binds the endpoint; the simulator connects to it, as vLLM does (ZMQ retries until it can).
        sim = start_background("eviction-pressure", speed=0, model_name=EVENTS_MODEL, kv_events=endpoint)
        running.callback(sim.stop)
        prom = _kvwatch_scraped(running, sim, kv_events=endpoint)
        begin = float(int(time.time()))
        wait_until(lambda: query(prom.url, "kvwatch_up == 1"), 60, "Prometheus to scrape kvwatch")
        # The stream says something only as the simulated clock moves.
        stepped = sim.sim.now
        while stepped < EVENTS_UNTIL:
            stepped = advance([sim], SIM_STEP)
        wait_until(lambda: query(prom.url, "kvwatch_kv_events_up == 1"), 30,
                   "Prometheus to scrape kvwatch reading the KV-cache events")
        wait_until(lambda: query(prom.url, "kvwatch_kv_events_blocks_stored_again_total > 0"), 30,
                   "blocks stored again after their eviction to reach Prometheus")
        yield {"prometheus": prom.url, "started": begin, "sim": sim}


def test_the_kv_event_panels_return_data_when_kvwatch_reads_the_stream(kv_events_stack):
    prom, start = kv_events_stack["prometheus"], kv_events_stack["started"]
    now = float(int(time.time()))
    exprs = kv_events_exprs()
    # The row's panels: stream up, stored/evicted/stored again, the share stored again,
    # eviction to return, and the hit ratio a larger cache would give.
    assert len(exprs) >= 6, sorted(exprs)
    variables = dict(GRAFANA_VARIABLES, **{"$model": EVENTS_MODEL, "$__rate_interval": "10s", "$__range": "20s"})
    empty = []
    for where, expr in exprs.items():
        for variable in sorted(variables, key=len, reverse=True):
            expr = expr.replace(variable, variables[variable])
        if not query_range(prom, expr, start, now, step=2):
            empty.append(where)
    assert not empty, f"KV-event queries without data: {empty}"
