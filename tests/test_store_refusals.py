"""What horizontally scaled stores answer when they will not answer in full
(Thanos' partial responses, Mimir's, Prometheus' and VictoriaMetrics' query
limits, a tenant's rate limit), from a loopback fake answering in their
shapes: each is one sentence saying what it means and what to do, in
central mode (the page, the JSON, never the store's own text on /readyz) and
in `kvwatch diagnose --prometheus`; a partial answer is never diagnosed as
if it were the whole fleet; and every query asks Thanos for no partial
answer."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fastapi.testclient import TestClient

from kvwatch.cli import main
from kvwatch.central.refresh import Central
from kvwatch.history.query import PrometheusClient, QueryError
from kvwatch.central.app import create_central_app
from kvwatch.settings import load_settings

SECRET = "store-gw-7.internal"  # in the stores' texts: never on the open /readyz

# (name, HTTP status, body): the shapes these stores answer.
THANOS_PARTIAL = ("thanos partial", 200, {
    "status": "success", "data": {"resultType": "matrix", "result": []},
    "warnings": [f"receive series from Addr: {SECRET}:10901: rpc error: code = Unavailable"]})
THANOS_ABORT = ("thanos abort", 422, {
    "status": "error", "errorType": "execution",
    "error": f"fetch series: receive series from Addr: {SECRET}:10901: rpc error: code = Unavailable"})
MIMIR_SERIES = ("mimir series limit", 422, {
    "status": "error", "errorType": "execution",
    "error": f"the query exceeded the maximum number of series (limit: 100000 series) "
             f"(err-mimir-max-series-per-query) at {SECRET}"})
MIMIR_LENGTH = ("mimir query length", 422, {
    "status": "error", "errorType": "bad_data",
    "error": f"the query time range exceeds the limit (query length: 745h, limit: 721h) "
             f"(err-mimir-max-query-length) at {SECRET}"})
PROMETHEUS_SAMPLES = ("prometheus samples", 422, {
    "status": "error", "errorType": "execution",
    "error": f"query processing would load too many samples into memory in query execution ({SECRET})"})
VICTORIA_SERIES = ("victoriametrics unique series", 422, {
    "status": "error", "errorType": "422",
    "error": f"cannot fetch query results from {SECRET}: the number of matching timeseries exceeds 300000; "
             "either narrow down the search or increase -search.maxUniqueTimeseries command-line flag value"})
MIMIR_THROTTLED = ("mimir throttled", 429, {
    "status": "error", "errorType": "unavailable", "error": f"too many outstanding requests ({SECRET})"})
DEADLINE = ("deadline", 503, {
    "status": "error", "errorType": "timeout", "error": f"context deadline exceeded ({SECRET})"})

SENTENCES = {
    "limit": "it refused a query as over one of its limits (series, samples or query length): narrow the "
             "selector, or split the fleet over more shards (--shard).",
    "throttled": "it is throttling kvwatch's queries (HTTP 429, a rate or concurrency limit); the next refresh "
                 "asks again.",
    "partial": "it could read only part of the data (a store behind it failed): kvwatch does not diagnose a "
               "fleet from part of it.",
}
CASES = [(THANOS_PARTIAL, "partial"), (THANOS_ABORT, "partial"), (MIMIR_SERIES, "limit"), (MIMIR_LENGTH, "limit"),
         (PROMETHEUS_SAMPLES, "limit"), (VICTORIA_SERIES, "limit"), (MIMIR_THROTTLED, "throttled")]


class Fake(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.answer = (200, {"status": "success", "data": []})
        self.params: list[dict] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", 0))
        self.server.params.append(dict(urllib.parse.parse_qsl(self.rfile.read(length).decode())))
        status, body = self.server.answer
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake():
    server = Fake()
    yield server
    server.shutdown()
    server.server_close()


def settings():
    return load_settings(overrides={"poll_interval": "15s", "window": "120s"}, environ={})


@pytest.mark.parametrize("case, reason", CASES, ids=[case[0] for case, _ in CASES])
def test_each_refusal_is_one_sentence_in_central_mode_and_never_the_stores_text(fake, case, reason):
    _name, status, body = case
    fake.answer = (status, body)
    client = PrometheusClient(fake.url, timeout=5)
    with pytest.raises(QueryError) as raised:
        client.query_range('{__name__="vllm:num_requests_running"}', 0, 60, 15)
    assert raised.value.reason == reason
    central = Central(client, settings(), clock=lambda: 1_700_000_000.0)
    state = central.refresh_once()
    assert not state.up
    assert state.detail == f"kvwatch cannot read the store at {fake.url}: {SENTENCES[reason]}"
    with TestClient(create_central_app(central, settings())) as http:
        ready = http.get("/readyz")
        assert ready.status_code == 503 and SECRET not in ready.text
        assert SENTENCES[reason] in ready.text
        assert SECRET not in json.dumps(http.get("/api/v1/diagnosis").json())


@pytest.mark.parametrize("case, reason", CASES, ids=[case[0] for case, _ in CASES])
def test_diagnose_says_the_same_sentence_and_exits_unusable(fake, case, reason, capsys):
    _name, status, body = case
    fake.answer = (status, body)
    code = main(["diagnose", "--prometheus", fake.url, "--from", "1700000000", "--to", "1700000600",
                 "--step", "15s", "--json"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == f"kvwatch diagnose: kvwatch cannot read the store at {fake.url}: {SENTENCES[reason]}"


def test_a_slow_store_and_a_plain_error_are_not_taken_for_a_limit(fake):
    for answer, said in ((DEADLINE, "it answered HTTP 503."),
                         (("internal", 500, {"status": "error", "errorType": "internal", "error": "boom"}),
                          "it answered HTTP 500.")):
        fake.answer = answer[1:]
        central = Central(PrometheusClient(fake.url, timeout=5), settings(), clock=lambda: 1_700_000_000.0)
        state = central.refresh_once()
        assert state.detail == f"kvwatch cannot read the store at {fake.url}: {said}"


def test_every_query_asks_for_no_partial_answer_and_deduplicated_series(fake):
    client = PrometheusClient(fake.url, timeout=5)
    client.series("{}", 0, 60)
    fake.answer = (200, {"status": "success", "data": {"resultType": "matrix", "result": []}})
    client.query_range("{}", 0, 60, 15)
    assert len(fake.params) == 2
    for params in fake.params:
        assert params["partial_response"] == "false" and params["dedup"] == "true"
