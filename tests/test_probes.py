"""The probes never wait behind a render, and a render is bounded in bytes.

/healthz and /readyz are answered on uvicorn's event loop; /metrics, the
JSON routes and the page render (and gzip) in worker threads. Each test
holds a render on a gate and asks the probes while it is provably still
held: the ordering is the assertion, no clock is read.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import requests
from fastapi.testclient import TestClient
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvwatch.central import app as central_app
from kvwatch.central.refresh import Central
from kvwatch.commands.serve import server_options
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from kvwatch.sidecar import app as sidecar_app
from pageserver import serving
from promstub import StubClient

GATE_SECONDS = 30  # the gate opens by itself after this, so a failing test still ends


class Gate:
    """A render held until released; `entered` says the render is inside."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def hold(self) -> None:
        self.entered.set()
        self.release.wait(GATE_SECONDS)


class GatedCollector(Collector):
    def __init__(self, gate: Gate):
        self.gate = gate

    def collect(self):
        self.gate.hold()
        yield GaugeMetricFamily("kvwatch_gate", "held until the test releases it", value=1.0)


def sidecar_settings():
    return load_settings(overrides={"target": "http://127.0.0.1:9/metrics", "port": 0}, environ={})


def gate_sidecar_route(monkeypatch, path: str, gate: Gate) -> None:
    if path == "/metrics":
        make_registry = sidecar_app.make_registry

        def gated_registry(monitor):
            registry = make_registry(monitor)
            registry.register(GatedCollector(gate))
            return registry

        monkeypatch.setattr(sidecar_app, "make_registry", gated_registry)
        return
    name = {"/": "render_status_page", "/api/v1/diagnosis": "diagnosis_json"}[path]
    original = getattr(sidecar_app, name)

    def gated(*args, **kwargs):
        gate.hold()
        return original(*args, **kwargs)

    monkeypatch.setattr(sidecar_app, name, gated)


def assert_probes_answer_while_held(port: int, path: str, gate: Gate, accept_encoding: str) -> None:
    base = f"http://127.0.0.1:{port}"
    answers = {}
    render = threading.Thread(target=lambda: answers.setdefault(
        path, requests.get(base + path, headers={"Accept-Encoding": accept_encoding}, timeout=GATE_SECONDS + 10)))
    render.start()
    try:
        assert gate.entered.wait(10), f"{path}'s render never started"
        for probe in ("/healthz", "/readyz"):
            # A probe held behind the render would wait for the gate (30 s): the
            # client's 3 s is the kubelet's liveness timeout in the chart.
            status = requests.get(base + probe, timeout=3).status_code
            assert status == (200 if probe == "/healthz" else 503)
            assert render.is_alive() and not gate.release.is_set(), "the render was still held when the probe answered"
    finally:
        gate.release.set()
        render.join(GATE_SECONDS + 15)
    assert answers[path].status_code == 200


@pytest.mark.parametrize("accept_encoding", ["identity", "gzip"])
@pytest.mark.parametrize("path", ["/metrics", "/api/v1/diagnosis", "/"])
def test_the_probes_answer_while_a_sidecar_render_is_held(monkeypatch, path, accept_encoding):
    """The attack: the exposition was built on the event loop, so a 608 MB
    render held /healthz past the liveness probe's timeout."""
    gate = Gate()
    gate_sidecar_route(monkeypatch, path, gate)
    settings = sidecar_settings()
    app = sidecar_app.create_app(Monitor(settings), settings)
    with serving(app, **server_options(settings)) as kvwatch:
        assert_probes_answer_while_held(kvwatch.port, path, gate, accept_encoding)


def test_the_probes_answer_while_a_central_render_is_held(monkeypatch):
    gate = Gate()
    monkeypatch.setattr(central_app.CentralCollector, "collect", lambda self: (gate.hold(), iter(()))[1])
    settings = sidecar_settings()
    central = Central(StubClient(""), settings)
    with serving(central_app.create_central_app(central, settings), **server_options(settings)) as kvwatch:
        assert_probes_answer_while_held(kvwatch.port, "/metrics", gate, "gzip")


class Counted(Collector):
    """Families of 1,000 series each, counting how many were collected."""

    def __init__(self):
        self.collected = 0

    def collect(self):
        for n in range(100):
            self.collected += 1
            family = GaugeMetricFamily(f"kvwatch_big_{n}", "a big family", labels=["label"])
            for i in range(1000):
                family.add_metric([f"value-{i:04d}-" + "x" * 40], float(i))
            yield family


