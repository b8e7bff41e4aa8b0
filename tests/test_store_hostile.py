"""A hostile or failing Prometheus-compatible store, on loopback, against
kvwatch's query client (`kvwatch diagnose --prometheus`, central mode):
every answer is read with a byte cap (decompressed) and a deadline enforced
while it is read, central mode recovers when the store does, and what the
store says is never repeated on the open /readyz."""

from __future__ import annotations

import gzip
import json
import re
import socket
import threading
import time
import urllib.parse
from socketserver import StreamRequestHandler, ThreadingTCPServer

import pytest
from fastapi.testclient import TestClient

from kvwatch.central.refresh import Central
from kvwatch.history.matrix import pairs_of
from kvwatch.history.query import PrometheusClient, QueryError
from kvwatch.central.app import create_central_app
from promstub import StubClient
from test_central import START, STEP, history_text, settings  # noqa: F401 (fixture)


class Store(ThreadingTCPServer):
    """A raw HTTP store: `mode` picks the answer; `stub` answers queries in
    mode "good"; `sent` counts body bytes written, `cut` is set when kvwatch
    closed the connection before the answer ended."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, stub=None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.mode = "good"
        self.stub = stub
        self.sent = 0
        self.cut = threading.Event()
        self.open: dict = {}  # connection -> its handler's thread, until it ends
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        # A client's pooled keep-alive connection held its handler in readline
        # past the test: shut every open one and wait for its thread.
        self.shutdown()
        for connection, thread in list(self.open.items()):
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed meanwhile
            thread.join(5)
        self.server_close()


class Handler(StreamRequestHandler):
    def setup(self) -> None:
        super().setup()
        self.server.open[self.request] = threading.current_thread()

    def finish(self) -> None:
        self.server.open.pop(self.request, None)
        try:
            super().finish()
        except OSError:
            pass  # the connection was shut by stop()

    def handle(self) -> None:
        while True:
            line = self.rfile.readline()
            if not line:
                return
            path = line.split()[1].decode()
            length = 0
            while (header := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
                if header.lower().startswith(b"content-length:"):
                    length = int(header.split(b":")[1])
            params = {k: v[0] for k, v in urllib.parse.parse_qs(self.rfile.read(length).decode()).items()}
            if not self.answer(path, params):
                return

    def send(self, status: int, body: bytes, headers: dict | None = None) -> None:
        head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.wfile.write(head.encode() + b"\r\n" + body)

    def answer(self, path: str, params: dict) -> bool:
        store = self.server
        if store.mode == "good":
            data = store.stub._get(path, params)
            self.send(200, json.dumps({"status": "success", "data": data}).encode())
            return True
        if store.mode == "trickle":
            # Headers at once, then the answer a byte every 50 ms (10 s whole).
            body = json.dumps({"status": "success", "data": []}).encode() + b" " * 200
            self.wfile.write(f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(body)}\r\n\r\n".encode())
            return self._pieces((body[i:i + 1] for i in range(len(body))), pause=0.05)
        if store.mode == "huge":
            # 64 MiB of one series list (never complete JSON before its end).
            total = 64 * 1024 * 1024
            head = b'{"status":"success","data":['
            tail = b"{}]}"
            filler = b"{}," * (1024 * 1024 // 3)
            count = (total - len(head) - len(tail)) // len(filler)
            body_len = len(head) + count * len(filler) + len(tail)
            self.wfile.write(f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             f"content-length: {body_len}\r\n\r\n".encode())
            return self._pieces([head] + [filler] * count + [tail])
        if store.mode == "gzip":
            body = gzip.compress(b'{"status":"success","data":[' + b" " * (64 * 1024 * 1024) + b"]}", 9)
            self.send(200, body, {"content-encoding": "gzip"})
            return True
        if store.mode == "error":
            said = "\x1b[2J\x1b[31mpwned\x07 " + "x" * 100_000
            self.send(500, json.dumps({"status": "error", "errorType": "internal", "error": said}).encode())
            return True
        if store.mode == "wrong":
            self.send(200, b'{"status":"success","data":{"result":[1,2,3]}}')
            return True
        return False

    def _pieces(self, pieces, pause: float = 0.0) -> bool:
        try:
            for piece in pieces:
                self.wfile.write(piece)
                self.wfile.flush()
                self.server.sent += len(piece)
                if pause:
                    time.sleep(pause)
        except (BrokenPipeError, ConnectionResetError):
            self.server.cut.set()
            return False
        return True


@pytest.fixture
def store():
    server = Store()
    yield server
    server.stop()


def test_a_trickling_answer_is_cut_off_at_the_query_timeout(store):
    """Headers at once, then a byte every 50 ms: the query fails as `timeout`
    at its 0.5 s deadline and kvwatch closes the connection long before the
    answer's 10 s are out (a trickling store outlived --query-timeout 5s
    past 90 s)."""
    store.mode = "trickle"
    client = PrometheusClient(store.url, timeout=0.5)
    with pytest.raises(QueryError, match=r"no answer within 0.5s") as raised:
        client.series("{}", 0, 1)
    assert raised.value.reason == "timeout"
    assert store.cut.wait(8), "kvwatch kept reading the trickle"
    assert store.sent < 200


@pytest.mark.parametrize("mode", ["huge", "gzip"])
def test_an_answer_over_the_byte_cap_is_refused_while_it_is_read(store, mode):
    """A 64 MiB answer, plain or as a 64 KB gzip bomb, against a 1 MiB cap:
    refused as too large once the cap is passed (counted decompressed), in
    one sentence (answers were read whole: 4.8 GB)."""
    store.mode = mode
    client = PrometheusClient(store.url, timeout=30, max_bytes=1024 * 1024)
    with pytest.raises(QueryError, match=r"larger than the 1,048,576 bytes kvwatch reads of one answer") as raised:
        client.series("{}", 0, 1)
    assert raised.value.reason == "too_large"
    if mode == "huge":
        assert store.cut.wait(10)
        assert store.sent < 32 * 1024 * 1024  # stopped near the cap (socket buffers hold the rest)


def test_the_stores_error_text_is_capped_escaped_and_never_on_readyz(store):
    """A 100 KB error with terminal escapes: the query's message keeps 300
    characters with the escapes written out; central mode's open /readyz and
    its sentence say the status only (they quoted the store's text, and the
    log got 100 KB every refresh)."""
    store.mode = "error"
    client = PrometheusClient(store.url, timeout=5)
    with pytest.raises(QueryError) as raised:
        client.series("{}", 0, 1)
    message = str(raised.value)
    assert "\x1b" not in message and "\x07" not in message and "\\x1b[2J" in message
    assert len(message) < 400
    central = Central(client, settings(), clock=lambda: START)
    state = central.refresh_once()
    assert not state.up and state.detail == f"kvwatch cannot read the store at {store.url}: it answered HTTP 500."
    with TestClient(create_central_app(central, settings())) as http:
        ready = http.get("/readyz")
        assert ready.status_code == 503 and "pwned" not in ready.text and "xxx" not in ready.text


def test_an_answer_of_the_wrong_shape_is_one_sentence(store):
    store.mode = "wrong"
    client = PrometheusClient(store.url, timeout=5)
    with pytest.raises(QueryError, match="a result that is not a list of series with labels"):
        client.query_range("up", 0, 1, 1)


def test_central_mode_recovers_when_a_trickling_store_does(history_text, store):  # noqa: F811
    """A refresh against a trickling store fails at the query timeout, and
    the next one, the store answering again, is up with every replica
    (central mode stopped refreshing for good: still stuck 74 s after the
    store recovered)."""
    store.stub = StubClient(history_text)
    now = [START + 240]
    central = Central(PrometheusClient(store.url, timeout=0.5), settings(), clock=lambda: now[0])
    store.mode = "trickle"
    state = central.refresh_once()
    assert not state.up and state.detail.endswith("it did not answer within 0.5s.")
    store.mode = "good"
    # A deadline a loaded machine meets: the stand-in store builds its
    # answers in Python (this test is about the recovery, not the speed).
    central.client.timeout = 60
    now[0] += STEP
    state = central.refresh_once()
    assert state.up and len(state.replicas) == 8


def test_terminal_escapes_in_the_stores_labels_never_reach_the_terminal(history_text, store, capsys):  # noqa: F811
    """A replica's instance label carrying escape sequences (clear the
    screen, retitle the terminal, bell): the text report writes them as
    escapes (they reached the terminal raw)."""
    from kvwatch.cli import main

    hostile = "10.0.1.1:8000\x1b[2J\x1b]0;pwned\x07\u202e"
    store.stub = StubClient(history_text.replace("10.0.1.1:8000", hostile))
    code = main(["diagnose", "--prometheus", store.url, "--from", str(START), "--to", str(START + 240),
                 "--step", "15s", "--window", "2m"])
    out = capsys.readouterr().out
    assert code in (0, 1) and "10.0.1.1:8000" in out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "10.0.1.1:8000\\x1b[2J\\x1b]0;pwned\\x07\\u202e" in out


def test_a_read_of_many_chunks_holds_a_few_answers_at_a_time():
    """A range read split into 24 time chunks, each answered with 2,000
    series of 2 KB labels (new objects every answer, the same series): the
    read joins each answer in as it comes and asks at most `concurrency`
    ahead, so what it holds at its peak is a few answers, not all of them
    (read_ranges kept every chunk's answer until the last: behind a store
    answering 22 chunks at central mode's 32 MiB cap, a refresh peaked at
    9.8 GiB against 1024Mi). The series come back whole, in time order."""
    import tracemalloc

    chunks, series = 24, 2_000

    class Chunked(PrometheusClient):
        def plan(self, start, end, step, expected):
            return [(start + n * step, start + n * step) for n in range(chunks)]

        def query_range(self, query, start, end, step):
            return [{"metric": {"pod": f"p{n:05d}", "note": "x" * 2_000 + str(n)}, "values": [[start, "1"]]}
                    for n in range(series)]

    client = Chunked("http://127.0.0.1:9", concurrency=4)
    tracemalloc.start()
    try:
        answer = tracemalloc.get_traced_memory()[0]
        one = client.query_range("q", 0.0, 0.0, 1.0)
        answer = tracemalloc.get_traced_memory()[0] - answer
        del one
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        (result,) = client.read_ranges([("q", series)], 0.0, float(chunks - 1), 1.0)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert len(result) == series and all(len(pairs_of(s["values"])) == chunks for s in result)
    assert [float(t) for t, _ in pairs_of(result[0]["values"])] == [float(n) for n in range(chunks)]
    # The joined series (one answer's labels) and at most concurrency + 1
    # answers more, with room: far below the 24 answers held before.
    assert peak < 8 * answer, (peak >> 20, answer >> 20)


def test_a_series_list_of_empty_label_sets_is_held_as_references_not_dicts():
    """A store's series list of empty label sets (`{}`, 3 bytes each) decoded
    whole is a dict each, about 24 bytes held per byte read: 942 MiB for a
    list at central mode's 32 MiB cap. The list is cut to the labels its
    readers read, equal label sets shared, so it holds a reference each."""
    import tracemalloc

    empties = 300_000
    real = '{"__name__":"vllm:num_requests_running","instance":"10.0.0.1:8000","job":"vllm","model_name":"m"}'
    listing = ('{"status":"success","data":[' + "{}," * empties + real + "]}").encode()

    class Answering(PrometheusClient):
        def __init__(self):
            super().__init__("http://store.invalid:9090")

        def _post(self, path, params, started):
            return 200, "application/json", listing

    client = Answering()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        found = client.series('{__name__=~"vllm:.+"}', START, START + 60, labels=("__name__", "instance"))
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert len(found) == empties + 1 and client.cost.bytes == len(listing)
    assert found[-1] == {"__name__": "vllm:num_requests_running", "instance": "10.0.0.1:8000"}
    assert found[0] == {} and all(labels is found[0] for labels in found[:-1])
    # The text, its string and the list's references: about 5 bytes per
    # byte; each label set a dict of its own was about 24.
    assert peak < 8 * len(listing), (peak >> 20, len(listing) >> 20)


@pytest.mark.parametrize("listed", ["all", "two"])
def test_a_refresh_past_max_replicas_never_holds_the_replicas_it_leaves_out(listed):
    """A store of 3,000 replicas, each series' answer in 8 time chunks, read
    by central mode keeping 3: the series of the replicas it leaves out are
    dropped as each answer is decoded (known from the series list), and
    answers are decoded one at a time, so the refresh's peak is about one
    answer's text and the series list, not several decoded answers and
    every replica's pages (370,000 series an answer at central mode's cap
    held 3.0 GiB against 1024Mi). Who is kept and what is counted as
    dropped are as before.

    `two`: the store lists two replicas (within max_replicas, so the list
    chooses none) and answers 3,000: the first three the answers bring are
    kept, the rest left out as they are decoded (a list of two and answers
    of 680,000 series held 2.1 GiB)."""
    import tracemalloc

    replicas, chunks, points = 3_000, 8, 10
    end = START + (chunks * points - 1) * STEP

    def labels(n: int) -> str:
        return (f'"__name__":"vllm:num_requests_running","engine":"0","instance":"10.9.{n // 250}.{n % 250}:8000",'
                '"job":"vllm","model_name":"m"')

    listing = ('{"status":"success","data":[' + ",".join("{" + labels(n) + "}"
                                                        for n in range(replicas if listed == "all" else 2))
               + "]}").encode()

    class Answering(PrometheusClient):
        """The real client's decoding, over answers made here (no socket)."""

        def __init__(self):
            super().__init__("http://store.invalid:9090", concurrency=4)

        def plan(self, start, end, step, series):
            return [(start + k * points * step, start + ((k + 1) * points - 1) * step) for k in range(chunks)]

        def _post(self, path, params, started):
            if path == "/api/v1/series":  # no process start times: one family
                return 200, "application/json", listing if "vllm" in params["match[]"] else b'{"status":"success","data":[]}'
            if "llm_d_epp_" in params["query"]:  # the router families' query: no router in this store
                return 200, "application/json", b'{"status":"success","data":{"resultType":"matrix","result":[]}}'
            return 200, "application/json", answers[float(params["start"])]

    # Made before the read, so that what is traced is what kvwatch holds.
    answers = {}
    for k in range(chunks):
        first = START + k * points * STEP
        values = "[" + ",".join(f'[{first + i * STEP:.0f},"{i % 7}"]' for i in range(points)) + "]"
        answers[first] = ('{"status":"success","data":{"resultType":"matrix","result":['
                          + ",".join('{"metric":{' + labels(n) + '},"values":' + values + "}" for n in range(replicas))
                          + "]}}").encode()
    largest = max(map(len, answers.values()))
    client = Answering()
    now = [end]
    central = Central(client, settings(), clock=lambda: now[0], max_replicas=3)
    central.window = float(chunks * points - 1) * STEP
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        state = central.refresh_once()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert state.up and sorted(state.replicas) == (
        ["vllm/10.9.0.0:8000", "vllm/10.9.0.100:8000", "vllm/10.9.0.101:8000"] if listed == "all"
        else ["vllm/10.9.0.0:8000", "vllm/10.9.0.1:8000", "vllm/10.9.0.2:8000"])
    assert state.dropped_replicas == replicas - 3
    assert client.cost.series == chunks * replicas  # what was read is counted, kept or not
    # One answer's text and the series list decoded: 1.7 times the largest
    # answer; 21 times it when every series was decoded and every replica
    # read into pages before max_replicas applied, several answers at once.
    assert peak < 3 * largest, (peak, largest)


