"""Central mode (`kvwatch serve --prometheus`) over a stand-in query API
(tests/promstub.py) holding simulated replicas' history: incremental
refreshes give the findings of the whole-range history diagnosis, each
refresh reads only the new steps, a store that fails is one sentence and a
failed readiness (never a crash), vanished replicas go, the replica cap
holds, and the HTTP surface serves every replica (the status page of one,
the JSON of all, /metrics with the store's labels that the generated fleet
dashboard groups by)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvwatch.cli import main
from kvwatch.central.refresh import Central
from kvwatch.history.query import PrometheusClient
from kvwatch.history.run import diagnose_history
from kvwatch.central.app import create_central_app
from kvwatch.settings import load_settings
from promstub import StubClient
from sim_support import fleet_openmetrics
from test_history_prometheus import fleet

START = 1_700_002_800.0  # a multiple of the step
DURATION, STEP, WINDOW = 480, 15, 120
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def history_text():
    # Two models of four replicas: one exhausted while three idle, one whose
    # prefix routing is lost.
    return fleet_openmetrics(fleet()[:8], START, DURATION, STEP)


def settings(**extra):
    return load_settings(overrides={"poll_interval": f"{STEP}s", "window": f"{WINDOW}s", **extra}, environ={})


def central_at(text: str, at: float, **options):
    client = StubClient(text)
    now = [at]
    central = Central(client, settings(), clock=lambda: now[0], **options)
    return central, client, now


def current(state) -> set[tuple[str, str]]:
    found = {(f.cause, name) for name, view in state.replicas.items() for f in view.state.findings}
    return found | {(f.cause, f.evidence["replica"]) for f, _since in state.fleet}


def test_refreshes_read_only_new_steps_and_give_the_history_diagnosis(history_text):
    central, client, now = central_at(history_text, START + 240)
    first = central.refresh_once()
    # The first refresh back-fills one window span, on the step grid.
    assert client.ranges and all(r == (START + 240 - WINDOW, START + 240) for r in client.ranges)
    assert first.up and len(first.replicas) == 8 and first.source == "vllm"
    client.ranges.clear()
    while now[0] < START + DURATION:
        now[0] += STEP
        state = central.refresh_once()
        # Each later refresh reads the one new step, nothing before it.
        assert {r for r in client.ranges} == {(now[0], now[0])}
        client.ranges.clear()
    # A refresh before the next step reads nothing.
    queries = client.cost.queries
    now[0] += STEP / 3
    assert central.refresh_once() is state and client.cost.queries == queries

    whole = diagnose_history(StubClient(history_text), START, START + DURATION, STEP, window=WINDOW)
    at_end = {(e.cause, e.replica) for e in whole.timeline.episodes if e.active_at_end}
    assert current(state) == at_end
    assert ("imbalance", "vllm/10.0.1.1:8000") in at_end and ("lost_prefix_affinity", "vllm/10.0.2.4:8000") in at_end
    # Each replica's State is what a sidecar publishes: its window, signals and trend.
    view = state.replicas["vllm/10.0.1.1:8000"]
    assert view.labels == {"job": "vllm", "instance": "10.0.1.1:8000"}
    assert view.state.up and view.state.per_engine and len(view.state.entries) == WINDOW // STEP + 1
    assert all(since <= START + DURATION for since in view.state.findings_since.values())


def test_a_store_that_fails_is_one_sentence_and_the_next_refresh_catches_up(history_text):
    central, client, now = central_at(history_text, START + 240)
    central.refresh_once()
    app = create_central_app(central, settings())
    with TestClient(app) as http:
        assert http.get("/readyz").status_code == 200
        client.down = True
        now[0] += 2 * STEP
        state = central.refresh_once()
        assert not state.up and state.reason == "store"
        assert state.detail == ("kvwatch cannot read the store at http://store.invalid:9090: it did not answer "
                                "within 60s.")
        ready = http.get("/readyz")
        assert ready.status_code == 503 and "cannot read the store" in ready.text
        body = http.get("/api/v1/diagnosis").json()
        assert body["up"] is False and "cannot read the store" in body["detail"]
        # The replicas' last findings are not served as current.
        assert body["replicas"] and all(not r["up"] and r["findings"] == [] for r in body["replicas"])
        assert body["fleet"] == []
        assert "cannot read the store" in http.get("/").text
        down = http.get("/metrics").text
        assert "kvwatch_engine_" not in down
        assert "\nkvwatch_central_store_up 0.0\n" in down
        client.down = False
        client.ranges.clear()
        now[0] += STEP
        state = central.refresh_once()
        assert state.up and http.get("/readyz").status_code == 200
        # From the step after the last good one: the missed steps are read too.
        assert {r for r in client.ranges} == {(START + 240 + STEP, START + 240 + 3 * STEP)}
        assert ("imbalance", "vllm/10.0.1.1:8000") in current(state)


def test_a_store_that_refuses_connections_is_said_in_one_sentence():
    from promstack import free_port

    url = f"http://127.0.0.1:{free_port()}"
    central = Central(PrometheusClient(url, timeout=2), settings(), clock=lambda: START)
    state = central.refresh_once()
    assert not state.up and state.detail == (f"kvwatch cannot read the store at {url}: the connection failed "
                                             "(is it running, and is the URL right?).")
    assert central.ready() == (False, f"last refresh failed: store: {state.detail}")


def test_a_replica_that_vanished_is_down_then_dropped_after_a_window(history_text):
    central, client, now = central_at(history_text, START + 240)
    central.refresh_once()
    client.drop(instance="10.0.2.4:8000")
    now[0] += STEP
    state = central.refresh_once()
    gone = state.replicas["vllm/10.0.2.4:8000"].state
    assert not gone.up and gone.reason == "no_data" and not gone.findings
    assert "lost_prefix_affinity" not in {f.cause for f, _ in state.fleet}
    now[0] += WINDOW
    state = central.refresh_once()
    assert "vllm/10.0.2.4:8000" not in state.replicas and len(state.replicas) == 7


def test_at_most_max_replicas_are_kept(history_text):
    central, client, now = central_at(history_text, START + 240, max_replicas=3)
    state = central.refresh_once()
    assert sorted(state.replicas) == ["vllm/10.0.1.1:8000", "vllm/10.0.1.2:8000", "vllm/10.0.1.3:8000"]
    assert state.dropped_replicas == 5
    now[0] += STEP
    assert len(central.refresh_once().replicas) == 3
    # A kept replica that vanished makes room for the next one once it is forgotten.
    client.drop(instance="10.0.1.1:8000")
    now[0] += WINDOW + STEP
    state = central.refresh_once()
    assert sorted(state.replicas) == ["vllm/10.0.1.2:8000", "vllm/10.0.1.3:8000", "vllm/10.0.1.4:8000"]
    assert state.dropped_replicas == 4
    # Exported, for an alert: replicas left out are not diagnosed.
    with TestClient(create_central_app(central, settings())) as http:
        exposition = http.get("/metrics").text
    assert "\nkvwatch_central_replicas_dropped 4.0\n" in exposition
    assert "\nkvwatch_central_replicas 3.0\n" in exposition and "\nkvwatch_central_store_up 1.0\n" in exposition


def test_the_http_surface_serves_every_replica(history_text):
    central, client, now = central_at(history_text, START + 300)
    central.refresh_once()
    with TestClient(create_central_app(central, settings())) as http:
        body = http.get("/api/v1/diagnosis").json()
        assert body["mode"] == "central" and body["up"] and len(body["replicas"]) == 8
        by_name = {r["replica"]: r for r in body["replicas"]}
        assert by_name["vllm/10.0.1.1:8000"]["labels"] == {"job": "vllm", "instance": "10.0.1.1:8000"}
        assert "concurrency_beyond_capacity" in {f["cause"] for f in by_name["vllm/10.0.1.1:8000"]["findings"]}
        assert {(f["cause"], f["replica"]) for f in body["fleet"]} >= {("imbalance", "vllm/10.0.1.1:8000")}

        index = http.get("/").text
        assert index.count("<tr data-replica=") == 8
        # Worst first: the exhausted replica heads the table.
        assert index.index('data-replica="vllm/10.0.1.1:8000"') < index.index('data-replica="vllm/10.0.1.2:8000"')
        assert 'href="?replica=vllm%2F10.0.1.1%3A8000"' in index

        page = http.get("/", params={"replica": "vllm/10.0.1.1:8000"})
        assert page.status_code == 200
        assert "<title>kvwatch: vllm/10.0.1.1:8000</title>" in page.text
        data = json.loads(re.search(r'id="kvwatch-state">(.*?)</script>', page.text).group(1))
        assert data["diagnosis"]["target"] == "vllm/10.0.1.1:8000" and data["diagnosis"]["findings"]
        assert data["series"]["times"]
        # The page's script asks the API for the replica it was opened for.
        assert "window.location.search" in page.text
        one = http.get("/api/v1/signals", params={"replica": "vllm/10.0.1.1:8000"}).json()
        assert one["up"] and one["engines"] and one["labels"]["instance"] == "10.0.1.1:8000"
        assert http.get("/api/v1/series", params={"replica": "vllm/10.0.1.1:8000"}).json()["times"]
        assert http.get("/api/v1/series").status_code == 400
        assert http.get("/", params={"replica": "nope"}).status_code == 404
        assert http.get("/api/v1/diagnosis", params={"replica": "nope"}).status_code == 404

        exposition = http.get("/metrics").text
    assert 'kvwatch_up{instance="10.0.1.1:8000",job="vllm"} 1.0' in exposition
    assert re.search(r'kvwatch_finding\{cause="concurrency_beyond_capacity",.*instance="10.0.1.1:8000"', exposition)
    # The generated fleet dashboard reads these series, grouped by the
    # instance label and filtered by the group labels: every kvwatch series
    # it names is exported per replica with those labels.
    board = (ROOT / "dashboards" / "kvwatch-fleet.json").read_text()
    assert "by (instance, model_name, engine)" in board
    wanted = set(re.findall(r"\b(kvwatch_[a-z_]+?)(?:_bucket|_sum|_count)?\{", board))
    assert {"kvwatch_engine_kv_cache_usage_ratio", "kvwatch_engine_prefix_cache_hits_total"} <= wanted
    for name in wanted:
        lines = [line for line in exposition.splitlines() if line.startswith(name + "{")
                 or line.startswith(name + "_bucket{") or line.startswith(name + "_sum{")]
        if name == "kvwatch_engine_requests_waiting_by_reason":
            continue  # vLLM's simulated pages carry no per-reason queue
        if name.startswith(("kvwatch_router_", "kvwatch_tenant_")):
            continue  # a router's page is read by a sidecar (--router-target); central mode reads no router yet
        assert lines, name
        assert all('instance="' in line and 'job="vllm"' in line for line in lines), name


def test_serve_refuses_a_bad_store_url_or_selector(capsys):
    assert main(["serve", "--prometheus", "not a url"]) == 2
    assert "--prometheus" in capsys.readouterr().err
    assert main(["serve", "--prometheus", "http://127.0.0.1:9", "--selector", "namespace=llm"]) == 2
    assert "not a label selector" in capsys.readouterr().err
    # Central mode refreshes every 30 s unless told: a 50 s window is too short for it.
    assert main(["serve", "--prometheus", "http://127.0.0.1:9", "--window", "50s"]) == 2
    assert "window (50s) must hold at least two refreshes (30s apart)" in capsys.readouterr().err


@pytest.mark.parametrize("enabled_before", [True, False])
def test_a_refresh_reads_with_the_collector_paused_and_collects_its_cycles_after(history_text, enabled_before):
    """The cyclic collector is off while a refresh reads and steps (young
    collections walking a read's large answers made the cost per replica grow
    with the fleet: 2.2 s of an 8.1 s refresh at 1,000 replicas), and on again
    after it, as it was, with the refresh's cyclic garbage collected (it is
    never left for a collector that does not run). A caller's disabled
    collector stays disabled."""
    import gc
    import weakref

    central, _client, _now = central_at(history_text, START + WINDOW)
    seen = []
    read_and_step = central._read_and_step

    class Node:
        pass

    def recording(start, end):
        seen.append(gc.isenabled())
        cycle = Node()
        cycle.self = cycle
        seen.append(weakref.ref(cycle))
        del cycle
        return read_and_step(start, end)

    central._read_and_step = recording
    was = gc.isenabled()
    try:
        if not enabled_before:
            gc.disable()
        state = central.refresh_once()
        assert gc.isenabled() is enabled_before
    finally:
        if was:
            gc.enable()
    assert state.up and state.replicas
    assert seen[0] is False
    if enabled_before:
        assert seen[1]() is None  # collected by the refresh's own collection
