"""Central mode in two real shards fires the sidecars' alerts, end to end
over simulated replicas: no scripted exports on either side.

Three simulated vLLM replicas of one model (`kvwatch sim`, two queueing, one
healthy, at SPEED times wall time) are scraped by a store Prometheus
(job="vllm", namespace and pod as target labels). Beside each replica a
sidecar (`kvwatch serve --target`) is scraped by the same store as
job="kvwatch", and the store evaluates the generated sidecar rules over
them. Two `kvwatch serve --prometheus STORE --shard k/2` processes read the
replicas back from the store and export them under the replicas' own
labels; a second Prometheus scrapes the two shards (honor_labels) and
evaluates the generated central rules. Each Prometheus notifies its own
Alertmanager (the generated example), and each Alertmanager this test's
webhook. The pod names are picked so that each shard owns a replica.

What must hold: every alert that fired on one side fired on the other
(alert, cause or objective, severity, model, pod, engine), the page among
them, and each side paged once. The counts are printed (docs/alerts.md
quotes them)."""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from kvwatch.commands.generate import RULES_FILE, render_all
from kvwatch.history.shard import identity, owner
from kvwatch.mixin import alertmanager
from kvwatch.mixin.config import config_from_mapping
from promstack import free_port, query, wait_until
from test_e2e_alerting import ALERTMANAGER, PROMETHEUS, RECEIVERS, Processes, Webhook, _ready

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (PROMETHEUS and ALERTMANAGER),
                                 reason="prometheus and alertmanager not installed (make system-deps)")]

SPEED = 4
SCENARIOS = ("queueing", "queueing", "healthy")
SCALED = {
    # Replicas named by pod, as on Kubernetes: a sidecar's address and its replica's differ, the pod is the same.
    "instance_label": "pod",
    "rule_interval": "1s",
    "rate_window": "20s",
    "burn_rate_windows": [{"long": "60s", "short": "15s", "factor": 14.4, "severity": "critical"}],
    "objective_min_requests": 5,
    # KvwatchDown keeps its default (5m): at 3 s its kvwatch_absent cause fired on both sides early in the run.
    "for_durations": {"VllmTimeToFirstTokenBudgetBurn": "3s", "VllmTimeToFirstTokenSlow": "5s",
                      "VllmKvCacheExhausted": "5s", "VllmPrefixCacheHitRateLow": "5s"},
}
BY = ("alertname", "cause", "objective", "severity", "model_name", "pod", "engine")
DEADLINE_S = 150.0
PAGE = "VllmTimeToFirstTokenBudgetBurn"


def _pods(targets: list[str]) -> list[str]:
    """Pod names for the replicas at `targets` such that both shards own at least one."""
    for attempt in range(1000):
        pods = [f"vllm-{attempt}-{i}" for i in range(len(targets))]
        owners = {owner(identity(("job", "instance", "namespace", "pod"), ("vllm", target, "llm", pod)), 2)
                  for target, pod in zip(targets, pods)}
        if owners == {0, 1}:
            return pods
    raise AssertionError("no pod names split the replicas over two shards")


def _stack(processes: Processes, name: str, rules: str, scrapes: list[dict], webhook: Webhook) -> str:
    """An Alertmanager with the generated example notifying `webhook`, and a Prometheus with `rules`."""
    workdir = processes.workdir
    config = config_from_mapping(SCALED)
    example = alertmanager.example(config, {receiver: f"{webhook.base_url}/{receiver}" for receiver in RECEIVERS})
    example["route"].update({"group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"})
    for route in example["route"]["routes"]:
        route.pop("repeat_interval", None)
    (workdir / f"{name}-am.yml").write_text(yaml.safe_dump(example))
    am_port, prom_port = free_port(), free_port()
    processes.start(f"{name}-alertmanager", [
        ALERTMANAGER, f"--config.file={workdir / f'{name}-am.yml'}", f"--storage.path={workdir / f'{name}-am-data'}",
        f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="])
    (workdir / f"{name}.rules.yaml").write_text(rules)
    (workdir / f"{name}.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(workdir / f"{name}.rules.yaml")],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": scrapes}))
    processes.start(name, [PROMETHEUS, f"--config.file={workdir / f'{name}.yml'}",
                           f"--storage.tsdb.path={workdir / f'{name}-data'}", f"--web.listen-address=127.0.0.1:{prom_port}"])
    url = f"http://127.0.0.1:{prom_port}"
    wait_until(lambda: _ready(f"http://127.0.0.1:{am_port}/-/ready"), 30, f"{name} alertmanager ready")
    wait_until(lambda: _ready(f"{url}/-/ready"), 30, f"{name} prometheus ready")
    return url


def _fired(prometheus: str, since: float) -> set[tuple]:
    """Every alert that fired since `since`, by BY."""
    span = f"{time.time() - since + 2:.0f}s"
    return {tuple(a["metric"].get(label, "") for label in BY)
            for a in query(prometheus, f'max_over_time(ALERTS{{alertstate="firing"}}[{span}])', timeout=10)}