def test_a_stores_long_label_values_are_exported_as_a_start_and_a_digest(history_text):  # noqa: F811
    """A replica whose instance label and model name are 2 KB each in the
    store: its exported labels, its name in the API and its series are
    bounded by the one rule for label values (kvwatch.labels); the store is
    still asked by the values it holds, so the replica keeps its data."""
    from kvwatch.labels import LABEL_VALUE_MAX_BYTES, bounded_label
    from test_central import central_at

    instance, model = "h" * 2_000 + ":8000", "m" * 2_000
    text = history_text.replace("10.0.1.1:8000", instance).replace('"imbalanced"', f'"{model}"')
    central, _client, _now = central_at(text, START + 300)
    state = central.refresh_once()
    name = bounded_label(f"vllm/{instance}")
    assert len(state.replicas) == 8 and name in state.replicas
    assert state.replicas[name].labels == {"job": "vllm", "instance": bounded_label(instance)}
    with TestClient(create_central_app(central, settings())) as http:
        exposition = http.get("/metrics").text
        body = http.get("/api/v1/diagnosis").text
    assert model not in body and instance not in body
    long_values = [v for v in re.findall(r'="((?:[^"\\]|\\.)*)"', exposition) if len(v.encode()) > LABEL_VALUE_MAX_BYTES]
    assert long_values == []
    assert f'instance="{bounded_label(instance)}"' in exposition and f'model_name="{bounded_label(model)}"' in exposition