def test_a_render_past_the_bound_is_refused_in_one_sentence_and_counted(monkeypatch):
    """A render stops at RENDER_MAX_BYTES (here 200 KB) without collecting the
    rest: /metrics serves the sentence and the counter, the JSON routes and
    the page answer 503 with the sentence. Before, each was built whole."""
    from kvwatch.sidecar import renders

    monkeypatch.setattr(renders, "RENDER_MAX_BYTES", 200_000)
    counted = Counted()
    make_registry = sidecar_app.make_registry

    def big_registry(monitor):
        registry = make_registry(monitor)
        registry.register(counted)
        return registry

    monkeypatch.setattr(sidecar_app, "make_registry", big_registry)
    big = {"engines": ["y" * 1000] * 1000}
    for name in ("signals_json", "diagnosis_json", "series_json"):
        monkeypatch.setattr(sidecar_app, name, lambda *args, **kwargs: big)
    monkeypatch.setattr(sidecar_app, "render_status_page",
                        lambda *args, **kwargs: "<!doctype html>" + renders.bounded_json(big, "the status page's state"))
    settings = sidecar_settings()
    monitor = Monitor(settings)
    client = TestClient(sidecar_app.create_app(monitor, settings))
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and len(metrics.content) < 10_000
    assert counted.collected < 10, "the render went on past its bound"
    assert "passed the render bound of 0.190735 MiB and was not built" in metrics.text
    assert 'kvwatch_renders_refused_total{route="/metrics"} 1' in metrics.text
    for path in ("/api/v1/signals", "/api/v1/diagnosis", "/api/v1/series", "/"):
        answer = client.get(path)
        assert answer.status_code == 503 and "passed the render bound" in answer.text, path
        assert len(answer.content) < 1000
    # Served once per State: a second scrape is the same refusal, not another render.
    assert client.get("/metrics").text == metrics.text
    monitor.poll_once()  # a new State (the poll fails: nothing listens), rendered anew
    again = client.get("/metrics").text
    assert 'kvwatch_renders_refused_total{route="/metrics"} 2' in again
    for path in ("/api/v1/signals", "/api/v1/diagnosis", "/api/v1/series", "/"):
        assert f'kvwatch_renders_refused_total{{route="{path}"}} 1' in again


def test_json_and_pages_within_the_bound_are_unchanged_and_gzipped_off_the_loop(monkeypatch):
    monkeypatch.setattr(sidecar_app, "signals_json", lambda *args: {"engines": [{"model": "m\u00e9", "n": n}
                                                                               for n in range(500)]})
    settings = sidecar_settings()
    client = TestClient(sidecar_app.create_app(Monitor(settings), settings))
    plain = client.get("/api/v1/signals", headers={"Accept-Encoding": "identity"})
    packed = client.get("/api/v1/signals", headers={"Accept-Encoding": "gzip"})
    assert plain.status_code == packed.status_code == 200
    assert plain.json() == packed.json()
    assert packed.headers["content-encoding"] == "gzip" and "content-encoding" not in plain.headers
    page = client.get("/", headers={"Accept-Encoding": "gzip"})
    assert page.status_code == 200 and page.headers["content-encoding"] == "gzip" and "kvwatch-state" in page.text


class CountingExposition:
    """An exposition whose bytes are not made until one serve() has run;
    counts the serve() calls (each one a worker thread's hop and a wait on
    the render's lock)."""

    def __init__(self):
        self.made: bytes | None = None
        self.serves = 0

    def cached(self, gzipped: bool) -> bytes | None:
        return self.made

    def serve(self, gzipped: bool) -> bytes:
        self.serves += 1
        self.made = b"kvwatch_up 1\n"
        return self.made


def test_concurrent_scrapers_of_an_unrendered_state_take_one_worker_thread():
    exposition = CountingExposition()
    hot = sidecar_app.HotPaths(app=None, monitor=None, exposition=exposition, token=None)
    scope = {"type": "http", "path": "/metrics", "method": "GET", "headers": [], "query_string": b""}

    async def scrape() -> bytes:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        await hot(scope, None, send)
        return b"".join(message.get("body", b"") for message in sent)

    async def burst() -> list[bytes]:
        return await asyncio.gather(*(scrape() for _ in range(50)))

    bodies = asyncio.run(burst())
    # Each scraper hopped to a thread to queue on the render's lock: 50.
    assert exposition.serves == 1
    assert bodies == [b"kvwatch_up 1\n"] * 50
