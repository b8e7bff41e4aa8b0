"""Central mode against a real Prometheus: simulated replicas' pages
backfilled into its TSDB (one exhausted while three idle; one restarted
while three warm), read by `kvwatch serve --prometheus`'s refresh loop one
step at a time, name the causes `kvwatch diagnose --prometheus` names over
the same range, and the status page renders for a selected replica."""

from __future__ import annotations

import json
import re
import time

import pytest
from fastapi.testclient import TestClient

from kvwatch.cli import main
from kvwatch.central.refresh import Central
from kvwatch.history.query import PrometheusClient
from kvwatch.central.app import create_central_app
from kvwatch.settings import load_settings
from promstack import backfilled_prometheus
from sim_support import fleet_openmetrics
from test_history_prometheus import fleet

DURATION, STEP, WINDOW = 480, 15, 120


@pytest.fixture(scope="module")
def store():
    start = float((int(time.time()) // 3600 - 3) * 3600)
    replicas = [r for r in fleet() if r.model in ("imbalanced", "restart")]
    with backfilled_prometheus(fleet_openmetrics(replicas, start, DURATION, STEP)) as prom:
        yield prom, start


def test_central_mode_names_the_causes_the_history_diagnosis_names(store, capsys):
    prom, start = store
    main(["diagnose", "--prometheus", prom.url, "--from", str(start), "--to", str(start + DURATION),
          "--step", f"{STEP}s", "--window", f"{WINDOW}s", "--selector", '{job="vllm"}', "--json"])
    history = json.loads(capsys.readouterr().out)
    expected = {(f["cause"], f["replica"]) for f in history["findings"]}
    assert ("imbalance", "vllm/10.0.1.1:8000") in expected and ("cold_replica", "vllm/10.0.3.4:8000") in expected

    settings = load_settings(overrides={"poll_interval": f"{STEP}s", "window": f"{WINDOW}s"}, environ={})
    now = [start]
    central = Central(PrometheusClient(prom.url, timeout=10), settings, '{job="vllm"}', clock=lambda: now[0])
    seen: set[tuple[str, str]] = set()
    with TestClient(create_central_app(central, settings)) as http:
        while now[0] <= start + DURATION:
            central.refresh_once()
            body = http.get("/api/v1/diagnosis").json()
            assert body["up"], body["detail"]
            seen |= {(f["cause"], r["replica"]) for r in body["replicas"] for f in r["findings"]}
            seen |= {(f["cause"], f["replica"]) for f in body["fleet"]}
            if now[0] == start + 330:  # inside the cold replica's window, the overload still on
                page = http.get("/", params={"replica": "vllm/10.0.3.4:8000"})
                index = http.get("/").text
            now[0] += STEP
        assert http.get("/readyz").status_code == 200
    assert seen == expected
    assert body["source"] == "vllm" and len(body["replicas"]) == 8
    assert body["cost"]["queries"] > 0

    assert page.status_code == 200 and "<title>kvwatch: vllm/10.0.3.4:8000</title>" in page.text
    state = json.loads(re.search(r'id="kvwatch-state">(.*?)</script>', page.text).group(1))
    assert state["signals"]["up"] and state["signals"]["engines"][0]["model_name"] == "restart"
    assert any(e["kind"] == "restart" for e in state["diagnosis"]["events"])
    assert "cold_replica" in index and index.count("<tr data-replica=") == 8
