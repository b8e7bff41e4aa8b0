"""Faults of the engine, each played on loopback against one kvwatch.

Every case runs the same three polls against a fixed port: a good page (the
idle capture), the fault, then a good page again (the prefix-load capture).
After the fault kvwatch is still serving, says `kvwatch_up 0`, has counted
exactly that reason in `kvwatch_poll_errors_total`, and shows no engine or
windowed series (values from before the fault would look current). After the
next good poll it is up again, and that poll is not lost: the window spans
idle -> prefix-load, so the rates are the counters' increase over the whole
span, as if the fault had never happened.
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
import zlib
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.sidecar.app import create_app
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from pageserver import Answer, PageServer

TIMEOUT = 0.5  # the fetch deadline: every timeout case waits about this long
CAP = 256 * 1024  # max_body_bytes: above a real page (about 55 KB), below the bombs
ENGINE = {"model_name": "tiny-llama", "engine": "0"}


# --- the engine's side ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def page_server_on(port: int, answers: list[Answer]) -> PageServer:
    """A PageServer on a fixed port, so that kvwatch's one target can be
    served by a good engine, a faulty one, and a good one again."""
    return PageServer(answers, port=port)


class RawServer:
    """Accepts on a fixed port and hands each connection to `talk`, for faults
    an HTTP server library will not produce (slow headers, early close,
    chunked bodies cut off, silence)."""

    def __init__(self, port: int, talk):
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(8)
        self.talk = talk
        self.stopped = threading.Event()
        self.connections: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(10)
            conn.recv(65536)  # the request
            self.talk(conn, self.stopped)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stopped.set()
        # shutdown() wakes the thread blocked in accept(); close() alone would
        # leave the port bound until it returned.
        for sock in [self.listener] + self.connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self.threads:
            thread.join(5)
        self.listener.close()


def trickle_headers(conn, stopped):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Slow: ")
    while not stopped.wait(0.05):  # a byte every 50 ms, never the blank line
        conn.sendall(b"x")


def never_answer(conn, stopped):
    stopped.wait(10)


def close_before_status(conn, stopped):
    pass  # the request was read; closing now is the whole fault


def close_delimited_cut_mid_line(body: bytes):
    def talk(conn, stopped):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
        conn.sendall(body[: body.index(b"\n", len(body) // 2) + 20])  # 20 bytes into a line
    return talk


def chunked_without_last_chunk(body: bytes):
    def talk(conn, stopped):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
        half = body[: body.index(b"\n", len(body) // 2) + 1]  # whole lines only
        conn.sendall(b"%x\r\n%s\r\n" % (len(half), half))
        # ... and the connection drops before the terminating 0-length chunk
    return talk


class Blackhole:
    """A listening socket whose accept queue is full and never drained: the
    kernel drops further SYNs, so a connect times out (on loopback)."""

    def __init__(self, port: int):
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(0)
        self.fillers = []
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            try:
                filler.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            self.fillers.append(filler)
        time.sleep(0.05)  # let the handshakes settle into the queue

    def close(self) -> None:
        for filler in self.fillers:
            filler.close()
        self.listener.close()


# --- kvwatch's side ---------------------------------------------------------


def metric_values(text: str) -> dict:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(text: str, name: str, **labels):
    return metric_values(text).get((name, tuple(sorted(labels.items()))))


def make_kvwatch(target: str, **overrides):
    settings = load_settings(overrides={
        "target": target, "poll_interval": "2s", "timeout": f"{TIMEOUT}s", "max_body_bytes": CAP, **overrides,
    }, environ={})
    monitor = Monitor(settings)
    return monitor, TestClient(create_app(monitor, settings))


def assert_down_with(monitor, client, reason: str) -> None:
    state = monitor.state
    assert (state.up, state.reason) == (False, reason), state.detail
    response = client.get("/metrics")
    assert response.status_code == 200
    body = response.text
    assert value(body, "kvwatch_up") == 0.0
    errors = {dict(labels)["reason"]: count for (name, labels), count in metric_values(body).items()
              if name == "kvwatch_poll_errors_total"}
    assert errors[reason] == 1 and sum(errors.values()) == 1, errors
    # Nothing from before the fault passes for current.
    stale = [name for name, _ in metric_values(body) if name.startswith("kvwatch_engine_")
             or name.startswith("kvwatch_model_") or name.startswith("kvwatch_kv_cache")]
    assert stale == []
    assert client.get("/healthz").status_code == 200
    ready = client.get("/readyz")
    assert ready.status_code == 503 and reason in ready.text
    signals = client.get("/api/v1/signals").json()
    assert (signals["up"], signals["reason"], signals["engines"]) == (False, reason, [])
    assert reason in client.get("/").text


def assert_recovered(monitor, client) -> None:
    state = monitor.state
    assert state.up, f"{state.reason}: {state.detail}"
    body = client.get("/metrics").text
    assert value(body, "kvwatch_up") == 1.0
    assert client.get("/readyz").status_code == 200
    # The good poll after the fault is not lost, and the fault added nothing:
    # the window holds exactly the two good polls, and its increases are
    # prefix-load minus idle (hand-read from the captures).
    entries = list(monitor.window.entries)
    assert len(entries) == 2
    span = entries[1].snapshot.time - entries[0].snapshot.time
    assert value(body, "kvwatch_prefix_cache_hit_ratio", **ENGINE) == pytest.approx(2048 / 2640)
    assert value(body, "kvwatch_prompt_tokens_per_second", **ENGINE) == pytest.approx(2640 / span)
    assert value(body, "kvwatch_generation_tokens_per_second", **ENGINE) == pytest.approx(53 / span)
    assert value(body, "kvwatch_engine_kv_cache_usage_ratio", **ENGINE) == pytest.approx(0.1417322834645669)


@pytest.fixture
def capture(fixtures_dir):
    return lambda name: (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


@contextmanager
def engine_serving(port, answers):
    with page_server_on(port, answers) as server:
        yield server


def run_fault(capture, fault, reason: str, target_host: str = "127.0.0.1"):
    """good poll -> fault -> good poll, on one port; `fault(port)` is a
    context manager that holds the fault in place for one poll."""
    port = free_port()
    monitor, client = make_kvwatch(f"http://{target_host}:{port}/metrics")
    with engine_serving(port, [Answer(capture("idle"))]):
        assert monitor.poll_once().up
    with fault(port):
        monitor.poll_once()
        assert_down_with(monitor, client, reason)
    with engine_serving(port, [Answer(capture("prefix-load"))]):
        monitor.poll_once()
    assert_recovered(monitor, client)
    return monitor


# --- the faults ---------------------------------------------------------------


@contextmanager
def nothing_listening(port):
    yield


def answering(*answers: Answer):
    @contextmanager
    def fault(port):
        with page_server_on(port, list(answers)):
            yield
    return fault


def raw(talk):
    @contextmanager
    def fault(port):
        server = RawServer(port, talk)
        try:
            yield
        finally:
            server.close()
    return fault


@contextmanager
def blackhole(port):
    hole = Blackhole(port)
    try:
        yield
    finally:
        hole.close()


def test_connection_refused(capture):
    run_fault(capture, nothing_listening, "refused")


def test_connect_timeout_on_a_listener_that_never_accepts(capture):
    run_fault(capture, blackhole, "timeout")


def test_read_timeout_on_a_server_that_accepts_and_never_answers(capture):
    run_fault(capture, raw(never_answer), "timeout")


def test_read_timeout_on_a_late_status_line(capture):
    run_fault(capture, answering(Answer(capture("idle"), delay=TIMEOUT * 3)), "timeout")


def test_headers_trickled_a_byte_at_a_time_hit_the_overall_deadline(capture):
    # Each byte comes well within the read timeout; only the overall
    # deadline can stop this (it used to hold the poll forever).
    started = time.monotonic()
    run_fault(capture, raw(trickle_headers), "timeout")
    assert time.monotonic() - started < 30  # bounded at all, not a speed claim


def test_body_trickled_a_byte_at_a_time_hits_the_overall_deadline(capture):
    body = 'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 1\n' * 40  # ~2.6 KB, 26 s at this pace
    run_fault(capture, answering(Answer(body, trickle=0.01)), "timeout")


def test_body_over_the_size_cap(capture):
    run_fault(capture, answering(Answer(capture("idle") * 6)), "too_large")  # ~310 KB > 256 KiB


def test_gzip_bomb_stops_at_the_cap_after_decompression(capture):
    bomb = gzip.compress(b"vllm:num_requests_running 1\n" * (2_000_000 // 28 * 16))  # 32 MB -> ~100 KB
    assert len(bomb) < CAP
    run_fault(capture, answering(Answer(bomb, headers={"Content-Type": "text/plain", "Content-Encoding": "gzip"})),
              "too_large")


def test_gzip_stream_cut_off_at_a_line_boundary(capture):
    # A gzip stream flushed after whole lines and cut there: it decompresses
    # to a page that ends in a newline, but has no end marker.
    text = capture("idle").encode()
    compressor = zlib.compressobj(wbits=31)
    cut = compressor.compress(text[: text.index(b"\n", len(text) // 2) + 1]) + compressor.flush(zlib.Z_FULL_FLUSH)
    run_fault(capture, answering(Answer(cut, headers={"Content-Type": "text/plain", "Content-Encoding": "gzip"})),
              "truncated")


def test_lying_content_length_then_close(capture):
    text = capture("idle")
    run_fault(capture, answering(Answer(text, declared_length=len(text.encode()) + 1000)), "truncated")


def test_connection_dropped_mid_body(capture):
    run_fault(capture, answering(Answer(capture("idle"), close_after=20_000)), "truncated")


def test_close_delimited_body_cut_mid_line(capture):
    run_fault(capture, raw(close_delimited_cut_mid_line(capture("idle").encode())), "truncated")


def test_chunked_body_without_its_last_chunk(capture):
    run_fault(capture, raw(chunked_without_last_chunk(capture("idle").encode())), "truncated")


def test_page_without_trailing_newline(capture):
    run_fault(capture, answering(Answer(capture("idle").rstrip("\n"))), "truncated")


def test_connection_closed_before_the_status_line(capture):
    run_fault(capture, raw(close_before_status), "disconnected")


def test_redirect_is_refused_and_the_other_host_never_asked(capture):
    with PageServer([Answer(capture("idle"))]) as elsewhere:
        run_fault(capture, answering(Answer(status=302, headers={"Location": elsewhere.url})), "http_3xx")
        assert elsewhere.requests == []


@pytest.mark.parametrize("status", [401, 403, 404])
def test_http_4xx(capture, status):
    run_fault(capture, answering(Answer("no\n", status=status)), "http_4xx")


@pytest.mark.parametrize("status", [500, 502, 503])
def test_http_5xx(capture, status):
    run_fault(capture, answering(Answer("busy\n", status=status)), "http_5xx")


def test_proxy_html_page_is_a_content_type_error(capture):
    html_page = "<html><body><h1>502 Bad Gateway</h1></body></html>\n"
    run_fault(capture, answering(Answer(html_page, headers={"Content-Type": "text/html"})), "content_type")


def test_body_that_is_not_utf8(capture):
    run_fault(capture, answering(Answer(b"vllm:num_requests_running 1\n\xff\xfe\xfa\n")), "decode")


def test_garbage_page(capture):
    run_fault(capture, answering(Answer("\x00\x01 {{{ not metrics }}}\n" * 100)), "no_engine_metrics")


def test_dns_failure_then_the_name_resolves_again(capture, monkeypatch):
    """The name is under .invalid (RFC 6761), so the real resolver fails it;
    the good polls resolve it to loopback, as a DNS that came back would."""
    real_getaddrinfo = socket.getaddrinfo
    name = "kvwatch-engine.invalid"

    def resolving(host, *args, **kwargs):
        return real_getaddrinfo("127.0.0.1" if host == name else host, *args, **kwargs)

    @contextmanager
    def dns_down(port):
        monkeypatch.setattr(socket, "getaddrinfo", real_getaddrinfo)
        try:
            yield
        finally:
            monkeypatch.setattr(socket, "getaddrinfo", resolving)

    monkeypatch.setattr(socket, "getaddrinfo", resolving)
    run_fault(capture, dns_down, "dns", target_host=name)


# --- what the engine may send that is fine -------------------------------------


@pytest.mark.parametrize("headers", [
    {"Content-Type": "text/plain", "Content-Encoding": "gzip"},
    {"Content-Type": "text/plain; version=0.0.4", "Content-Encoding": "gzip"},
], ids=["gzip", "gzip-0.0.4"])
def test_gzip_encoded_page_is_accepted(capture, headers):
    port = free_port()
    monitor, client = make_kvwatch(f"http://127.0.0.1:{port}/metrics")
    answers = [Answer(gzip.compress(capture(name).encode()), headers=headers) for name in ("idle", "prefix-load")]
    with engine_serving(port, answers) as server:
        assert monitor.poll_once().up
        assert monitor.poll_once().up
    assert server.requests[0]["headers"]["Accept-Encoding"] == "gzip"
    assert_recovered(monitor, client)


def test_gzip_body_of_two_members_is_read_whole(capture):
    """RFC 1952 allows several gzip members one after another (what `cat a.gz
    b.gz` or a proxy that compresses as it streams writes): the page is all of
    them. The cut here falls inside the token counters' families."""
    port = free_port()
    monitor, client = make_kvwatch(f"http://127.0.0.1:{port}/metrics")
    headers = {"Content-Type": "text/plain", "Content-Encoding": "gzip"}

    def two_members(text: str) -> bytes:
        cut = text.index("vllm:prompt_tokens_total")
        return gzip.compress(text[:cut].encode()) + gzip.compress(text[cut:].encode())

    answers = [Answer(two_members(capture(name)), headers=headers) for name in ("idle", "prefix-load")]
    with engine_serving(port, answers):
        assert monitor.poll_once().up
        assert monitor.poll_once().up
    assert_recovered(monitor, client)


