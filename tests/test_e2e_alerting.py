"""End to end on loopback: simulated vLLM engines run scenarios, `kvwatch serve`
polls each, a real Prometheus (Debian `prometheus`) scrapes them with the
generated rules loaded, and a real Alertmanager (Debian
`prometheus-alertmanager`) delivers the alerts to this test's webhook.

One stack, several scenarios side by side (each sim with its own kvwatch,
told apart by a `deployment` target label):

    exhaustion      -> VllmKvCacheExhausted{cause=concurrency_beyond_capacity}
                       and VllmTimeToFirstTokenSlow{cause=queueing_kv_bound},
                       never a hit-rate cause (its prompts share nothing,
                       and a full cache explains a low hit ratio)
    queueing        -> VllmTimeToFirstTokenSlow{cause=queueing_compute_bound}
    prefix-change   -> VllmPrefixCacheHitRateLow{cause=prefix_changed}
    upstream-delay  -> VllmTimeToFirstTokenSlow{cause=upstream} (the sim's
                       /app/metrics retrieval histogram, joined on deployment)
    no engine       -> KvwatchEngineUnreachable
    no kvwatch      -> KvwatchDown

and for each the contradicting causes must never be delivered. Then every
query of the committed dashboards returns data from this stack, and each
Grafana rule's query is above (below) its threshold exactly when its
Prometheus twin is pending or firing. Windows and `for:` are shortened by a
test config of the mixin; the sims run 4x faster than wall time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from urllib.parse import urlsplit
from pathlib import Path

import pytest
import requests
import yaml

from kvwatch.mixin import alertmanager
from kvwatch.mixin.config import config_from_mapping
from kvwatch.commands.generate import GRAFANA_RULES_FILE, RULES_FILE, render_all
from kvwatch.mixin.rules import expand, recorded_exprs, split_alert_expr
from mixin_support import GRAFANA_VARIABLES, annotation_exprs, iter_panels, load_dashboards
from pageserver import Answer, LoopbackServer, PageServer, Request
from promstack import free_port, query, query_range, stop_process, wait_until
from test_e2e_offload_tier import reads_tier, tier_names

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
pytestmark = pytest.mark.skipif(not (PROMETHEUS and ALERTMANAGER),
                                reason="prometheus and alertmanager not installed (make system-deps)")

SPEED = 4
RATE_WINDOW = "20s"
TEST_CONFIG = {
    "rate_window": RATE_WINDOW,
    "rule_interval": "1s",
    "cold_cache_window": "25s",
    "hit_ratio_baseline_window": "40s",
    "group_labels": ["namespace", "job", "deployment"],
    "for_durations": {"VllmKvCacheExhausted": "5s", "VllmPrefixCacheHitRateLow": "5s",
                      "VllmTimeToFirstTokenSlow": "5s", "KvwatchDown": "3s", "KvwatchEngineUnreachable": "3s",
                      "VllmFleetReplicaOutlier": "5s", "VllmEngineStatsDisabled": "3s",
                      "VllmTimeToFirstTokenBudgetBurn": "3s", "VllmRequestErrorBudgetBurn": "3s",
                      "VllmRequestAbortBudgetBurn": "3s"},
    # The page's pair, scaled down with the rest (the sims run 4x): 60 s and 15 s at 14.4x.
    "burn_rate_windows": [{"long": "60s", "short": "15s", "factor": 14.4, "severity": "critical"}],
    # The traffic guard, scaled down with the windows (a minute, not an hour, of the sims' requests).
    "objective_min_requests": 5,
    "upstream_histogram": "app_retrieval_seconds",
    "upstream_selector": 'job="rag-app"',
    "upstream_join_labels": ["deployment"],
    "dashboard_url_pattern": "https://grafana.example.org/d/{uid}?var-model={model_name}&viewPanel={panel_id}",
}
HIT_RATE_CAUSES = {"caching_disabled", "cold_cache", "prefix_changed", "eviction_before_reuse", "no_reuse"}
SCENARIOS = {
    "exhaustion": {"expect": {("VllmKvCacheExhausted", "concurrency_beyond_capacity"),
                              ("VllmTimeToFirstTokenSlow", "queueing_kv_bound")},
                   # While the cache preempts, the first token's residual is preemption, never the front end.
                   "forbid": {"long_requests", "queueing_compute_bound", "front_end"} | HIT_RATE_CAUSES},
    "queueing": {"expect": {("VllmTimeToFirstTokenSlow", "queueing_compute_bound")},
                 "forbid": {"queueing_kv_bound", "concurrency_beyond_capacity", "long_requests"}},
    "prefix-change": {"expect": {("VllmPrefixCacheHitRateLow", "prefix_changed")},
                      "forbid": {"no_reuse", "eviction_before_reuse", "caching_disabled", "cold_cache"}},
    "upstream-delay": {"expect": {("VllmTimeToFirstTokenSlow", "upstream")},
                       "forbid": {"prefill", "front_end", "queueing_kv_bound", "queueing_compute_bound"}},
    # Nothing at all: no page, no cause.
    "healthy": {"expect": set(), "forbid": set()},
}
ROUTED = "healthy"  # the scenario whose engine sits behind a simulated router
# The first-token objective pages these once each, with the cause alert that explains it.
PAGED = {"exhaustion": "queueing_kv_bound", "queueing": "queueing_compute_bound"}
RECEIVERS = ("pager", "platform", "application", "tickets")
ALERT_DEADLINE = 150.0  # wall seconds from the start for every expected alert
# What vLLM serves on /metrics with --disable-log-stats: the process' own series, no engine's.
STATS_OFF_PAGE = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n"


class Webhook(LoopbackServer):
    """Alertmanager's receivers (one path each): keeps every notification and alert it is sent."""

    def __init__(self):
        self.alerts: list[dict] = []
        self.notifications: list[tuple[str, float, dict]] = []  # (receiver path, time, payload)
        self.lock = threading.Lock()
        super().__init__(name="alert-webhook")
        self.url = self.base_url + "/alerts"

    def respond(self, request: Request) -> Answer:
        if request.method != "POST":
            return Answer(status=405)
        payload = json.loads(request.body)
        with self.lock:
            self.alerts.extend(payload.get("alerts", []))
            self.notifications.append((request.path.strip("/"), time.time(), payload))
        return Answer()

    def sent_to(self, receiver: str) -> list[tuple[float, dict]]:
        with self.lock:
            return [(at, payload) for path, at, payload in self.notifications if path == receiver]

    def received(self) -> list[dict]:
        with self.lock:
            return list(self.alerts)


