"""Exact framing of the plain HTTP/1.1 client (kvwatch.scrape._PlainHTTP,
over h11): an answer that leaves bytes behind its end, that says its length
twice and differently, or that is followed by a second answer nobody asked
for, closes the connection, and nothing it left is read as the next
answer. Over 12 polls each, every poll reads the engine's page or fails;
never another answer's. A well-behaved server keeps one connection."""

from __future__ import annotations

import select
import socket
import threading

import pytest

from kvwatch.present import public_host
from kvwatch.scrape import FRAMING_SENTENCE, Fetcher, failure_sentence

POLLS = 12
ENGINE_PAGE = (b'# TYPE vllm:kv_cache_usage_perc gauge\n'
               b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1417\n'
               b'# TYPE vllm:num_requests_running gauge\n'
               b'vllm:num_requests_running{engine="0",model_name="m"} 2\n')
# What a confused server or proxy sends after the engine's answer: another
# page's numbers, framed as a complete answer of its own.
OTHER_PAGE = ENGINE_PAGE.replace(b"0.1417", b"0.99").replace(b"} 2\n", b"} 0\n")


class HostileServer:
    """A loopback HTTP/1.1 server on a port of its own (bind 0) that sends
    `reply()` for every request, keeping each connection open for the next
    one; `connections` counts the connections it accepted. Its threads are
    stopped and joined on close."""

    def __init__(self, reply):
        self.reply = reply
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/metrics"
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
        conn.settimeout(10)
        data = b""
        try:
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                data = data.partition(b"\r\n\r\n")[2]
                conn.sendall(self.reply())  # in one piece: what it leaves behind is in the same reads
        except OSError:
            return

    def __enter__(self) -> "HostileServer":
        return self

    def __exit__(self, *exc) -> None:
        for sock in [self.listener] + self.connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self.threads:
            thread.join(10)
        for sock in [self.listener] + self.connections:
            sock.close()
        assert not any(thread.is_alive() for thread in self.threads)


def answer(body: bytes, *headers: str, length: int | None = None) -> bytes:
    framing = [] if any(h.startswith(("Content-Length", "Transfer-Encoding")) for h in headers) else \
        [f"Content-Length: {len(body) if length is None else length}"]
    head = ["HTTP/1.1 200 OK", "Content-Type: text/plain; version=0.0.4", *framing, *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def chunked(body: bytes) -> bytes:
    half = len(body) // 2
    return answer(b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:]),
                  "Transfer-Encoding: chunked")


def poll(reply, through_session: bool = False) -> tuple[list, int, str]:
    """POLLS fetches of one Fetcher against a server sending `reply()`:
    the results, how many connections the server accepted, and its host as
    the sentences name it. `through_session`: over requests' session, the
    path of https:// targets and of targets that set cookies."""
    with HostileServer(reply) as server:
        fetcher = Fetcher(server.url, 5.0, 1 << 20)
        if through_session:
            fetcher._plain.close()
            fetcher._plain = None
        try:
            results = [fetcher.fetch() for _ in range(POLLS)]
        finally:
            if fetcher._plain is not None:
                fetcher._plain.close()
        return results, len(server.connections), public_host(server.url)


def assert_engine_pages_only(results) -> None:
    for number, result in enumerate(results):
        assert result.text in (ENGINE_PAGE.decode(), None), f"poll {number} read another answer: {result.text!r}"


@pytest.mark.parametrize("reply", [
    lambda: answer(ENGINE_PAGE) + answer(OTHER_PAGE),
    lambda: chunked(ENGINE_PAGE) + chunked(OTHER_PAGE),
], ids=["sized", "chunked"])
def test_a_second_answer_nobody_asked_for_is_never_read_as_the_next_one(reply):
    # It read the unasked answer as the next poll's: usage 0.99 and 0 running
    # every other poll, with no error.
    results, connections, _ = poll(reply)
    assert_engine_pages_only(results)
    # The first answer is whole and exactly framed: each poll reads it, and
    # drops the connection with what came after.
    assert all(result.ok for result in results), [(r.reason, r.detail) for r in results if not r.ok]
    assert connections == POLLS


def test_a_stray_line_end_after_each_answer_costs_no_poll():
    # It failed every other poll as `disconnected` (the line end was read as
    # the next answer's status line).
    results, connections, _ = poll(lambda: answer(ENGINE_PAGE) + b"\r\n")
    assert_engine_pages_only(results)
    assert all(result.ok for result in results), [(r.reason, r.detail) for r in results if not r.ok]
    assert connections == POLLS


def test_a_content_length_one_byte_short_fails_that_poll_alone():
    # The last byte of the page (its final newline) is left behind the
    # answer: the page read ends mid-line, and the byte left over went
    # to the next poll, which failed as `disconnected`.
    results, connections, host = poll(lambda: answer(ENGINE_PAGE, length=len(ENGINE_PAGE) - 1))
    assert [result.reason for result in results] == ["truncated"] * POLLS
    assert {result.sentence for result in results} == {failure_sentence("truncated", host)}
    assert connections == POLLS


