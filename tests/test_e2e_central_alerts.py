"""Central mode fires the sidecars' alerts, end to end: the same eight
replicas of one model and the same latency incident (tests/test_e2e_one_page.py),
exported once by eight sidecars (each its own target, job="kvwatch") and once
by central mode in two shards (each shard exports its replicas' series under
the replicas' own labels from the store: job="vllm", namespace, pod; scraped
with honor_labels, its own health beside them). Two real Prometheus servers
(Debian `prometheus`) evaluate the generated rules: the sidecars' over the
first, the central ones (mode: central, --selector {namespace="llm"}) over
the second. The alerts firing at the end are the same: the page per model,
each replica's cause alert, no KvwatchDown on either side."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from kvwatch.commands.generate import RULES_FILE, render_all
from kvwatch.mixin.config import config_from_mapping
from pageserver import Answer, LoopbackServer, Request
from promstack import free_port, query, wait_until
from test_e2e_alerting import PROMETHEUS, Processes, _ready
from test_e2e_one_page import HEALTHY_S, REPLICAS, Replica, exposition, replica_series

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not PROMETHEUS, reason="prometheus not installed")]

SCALED = {
    "rule_interval": "1s",
    "rate_window": "20s",
    "burn_rate_windows": [{"long": "60s", "short": "15s", "factor": 14.4, "severity": "critical"}],
    "objective_min_requests": 5,
    "for_durations": {"VllmTimeToFirstTokenBudgetBurn": "3s", "VllmTimeToFirstTokenSlow": "3s", "KvwatchDown": "3s"},
}


class Shard(LoopbackServer):
    """One central shard's /metrics: its replicas' series under their own labels, and its own health."""

    def __init__(self, engines: list[str], start: float):
        self.engines, self.start = engines, start
        super().__init__(name="central-shard")

    def respond(self, request: Request) -> Answer:
        families: dict[str, list[str]] = {}
        for engine in self.engines:
            own = f'job="vllm",namespace="llm",instance="10.0.0.{engine}:8000",pod="vllm-{engine}",'
            for name, lines in replica_series(engine, self.start, own).items():
                families.setdefault(name, []).extend(lines)
        families["kvwatch_central_store_up"] = ["kvwatch_central_store_up 1"]
        return Answer(exposition(families).replace("# TYPE kvwatch_central_store_up histogram",
                                                   "# TYPE kvwatch_central_store_up gauge"))


def _prometheus(processes: Processes, workdir: Path, name: str, rules: str, scrape: dict) -> str:
    (workdir / f"{name}.rules.yaml").write_text(rules)
    (workdir / f"{name}.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(workdir / f"{name}.rules.yaml")], "scrape_configs": [scrape]}))
    port = free_port()
    processes.start(name, [PROMETHEUS, f"--config.file={workdir / f'{name}.yml'}",
                           f"--storage.tsdb.path={workdir / f'{name}-data'}", f"--web.listen-address=127.0.0.1:{port}"])
    return f"http://127.0.0.1:{port}"


def _firing(prometheus: str, by: tuple[str, ...]) -> set[tuple]:
    return {tuple(a["metric"].get(label, "") for label in by)
            for a in query(prometheus, 'ALERTS{alertstate="firing"}', timeout=10)}


def test_central_mode_in_two_shards_fires_the_sidecars_alerts():
    sidecar_rules = render_all(config_from_mapping(SCALED))[RULES_FILE]
    central_rules = render_all(config_from_mapping(
        {**SCALED, "mode": "central", "deploy": {"central_selector": '{namespace="llm"}'}}))[RULES_FILE]
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-e2e-central-"))
    processes = Processes(workdir)
    start = time.time() + 3.0
    engines = [str(i) for i in range(REPLICAS)]
    servers = [Replica(engine, start) for engine in engines]
    servers += [Shard(engines[k::2], start) for k in range(2)]
    try:
        for server in servers:
            server.__enter__()
        # The sidecars: one target each, its pod as a target label (the monitors attach it).
        sidecars = _prometheus(processes, workdir, "sidecars", sidecar_rules, {
            "job_name": "kvwatch", "static_configs": [
                {"targets": [s.base_url.split("//")[1]], "labels": {"namespace": "llm", "pod": f"vllm-{s.engine}"}}
                for s in servers[:REPLICAS]]})
        central = _prometheus(processes, workdir, "central", central_rules, {
            "job_name": "kvwatch-central", "honor_labels": True, "static_configs": [
                {"targets": [s.base_url.split("//")[1]], "labels": {"namespace": "kvwatch"}} for s in servers[REPLICAS:]]})
        for url in (sidecars, central):
            wait_until(lambda url=url: _ready(f"{url}/-/ready"), 30, "prometheus ready")
        by = ("alertname", "cause", "objective", "severity", "model_name", "pod", "engine")
        wait_until(lambda: len(_firing(sidecars, by)) > REPLICAS, start + HEALTHY_S + 50 - time.time(),
                   "the sidecars' page and cause alerts")
        threading.Event().wait(3.0)  # both sides a few evaluations into the incident
        on_sidecars, on_central = _firing(sidecars, by), _firing(central, by)
        print(f"firing: sidecars {len(on_sidecars)}, central (two shards) {len(on_central)}:",
              sorted({(a[0], a[1] or a[2]) for a in on_sidecars}))
        assert on_central == on_sidecars
        assert {a[0] for a in on_sidecars} == {"VllmTimeToFirstTokenBudgetBurn", "VllmTimeToFirstTokenSlow"}
        assert len([a for a in on_sidecars if a[0] == "VllmTimeToFirstTokenSlow"]) == REPLICAS
    finally:
        processes.stop_all()
        for server in servers:
            server.__exit__(None, None, None)
        shutil.rmtree(workdir, ignore_errors=True)