class Processes:
    """Child processes with their logs, all stopped at exit."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.children: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "w")
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                   start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.children.append((name, process))
        return process

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def stop_all(self) -> None:
        for _, process in reversed(self.children):
            if process.poll() is None:
                process.terminate()
        for _, process in self.children:
            stop_process(process)


def _ready(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.RequestException:
        return False


def prom_query(prometheus: str, expr: str, at: float | None = None) -> list[dict]:
    return query(prometheus, expr, at, timeout=10)


@pytest.fixture(scope="module")
def stack():
    """Everything running; yields a dict with the URLs, the webhook and the start time."""
    config = config_from_mapping(TEST_CONFIG)
    files = render_all(config)
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-e2e-alerting-"))
    processes = Processes(workdir)
    python = sys.executable
    try:
        with Webhook() as webhook, PageServer([Answer(STATS_OFF_PAGE)]) as stats_off:
            (workdir / "rules.yaml").write_text(files[RULES_FILE])
            am_port = free_port()
            # The generated example, its receivers pointed at this test's webhook
            # and its timing scaled down with the rest.
            example = alertmanager.example(config, {name: f"{webhook.base_url}/{name}" for name in RECEIVERS})
            example["route"].update({"group_wait": "1s", "group_interval": "1s", "repeat_interval": "5s"})
            for route in example["route"]["routes"]:
                route.pop("repeat_interval", None)
            (workdir / "alertmanager.yml").write_text(yaml.safe_dump(example))
            processes.start("alertmanager", [
                ALERTMANAGER, f"--config.file={workdir / 'alertmanager.yml'}",
                f"--storage.path={workdir / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address="])

            kvwatch_targets, app_targets = [], []
            for scenario in SCENARIOS:
                sim_port, kv_port = free_port(), free_port()
                # The healthy engine sits behind a simulated prefix-aware router (fresh index: no
                # routing cause), whose page kvwatch reads: the router row's panels get data.
                router = scenario == ROUTED
                processes.start(f"sim-{scenario}", [
                    python, "-m", "kvwatch", "sim", "--scenario", scenario, "--port", str(sim_port),
                    "--speed", str(SPEED), "--duration", "400", *(["--router", "prefix"] if router else [])])
                processes.start(f"kvwatch-{scenario}", [
                    python, "-m", "kvwatch", "serve", "--target", f"http://127.0.0.1:{sim_port}",
                    "--port", str(kv_port), "--poll-interval", "1s", "--window", "30s",
                    *(["--router-target", f"http://127.0.0.1:{sim_port}/router/metrics"] if router else [])])
                kvwatch_targets.append({"targets": [f"127.0.0.1:{kv_port}"], "labels": {"deployment": scenario}})
                if scenario == "upstream-delay":
                    app_targets.append({"targets": [f"127.0.0.1:{sim_port}"], "labels": {"deployment": scenario}})
            # A kvwatch whose engine does not answer past its (short) load grace, and a kvwatch target nobody serves.
            dead_engine, no_kvwatch, kv_port = free_port(), free_port(), free_port()
            processes.start("kvwatch-no-engine", [
                python, "-m", "kvwatch", "serve", "--target", f"http://127.0.0.1:{dead_engine}",
                "--port", str(kv_port), "--poll-interval", "1s", "--window", "30s", "--load-grace", "2s"])
            kvwatch_targets.append({"targets": [f"127.0.0.1:{kv_port}"], "labels": {"deployment": "no-engine"}})
            # A kvwatch whose engine is still loading its weights (no answer yet, within the default grace).
            loading_engine, kv_port = free_port(), free_port()
            processes.start("kvwatch-loading", [
                python, "-m", "kvwatch", "serve", "--target", f"http://127.0.0.1:{loading_engine}",
                "--port", str(kv_port), "--poll-interval", "1s", "--window", "30s"])
            kvwatch_targets.append({"targets": [f"127.0.0.1:{kv_port}"], "labels": {"deployment": "loading"}})
            # A kvwatch whose engine answers without statistics (vLLM with --disable-log-stats).
            kv_port = free_port()
            processes.start("kvwatch-no-stats", [
                python, "-m", "kvwatch", "serve", "--target", stats_off.url,
                "--port", str(kv_port), "--poll-interval", "1s", "--window", "30s"])
            kvwatch_targets.append({"targets": [f"127.0.0.1:{kv_port}"], "labels": {"deployment": "no-stats"}})
            kvwatch_targets.append({"targets": [f"127.0.0.1:{no_kvwatch}"], "labels": {"deployment": "no-kvwatch"}})

            prom_port = free_port()
            (workdir / "prometheus.yml").write_text(yaml.safe_dump({
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
                "rule_files": [str(workdir / "rules.yaml")],
                "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
                "scrape_configs": [
                    {"job_name": "kvwatch", "static_configs": kvwatch_targets},
                    {"job_name": "rag-app", "metrics_path": "/app/metrics", "static_configs": app_targets},
                ],
            }))
            processes.start("prometheus", [
                PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'prom-data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                "--storage.tsdb.retention.time=1h"])
            prometheus = f"http://127.0.0.1:{prom_port}"
            started = time.time()
            wait_until(lambda: _ready(f"http://127.0.0.1:{am_port}/-/ready"), 30, "alertmanager ready")
            wait_until(lambda: _ready(f"{prometheus}/-/ready"), 30, "prometheus ready")
            wait_until(lambda: len(prom_query(prometheus, 'kvwatch_up{job="kvwatch"} == 1')) == len(SCENARIOS),
                       60, "every kvwatch polling its sim")
            yield {"prometheus": prometheus, "webhook": webhook, "started": started, "config": config,
                   "files": files, "processes": processes, "kvwatch_targets": kvwatch_targets}
    finally:
        processes.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


def delivered(webhook: Webhook) -> set[tuple[str, str, str]]:
    return {(a["labels"].get("deployment", ""), a["labels"]["alertname"], a["labels"].get("cause", ""))
            for a in webhook.received()}


@pytest.fixture(scope="module")
def alerts_delivered(stack):
    """Waits until Alertmanager delivered every expected alert; returns
    (deliveries, seconds from start to each first delivery)."""
    webhook = stack["webhook"]
    expected = {(scenario, alert, cause) for scenario, spec in SCENARIOS.items() for alert, cause in spec["expect"]}
    expected |= {("no-engine", "KvwatchEngineUnreachable", "engine_unreachable"),
                 ("no-stats", "VllmEngineStatsDisabled", "stats_disabled"),
                 ("no-kvwatch", "KvwatchDown", "kvwatch_unreachable")}
    expected |= {(scenario, "VllmTimeToFirstTokenBudgetBurn", "") for scenario in PAGED}
    first_seen: dict[tuple, float] = {}

    def all_there():
        got = delivered(webhook)
        for item in got & expected:
            first_seen.setdefault(item, time.time() - stack["started"])
        return expected <= got

    try:
        wait_until(all_there, ALERT_DEADLINE, "every expected alert at the webhook", interval=1.0)
    except AssertionError:
        missing = expected - delivered(webhook)
        logs = {name: stack["processes"].log(name) for name in ("prometheus", "alertmanager")}
        raise AssertionError(f"not delivered: {sorted(missing)}; delivered: {sorted(delivered(webhook))}; "
                             f"logs: {logs}") from None
    return delivered(webhook), first_seen


def test_alertmanager_delivers_the_expected_alerts_with_their_causes(stack, alerts_delivered):
    deliveries, first_seen = alerts_delivered
    print("first delivery, seconds after start:",
          {f"{d}/{a}/{c}": round(t, 1) for (d, a, c), t in sorted(first_seen.items())})
    print("all deliveries (deployment, alert, cause):", sorted(deliveries))
    runbooks_page = requests.get(f"http://{stack['kvwatch_targets'][0]['targets'][0]}/runbooks", timeout=10).text
    for alert in stack["webhook"].received():
        labels = alert["labels"]
        if labels["alertname"].startswith("Vllm") and labels["alertname"] != "VllmEngineStatsDisabled":
            # A cause alert is per engine; a page per model, over all its replicas.
            assert {"severity", "symptom", "model_name"} <= set(labels), labels
            assert ("engine" in labels and "cause" in labels) or ("objective" in labels and "engine" not in labels), labels
            assert alert["annotations"]["runbook_url"].split("#")[1].startswith(labels["alertname"].lower())
            assert "{{" not in alert["annotations"]["description"]  # templates rendered
            assert alert["annotations"]["dashboard_url"].find("var-model=tiny-llama") > 0
        # Every runbook link as delivered names a host of its own (KvwatchDown{cause="kvwatch_absent"}
        # has no instance) and a section that a kvwatch serves at /runbooks too.
        url = urlsplit(alert["annotations"]["runbook_url"])
        assert url.scheme == "https" and url.hostname and url.fragment, (labels, url)
        assert f'<a id="{url.fragment}"></a>' in runbooks_page, url


def test_the_objective_pages_once_per_engine_with_its_cause_beside_it(stack, alerts_delivered):
    webhook, started = stack["webhook"], stack["started"]
    pages: dict[str, set[str]] = {}
    first_page: dict[str, float] = {}
    named: dict[str, set[str]] = {}
    replicas: dict[str, set[str]] = {}
    for at, payload in webhook.sent_to("pager"):
        deployment = payload["groupLabels"].get("deployment", "")
        pages.setdefault(deployment, set()).add(payload["groupKey"])
        for alert in payload["alerts"]:
            if alert["labels"]["alertname"] == "VllmTimeToFirstTokenBudgetBurn" and alert["status"] == "firing":
                first_page.setdefault(deployment, at - started)
                named.setdefault(deployment, set()).add(alert["annotations"].get("cause_alerts", ""))
                replicas.setdefault(deployment, set()).add(alert["annotations"].get("burning_replicas", "{{"))
    print("time to page (wall s from start, sims at 4x):", {d: round(t, 1) for d, t in sorted(first_page.items())})
    counts = {}
    for path, _, payload in webhook.notifications:
        key = (payload["groupLabels"].get("deployment", ""), path)
        counts[key] = counts.get(key, 0) + 1
    print("notifications (deployment, receiver): count, pager groups:", dict(sorted(counts.items())),
          {d: len(keys) for d, keys in sorted(pages.items())})
    print("replicas burning, as paged:", replicas)
    # The page's list of replicas is rendered (a template query when Prometheus sends it).
    assert replicas and all(re.fullmatch(r"(127\.0\.0\.1:\d+ \(engine 0: [\d.]+%\) )+", text)
                            for texts in replicas.values() for text in texts), replicas
    for scenario, cause in PAGED.items():
        # One page: one notification group for the model (grouped by model and the group labels).
        assert len(pages.get(scenario, ())) == 1, (scenario, pages)
        group = next(payload["groupLabels"] for _, payload in webhook.sent_to("pager")
                     if payload["groupLabels"].get("deployment") == scenario)
        assert {"model_name", "deployment"} <= set(group) and not {"instance", "engine"} & set(group), group
        # The cause alert, in the same model's group at the team that can act.
        causes = [payload for _, payload in webhook.sent_to("platform")
                  if payload["groupLabels"] == group
                  and any(a["labels"].get("cause") == cause for a in payload["alerts"])]
        assert causes, (scenario, cause)
    # The healthy engine and the one still loading its weights: nothing delivered anywhere, no page.
    for quiet in ("healthy", "loading"):
        assert not any(a["labels"].get("deployment") == quiet for a in webhook.received()), quiet
        assert quiet not in pages


def test_contradicting_causes_are_never_delivered(stack, alerts_delivered):
    deliveries, _ = alerts_delivered
    for scenario, spec in SCENARIOS.items():
        causes = {cause for deployment, _, cause in deliveries if deployment == scenario}
        assert not causes & spec["forbid"], (scenario, causes)
    # The queueing scenario never saw a full cache: no exhaustion at all.
    assert not {a for d, a, _ in deliveries if d == "queueing" and a == "VllmKvCacheExhausted"}
    # No Prometheus series ever held both queueing causes for one engine at once.
    both = prom_query(stack["prometheus"],
                      'count by (instance, engine) (max_over_time(ALERTS{cause=~"queueing_(kv|compute)_bound"}[10m])) > 1')
    assert both == [] or all(_never_simultaneous(stack, r["metric"]) for r in both)
    # One story: at no evaluation did two causes of one symptom fire for one engine
    # (the objective's burn alerts carry the symptom and no cause: they page, the cause explains).
    two = query_range(stack["prometheus"],
                      'count by (deployment, instance, engine, symptom) (count by (deployment, instance, engine, '
                      'symptom, cause) (ALERTS{alertstate="firing", symptom!="", cause!=""})) > 1',
                      stack["started"], time.time())
    assert two == [], [r["metric"] for r in two]


def _never_simultaneous(stack, metric: dict) -> bool:
    now = time.time()
    series = query_range(stack["prometheus"],
                        f'count by (instance, engine) (ALERTS{{instance="{metric["instance"]}",'
                        f'cause=~"queueing_(kv|compute)_bound"}}) > 1', stack["started"], now)
    return series == []


def test_every_dashboard_query_returns_data(stack, alerts_delivered):
    prometheus, now = stack["prometheus"], float(int(time.time()))
    substitutions = dict(GRAFANA_VARIABLES, **{"$__rate_interval": RATE_WINDOW})
    empty = []
    dashboards = dict(load_dashboards())
    # The upstream line exists only with an upstream histogram configured: check the test config's board too.
    dashboards["first-token (test config)"] = json.loads(stack["files"]["dashboards/kvwatch-first-token.json"])
    # The objectives' panels read the recorded error ratios, named by window: the
    # test config's windows (60s, 15s) stand for the default's (1h, 5m ...).
    dashboards["overview (test config)"] = json.loads(stack["files"]["dashboards/kvwatch-overview.json"])
    unlabelled = []
    checked = lmcache = events = offload = tenants = 0
    offload_names = tier_names()
    for name, dashboard in dashboards.items():
        for panel in iter_panels(dashboard):
            for target in panel.get("targets", []):
                where = f"{dashboard['uid']} panel {panel['id']} {panel['title']!r} {target['refId']}"
                expr = target["expr"]
                for variable in sorted(substitutions, key=len, reverse=True):
                    expr = expr.replace(variable, substitutions[variable])
                if ":ratio_rate" in expr and "(test config)" not in name:
                    continue  # the committed board's windows; the test config's board is checked instead
                if "kvwatch_lmcache_" in expr:
                    # The LMCache tier's panels: no --lmcache-target here (tests/test_e2e_engines.py
                    # checks them against the simulator's tier).
                    lmcache += 1
                    continue
                if "kvwatch_kv_events_" in expr:
                    # The KV-cache event stream's panels: no --kv-events here (tests/test_e2e_engines.py
                    # checks them against the simulator's stream).
                    events += 1
                    continue
                if "kvwatch_tenant_" in expr:
                    # Per tenant: the simulated router labels no fairness_id, so no tenant has data here
                    # (tests/test_tenants.py checks the family's series from tenant-labelled pages).
                    tenants += 1
                    continue
                if reads_tier(expr, offload_names):
                    # vLLM's offload tier: the simulator has no offload connector (tests/test_e2e_offload_tier.py
                    # checks these panels against pages that carry its families).
                    offload += 1
                    continue
                series = query_range(prometheus, expr, stack["started"], now, step=2)
                # Restart counts (resets() > 0) have data only after a restart, and nothing here restarts.
                if not series and "resets(" not in expr:
                    empty.append(where)
                # A legend names only labels its series carry (else Grafana shows the name blank).
                for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat") or ""):
                    if any(label not in one["metric"] for one in series):
                        unlabelled.append(f"{where}: {label}")
                checked += 1
    # The firing-alerts annotation of every board marks the alerts this stack fired.
    for dashboard in load_dashboards().values():
        for where, expr in annotation_exprs(dashboard):
            if "ALERTS{" in expr:
                for variable in sorted(substitutions, key=len, reverse=True):
                    expr = expr.replace(variable, substitutions[variable])
                if not query_range(prometheus, expr, stack["started"], now, step=2):
                    empty.append(where)
                checked += 1
    assert checked > 90 and lmcache > 0 and events > 0 and offload >= 3
    assert not unlabelled, f"legends naming labels their series lack: {unlabelled}"
    assert not empty, f"dashboard queries without data: {empty}"


def test_grafana_rules_cross_their_thresholds_exactly_when_the_twins_fire(stack, alerts_delivered):
    prometheus = stack["prometheus"]
    start, end = float(int(stack["started"] + 5)), float(int(time.time()))
    grafana = json.loads(stack["files"][GRAFANA_RULES_FILE])
    # A cause may fire by two routes (its rules, or kvwatch's finding: label route): each has its twin.
    alerts = {(r["alert"], r["labels"].get("cause") or r["labels"]["objective"], r["labels"]["severity"],
               r["labels"].get("route", "")): r
              for g in yaml.safe_load(stack["files"][RULES_FILE])["groups"] for r in g["rules"] if "alert" in r}
    recorded = recorded_exprs(stack["config"])
    fired = 0
    for rule in grafana["groups"][0]["rules"]:
        labels = rule["labels"]
        alert, severity = rule["title"].split(" ")[0], labels["severity"]
        cause = labels.get("cause") or labels["objective"]
        key = "cause" if "cause" in labels else "objective"
        query = next(q["model"]["expr"] for q in rule["data"] if q["refId"] == "A")
        condition = next(q["model"]["expression"] for q in rule["data"] if q["refId"] == rule["condition"])
        op, threshold = condition.split(" ")[1], condition.split(" ")[2]
        route = labels.get("route", "")
        twin_query, twin_op, twin_threshold = split_alert_expr(alerts[(alert, cause, severity, route)]["expr"])
        assert (expand(twin_query, recorded), twin_op, twin_threshold) == (query, op, float(threshold))
        crossing = _timeline(query_range(prometheus, f"({query}) {op} {threshold}", start, end))
        firing = _timeline(query_range(
            prometheus, f'ALERTS{{alertname="{alert}",{key}="{cause}",severity="{severity}",route="{route}"}}',
            start, end))
        if firing:
            fired += 1
        for key in set(crossing) | set(firing):
            a, b = crossing.get(key, set()), firing.get(key, set())
            # Prometheus evaluates at its own instants and the range query
            # samples at others: allow disagreement only within 3 s of a
            # change of either; everywhere else the two must agree.
            edges = _edges(a, start, end) | _edges(b, start, end)
            mismatches = [t for t in a ^ b if not any(abs(t - e) <= 3 for e in edges)]
            assert not mismatches, (alert, cause, key, sorted(mismatches)[:5])
            if not (a and b):  # only a blip shorter than the sampling can be seen by one side alone
                assert len(a | b) <= 6, (alert, cause, key, "one side never held")
    assert fired >= 6


def _timeline(result: list[dict]) -> dict[tuple, set[float]]:
    """{(deployment, instance, engine): timestamps where the series exists}."""
    out: dict[tuple, set[float]] = {}
    for series in result:
        metric = series["metric"]
        key = (metric.get("deployment", ""), metric.get("instance", ""), metric.get("engine", ""))
        out.setdefault(key, set()).update(round(float(t)) for t, _ in series["values"])
    return out


def _edges(times: set[float], start: float, end: float) -> set[float]:
    edges = set()
    for t in times:
        if t - 1 not in times and t - 1 >= round(start):
            edges.add(t)
        if t + 1 not in times and t + 1 <= round(end):
            edges.add(t + 1)
    return edges
