"""Central mode reads a router from the store: the simulated router in front
of 4 simulated engines, three times (one per policy, each its own selector),
the engines' and the router's pages scraped by a real Prometheus (Debian
`prometheus`, on a loopback port the test chose) as any target, and
`kvwatch serve --prometheus`'s refresh reading them back. Each policy gives
its cause and no other, as the sidecar's poll loop does (tests/test_routing.py):
prefix-aware with a fresh index is healthy, round robin loses the affinity,
a stale index is a routing miss with the predicted and delivered tokens as
its evidence."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kvwatch.central.refresh import Central
from kvwatch.history.query import PrometheusClient
from kvwatch.settings import load_settings
from kvwatch.sim.server import start_background
from promstack import _prometheus_in, query, wait_until
from test_e2e_alerting import PROMETHEUS

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not PROMETHEUS, reason="prometheus not installed")]

POLICIES = ("prefix", "round_robin", "prefix_stale")
# The simulation runs SPEED times the wall clock: its 60 s of warm-up and
# 120 s window (tests/test_routing.py's) take 12 s and 24 s here.
SPEED = 5.0
WARM_S, WINDOW_S = 12.0, 24.0


def _scrape(job: str, url: str, policy: str) -> dict:
    parts = urlsplit(url)
    return {"job_name": job, "metrics_path": parts.path, "scrape_interval": "1s",
            "static_configs": [{"targets": [parts.netloc], "labels": {"policy": policy}}]}


@contextlib.contextmanager
def _stack():
    sims = {policy: start_background("routing", speed=SPEED, seed=1, router=policy) for policy in POLICIES}
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-central-router-"))
    try:
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "900ms"}, "scrape_configs": [
            scrape for policy, sim in sims.items()
            for scrape in (_scrape(f"vllm-{policy}", sim.metrics_url, policy),
                           _scrape(f"router-{policy}", sim.router_metrics_url, policy))]}
        with _prometheus_in(workdir, config, "1h") as prom:
            yield prom, sims
    finally:
        for sim in sims.values():
            sim.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_for_the_window(prom, sims: dict) -> None:
    """Waits, each wait with a deadline, for what the refresh needs rather
    than for the times it takes an unloaded machine: every simulation past
    its warm-up on its own clock (a loaded CPU makes it lag the wall clock),
    then the store holding samples of every engine's and router's page from
    then to a window later (a scrape missed under load only delays it)."""
    def warm() -> bool:
        behind = {policy: round(sim.sim.now, 1) for policy, sim in sims.items() if sim.sim.now < WARM_S * SPEED}
        if behind:
            raise AssertionError(f"simulated seconds of those behind: {behind}")  # wait_until shows the last one
        return True

    wait_until(warm, 4 * WARM_S, f"every simulation past its {WARM_S * SPEED:g} s of warm-up")
    since = time.time() + WINDOW_S
    jobs = {f"{kind}-{policy}" for policy in POLICIES for kind in ("vllm", "router")}

    def stored() -> bool:
        latest = {r["metric"]["job"]: float(r["value"][1]) for r in query(prom.url, "timestamp(up == 1)")}
        late = {job: latest.get(job) for job in jobs if latest.get(job, 0.0) < since}
        if late:
            raise AssertionError(f"the latest samples of those behind {since:.0f}: {late}")
        return True

    wait_until(stored, 4 * WINDOW_S, "the store to hold every page's samples a window past the warm-up",
               interval=1)


def test_central_mode_names_each_router_policys_cause_and_no_other():
    settings = load_settings(overrides={"poll_interval": "1s", "window": f"{WINDOW_S:g}s"}, environ={})
    with _stack() as (prom, sims):
        client = PrometheusClient(prom.url, timeout=10)
        _wait_for_the_window(prom, sims)
        found = {}
        for policy in POLICIES:
            central = Central(client, settings, f'{{policy="{policy}"}}', step=1.0)
            state = central.refresh_once()
            assert state.up, state.detail
            assert len(state.replicas) == 1 and len(next(iter(state.replicas.values())).state.per_engine) == 4
            found[policy] = [f for f, _since in state.fleet]
            print(policy, [(f.cause, f.summary) for f in found[policy]], f"simulated {sims[policy].sim.now:.0f} s")
    assert found["prefix"] == []
    # The router's finding (its window decides prefix affinity; the engines' peer comparison gives way).
    [affinity] = found["round_robin"]
    assert (affinity.symptom, affinity.cause, affinity.evidence["router"]) == ("fleet", "lost_prefix_affinity", "llm-d")
    assert affinity.evidence["predicted_tokens"] < 0.6 * affinity.evidence["available_tokens"]
    [miss] = found["prefix_stale"]
    assert (miss.symptom, miss.cause) == ("routing", "routing_miss")
    evidence = miss.evidence
    assert evidence["router"] == "llm-d" and evidence["delivered_tokens"] < 0.8 * evidence["predicted_tokens"]
    assert f"{evidence['predicted_tokens']:.0f}" in miss.summary and f"{evidence['delivered_tokens']:.0f}" in miss.summary
