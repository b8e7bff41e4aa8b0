"""The poll of an http:// target goes over kvwatch.scrape's own plain
HTTP/1.1 client (h11 over one kept-alive socket, half of requests' CPU;
its framing is tests/test_fetch_framing.py's): it reads
what the session reads, keeps one connection across polls, reopens one the
server closed, and hands a target that sets cookies to the session. The
failures and their reasons are tests/test_reliability_faults.py's, which
run through this client."""

from __future__ import annotations

import socket
import threading

import pytest

from kvwatch.scrape import Fetcher
from pageserver import Answer, PageServer

PAGE = b'vllm:num_requests_running{engine="0",model_name="m"} 1\n' * 50


class Scripted:
    """A loopback HTTP server on raw sockets: `answer(index, request)` gives
    the bytes to send for the index-th request (over all connections) and
    whether to close the connection after them. Its threads are stopped and
    joined on close."""

    def __init__(self, answer):
        self.answer = answer
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/metrics"
        self.connections = 0
        self.requests: list[bytes] = []
        self.lock = threading.Lock()
        self.accepted: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self.accepted.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        with conn:
            data = b""
            while True:
                try:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        data += chunk
                except OSError:
                    return
                request, _, data = data.partition(b"\r\n\r\n")
                with self.lock:
                    self.requests.append(request)
                    index = len(self.requests) - 1
                reply, close = self.answer(index, request)
                conn.sendall(reply)
                if close:
                    return

    def close(self) -> None:
        for sock in [self.listener] + self.accepted:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self.threads:
            thread.join(10)
        self.listener.close()
        assert not any(thread.is_alive() for thread in self.threads)


def sized(body: bytes, *headers: str) -> bytes:
    head = ["HTTP/1.1 200 OK", "Content-Type: text/plain; version=0.0.4", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def fetcher(url: str) -> Fetcher:
    return Fetcher(url, 5.0, 1 << 20)


def test_one_kept_alive_connection_carries_every_poll():
    server = Scripted(lambda index, request: (sized(PAGE), False))
    try:
        reading = fetcher(server.url)
        for _ in range(3):
            result = reading.fetch()
            assert result.ok and result.text == PAGE.decode() and result.content_type == "text/plain"
        assert server.connections == 1
        assert server.requests[0].startswith(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:")
    finally:
        server.close()


def test_the_plain_client_reads_what_the_session_reads(fixtures_dir):
    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(page)]) as engine:
        plain = fetcher(engine.url).fetch()
        through_session = fetcher(engine.url)
        through_session._plain = None
        session = through_session.fetch()
    assert plain.ok and session.ok
    assert (plain.text, plain.size, plain.content_type) == (session.text, session.size, session.content_type)
    assert engine.requests[0]["headers"] == {**engine.requests[1]["headers"]}


def test_a_chunked_page_with_extensions_and_trailers_is_read_whole():
    half = len(PAGE) // 2
    body = (b"%x;name=value\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n"
            % (half, PAGE[:half], len(PAGE) - half, PAGE[half:]))
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    server = Scripted(lambda index, request: (reply, False))
    try:
        reading = fetcher(server.url)
        assert reading.fetch().text == PAGE.decode()
        assert reading.fetch().text == PAGE.decode()
        assert server.connections == 1
    finally:
        server.close()


def test_an_interim_answer_is_passed_over_for_the_answer_that_follows():
    reply = b"HTTP/1.1 100 Continue\r\n\r\n" + sized(PAGE)
    server = Scripted(lambda index, request: (reply, False))
    try:
        reading = fetcher(server.url)
        assert reading.fetch().text == PAGE.decode()
        assert reading.fetch().text == PAGE.decode()
        assert server.connections == 1
    finally:
        server.close()


def test_a_connection_the_server_closed_while_idle_is_opened_again():
    # Every answer says it closes; then the server does.
    server = Scripted(lambda index, request: (sized(PAGE), True))
    try:
        reading = fetcher(server.url)
        for _ in range(3):
            assert reading.fetch().ok
        assert server.connections == 3
    finally:
        server.close()


def test_a_kept_connection_that_ends_before_answering_is_tried_once_more_on_a_new_one():
    def answer(index, request):
        if index == 1:
            return b"", True  # the reused connection goes away before answering
        return sized(PAGE), False
    server = Scripted(answer)
    try:
        reading = fetcher(server.url)
        assert reading.fetch().ok
        result = reading.fetch()
        assert result.ok, result.detail
        assert server.connections == 2 and len(server.requests) == 3
    finally:
        server.close()


@pytest.mark.parametrize("close_delimited", [False, True], ids=["sized", "close-delimited"])
def test_an_http_1_0_answer_closes_its_connection(close_delimited):
    head = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n"
    reply = head + (b"\r\n" if close_delimited else b"Content-Length: %d\r\n\r\n" % len(PAGE)) + PAGE
    server = Scripted(lambda index, request: (reply, True))
    try:
        reading = fetcher(server.url)
        assert reading.fetch().text == PAGE.decode()
        assert reading.fetch().text == PAGE.decode()
        assert server.connections == 2
    finally:
        server.close()


def test_a_target_that_sets_a_cookie_is_read_through_the_session_which_sends_it_back():
    server = Scripted(lambda index, request: (sized(PAGE, "Set-Cookie: session=abc; Path=/"), False))
    try:
        reading = fetcher(server.url)
        assert reading.fetch().ok
        assert reading._plain is None
        assert reading.fetch().ok
        assert reading.fetch().ok
        assert b"Cookie: session=abc" in server.requests[-1]
    finally:
        server.close()


def test_credentials_in_the_url_are_sent_as_basic_auth_and_kept_out_of_the_detail():
    server = Scripted(lambda index, request: (b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n", False))
    try:
        url = server.url.replace("http://", "http://scraper:s3cret-pass@") + "?api_key=k3y-value"
        result = fetcher(url).fetch()
        assert (result.reason, result.detail) == ("http_5xx", "HTTP 503")
        assert b"Authorization: Basic " in server.requests[0]
        assert b"GET /metrics?api_key=k3y-value HTTP/1.1" in server.requests[0]
    finally:
        server.close()
    refused = fetcher(url).fetch()  # nothing listens now
    assert refused.reason == "refused"
    assert "k3y-value" not in refused.detail and "s3cret-pass" not in refused.detail
    assert "<redacted>" in refused.detail


def test_a_token_with_a_nul_byte_is_refused_before_sending_and_never_quoted(tmp_path):
    # requests lets a NUL through (it refuses only line ends); HTTP/1.1 does not.
    token = tmp_path / "token"
    token.write_text("s3cret\x00token\n")
    server = Scripted(lambda index, request: (sized(PAGE), False))
    try:
        result = Fetcher(server.url, 5.0, 1 << 20, bearer_token_file=str(token)).fetch()
        assert result.reason == "error" and "not valid in HTTP/1.1" in result.detail
        assert "s3cret" not in result.detail and server.requests == []
    finally:
        server.close()