@pytest.mark.parametrize("content_type", ["application/octet-stream", "application/openmetrics-text; version=1.0.0", ""])
def test_a_real_page_under_another_content_type_is_accepted(capture, content_type):
    port = free_port()
    # The page's type is under test, not the deadline: the 0.5 s of the slow-server
    # tests timed out here once on a machine under a load of 15.
    monitor, client = make_kvwatch(f"http://127.0.0.1:{port}/metrics", timeout="5s", poll_interval="10s")
    headers = {"Content-Type": content_type} if content_type else {}
    answers = [Answer(capture(name), headers=headers) for name in ("idle", "prefix-load")]
    with engine_serving(port, answers):
        assert monitor.poll_once().up
        assert monitor.poll_once().up
    assert_recovered(monitor, client)


# --- the loop itself ----------------------------------------------------------


def test_background_loop_outlives_a_run_of_faults_and_recovers(capture):
    """The poll thread meets one fault after another and keeps its pace; the
    first good page afterwards brings it back up."""
    port = free_port()
    monitor, client = make_kvwatch(f"http://127.0.0.1:{port}/metrics", poll_interval="0.4s", timeout="0.2s")
    faults = [
        Answer("x\n", status=500),
        Answer("\x00garbage\n"),
        Answer(capture("idle"), delay=0.35),
        Answer(capture("idle"), close_after=1000),
        Answer(capture("idle").rstrip("\n")),
    ]
    with engine_serving(port, faults + [Answer(capture("idle"))]) as server:
        monitor.start()
        try:
            deadline = time.monotonic() + 60
            while not monitor.state.up and time.monotonic() < deadline:
                time.sleep(0.05)
            assert monitor.state.up, monitor.state.reason
            assert monitor._thread.is_alive()
        finally:
            monitor.stop()
    body = client.get("/metrics").text
    assert value(body, "kvwatch_up") == 1.0
    for reason in ("http_5xx", "no_engine_metrics", "timeout", "truncated"):
        assert value(body, "kvwatch_poll_errors_total", reason=reason) >= 1, reason
    assert len(server.requests) >= len(faults) + 1