def _exported_pods(shard: str) -> set[str]:
    """The pods whose KV usage one shard exports."""
    page = requests.get(f"http://{shard}/metrics", timeout=10).text
    return set(re.findall(r'^kvwatch_engine_kv_cache_usage_ratio\{[^}]*pod="([^"]+)"', page, re.MULTILINE))


def _pages(webhook: Webhook) -> int:
    return len({(a["fingerprint"], a["startsAt"]) for _, payload in webhook.sent_to("pager")
                for a in payload["alerts"] if a["labels"]["alertname"] == PAGE and a["status"] == "firing"})


def test_two_real_shards_fire_the_sidecars_alerts_over_simulated_replicas():
    sidecar_rules = render_all(config_from_mapping(SCALED))[RULES_FILE]
    central_rules = render_all(config_from_mapping(
        {**SCALED, "mode": "central", "deploy": {"central_selector": '{job="vllm"}'}}))[RULES_FILE]
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-e2e-central-live-"))
    processes = Processes(workdir)
    python = sys.executable
    try:
        with Webhook() as on_sidecars, Webhook() as on_central:
            sims = [f"127.0.0.1:{free_port()}" for _ in SCENARIOS]
            pods = _pods(sims)
            sidecars = [f"127.0.0.1:{free_port()}" for _ in SCENARIOS]
            for i, (scenario, sim, sidecar) in enumerate(zip(SCENARIOS, sims, sidecars)):
                processes.start(f"sim-{i}", [python, "-m", "kvwatch", "sim", "--scenario", scenario, "--port",
                                             sim.split(":")[1], "--speed", str(SPEED), "--duration", "300",
                                             "--seed", str(i)])
                processes.start(f"sidecar-{i}", [python, "-m", "kvwatch", "serve", "--target", f"http://{sim}",
                                                 "--port", sidecar.split(":")[1], "--poll-interval", "1s",
                                                 "--window", "20s"])
            started = time.time()
            store = _stack(processes, "store", sidecar_rules, [
                {"job_name": "vllm", "static_configs": [
                    {"targets": [sim], "labels": {"namespace": "llm", "pod": pod}} for sim, pod in zip(sims, pods)]},
                {"job_name": "kvwatch", "static_configs": [
                    {"targets": [sidecar], "labels": {"namespace": "llm", "pod": pod}}
                    for sidecar, pod in zip(sidecars, pods)]}], on_sidecars)
            shards = [f"127.0.0.1:{free_port()}" for _ in range(2)]
            for k, shard in enumerate(shards):
                processes.start(f"shard-{k}", [python, "-m", "kvwatch", "serve", "--prometheus", store,
                                               "--selector", '{job="vllm"}', "--shard", f"{k}/2",
                                               "--port", shard.split(":")[1], "--poll-interval", "1s",
                                               "--window", "20s"])
            central = _stack(processes, "central", central_rules, [
                {"job_name": "kvwatch-central", "honor_labels": True, "static_configs": [
                    {"targets": shards, "labels": {"namespace": "kvwatch"}}]}], on_central)
            # Each shard exports its own share of the replicas.
            wait_until(lambda: len({r["metric"]["pod"] for r in query(central, "kvwatch_engine_kv_cache_usage_ratio")})
                       == len(SCENARIOS), 60, "the shards exporting every replica")
            per_shard = [_exported_pods(shard) for shard in shards]
            assert all(per_shard) and set.union(*per_shard) == set(pods) and not set.intersection(*per_shard), per_shard
            # The sidecars' page and both queueing replicas' cause, then the same on the central side.
            slow = {pod for scenario, pod in zip(SCENARIOS, pods) if scenario == "queueing"}
            try:
                wait_until(lambda: _pages(on_sidecars) and _pages(on_central)
                           and {a[5] for a in _fired(store, started) if a[0] == "VllmTimeToFirstTokenSlow"} == slow
                           and _fired(central, started) >= _fired(store, started),
                           started + DEADLINE_S - time.time(), "both sides paged with the same alerts", interval=1.0)
            except AssertionError:
                raise AssertionError(f"sidecars fired {sorted(_fired(store, started))}, central "
                                     f"{sorted(_fired(central, started))}; logs: {processes.log('shard-0')}") from None
            threading.Event().wait(5.0)  # a few more evaluations: nothing more may fire on either side
            fired_sidecars, fired_central = _fired(store, started), _fired(central, started)
            print(f"replicas by shard: {[sorted(share) for share in per_shard]}")
            print(f"fired: sidecars {len(fired_sidecars)}, central (two shards) {len(fired_central)}:",
                  sorted({(a[0], a[1] or a[2]) for a in fired_sidecars}))
            print(f"pages: sidecars {_pages(on_sidecars)}, central {_pages(on_central)}; notifications: sidecars "
                  f"{len(on_sidecars.notifications)}, central {len(on_central.notifications)}")
            assert fired_central == fired_sidecars
            assert PAGE in {a[0] for a in fired_sidecars}
            assert {a[1] for a in fired_sidecars if a[0] == "VllmTimeToFirstTokenSlow"} == {"queueing_compute_bound"}
            assert _pages(on_sidecars) == _pages(on_central) == 1
            # The healthy replica fired nothing on either side.
            assert not {a for a in fired_sidecars | fired_central if a[5] == pods[2]}
    finally:
        processes.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