def test_two_different_content_lengths_fail_as_a_page_without_a_length():
    # Which of the two is right cannot be told: the poll fails, and the
    # connection with it (the next poll read what the shorter one left).
    short = len(ENGINE_PAGE) - 20
    results, connections, host = poll(lambda: answer(ENGINE_PAGE, f"Content-Length: {len(ENGINE_PAGE)}",
                                                  f"Content-Length: {short}"))
    assert [result.reason for result in results] == ["truncated"] * POLLS
    assert {result.sentence for result in results} == {FRAMING_SENTENCE.format(host=host)}
    assert "Content-Length" in results[0].detail
    assert connections == POLLS


def test_two_different_content_lengths_read_through_the_session_are_the_same_failure():
    # urllib3 raises InvalidHeader for them; it was reported as a bearer
    # token that is no header value, on a target with no token at all.
    short = len(ENGINE_PAGE) - 20
    results, _, host = poll(lambda: answer(ENGINE_PAGE, f"Content-Length: {len(ENGINE_PAGE)}",
                                           f"Content-Length: {short}"), through_session=True)
    assert [result.reason for result in results] == ["truncated"] * POLLS
    assert {result.sentence for result in results} == {FRAMING_SENTENCE.format(host=host)}


@pytest.mark.parametrize("reply", [
    lambda: answer(ENGINE_PAGE) + answer(OTHER_PAGE),
    lambda: chunked(ENGINE_PAGE) + chunked(OTHER_PAGE),
    lambda: answer(ENGINE_PAGE) + b"\r\n",
], ids=["sized", "chunked", "stray-line-end"])
def test_through_the_session_an_answer_never_reads_what_another_left(reply):
    results, _, _ = poll(reply, through_session=True)
    assert_engine_pages_only(results)
    assert sum(result.ok for result in results) >= POLLS // 2


@pytest.mark.parametrize("reply", [
    lambda: answer(ENGINE_PAGE),
    lambda: chunked(ENGINE_PAGE),
    # The same length twice is one length (RFC 9112, section 6.3).
    lambda: answer(ENGINE_PAGE, f"Content-Length: {len(ENGINE_PAGE)}", f"Content-Length: {len(ENGINE_PAGE)}"),
], ids=["sized", "chunked", "same-length-twice"])
def test_a_well_framed_server_keeps_one_connection_for_every_poll(reply):
    results, connections, _ = poll(reply)
    assert all(result.ok and result.text == ENGINE_PAGE.decode() for result in results)
    assert connections == 1


def test_an_answer_sent_while_the_connection_is_idle_is_never_read_as_the_next_one():
    """The unasked answer comes after the poll has read its own, while the
    connection waits for the next poll: that connection is dropped, and the
    next poll asks again on a new one."""
    replies = iter([answer(ENGINE_PAGE), answer(ENGINE_PAGE)])
    with HostileServer(lambda: next(replies)) as server:
        fetcher = Fetcher(server.url, 5.0, 1 << 20)
        try:
            assert fetcher.fetch().text == ENGINE_PAGE.decode()
            server.connections[0].sendall(answer(OTHER_PAGE))
            # Bounded wait until the unasked answer is there to be read.
            assert select.select([fetcher._plain.sock], [], [], 5.0)[0]
            second = fetcher.fetch()
        finally:
            fetcher._plain.close()
        assert second.ok and second.text == ENGINE_PAGE.decode()
        assert len(server.connections) == 2


@pytest.mark.parametrize("framing", ["Content-Length: 12abc", "Transfer-Encoding: gzip, chunked"],
                         ids=["length-not-a-number", "transfer-coding-not-asked-for"])
def test_framing_kvwatch_cannot_read_fails_in_one_sentence(framing):
    # kvwatch asks for no transfer coding (no TE header): an answer in one
    # has no length kvwatch can read.
    with HostileServer(lambda: answer(ENGINE_PAGE, framing)) as server:
        fetcher = Fetcher(server.url, 5.0, 1 << 20)
        result = fetcher.fetch()
        assert fetcher._plain.sock is None  # closed
    assert result.reason == "truncated" and result.sentence == FRAMING_SENTENCE.format(host=public_host(server.url))


def test_a_head_past_64_kib_fails_as_not_http():
    # A header that never ends within the bound: h11 holds at most 64 KiB
    # waiting for the head's end.
    with HostileServer(lambda: answer(ENGINE_PAGE, "X-Padding: " + "x" * (200 * 1024))) as server:
        fetcher = Fetcher(server.url, 5.0, 1 << 20)
        result = fetcher.fetch()
    assert result.reason == "disconnected" and "Receive buffer too long" in result.detail
