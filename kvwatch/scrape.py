"""Fetching the engine's /metrics: the only network I/O toward the engine.

Limits on every fetch: a connect and read timeout and an overall deadline (a
server that trickles bytes, in its headers or its body, cannot hold a poll past
it: a watchdog shuts the socket down when the deadline passes), a cap on the body size
(counted after decompression), no redirects (kvwatch only ever fetches the
configured target), exact framing (an answer that leaves any byte behind its
end closes the connection: nothing it left is read as the next answer), and a
record of the content type (an HTML error page from a proxy is reported as
such). Each failure has a short machine-readable reason for
`kvwatch_poll_errors_total{reason}` and a human detail for logs; neither ever
contains the bearer token, nor the credentials or query string of the target URL.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol
from urllib.parse import unquote, urlsplit

import h11
import requests
import requests.adapters
import urllib3
import urllib3.connection
import urllib3.util.wait

from kvwatch import __version__
from kvwatch.present import public_host
from kvwatch.units import read_small_file

ACCEPT = "text/plain; version=0.0.4; charset=utf-8, application/openmetrics-text; version=1.0.0; q=0.5"
ACCEPTED_CONTENT_TYPES = ("text/plain", "application/openmetrics-text")
CHUNK = 64 * 1024
# The most of a second source's page kvwatch reads (the upstream's
# histogram, LMCache's own server), below the engine's cap (max_body_bytes,
# when that is smaller, wins): those pages hold a histogram or a handful of
# counters (LMCache's, kilobytes), and at the engine's 8 MiB each, beside
# the engine's page, kvwatch peaked at 541 MiB against its 384Mi limit
# (benchmarks/worst_page_probe.py, docs/reliability.md).
SECOND_SOURCE_MAX_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class FetchResult:
    text: str | None
    reason: str | None = None  # None on success
    detail: str = ""
    seconds: float = 0.0
    size: int = 0
    content_type: str = ""
    sentence: str = ""  # one human sentence for the failure, no exception text (failure_sentence)

    @property
    def unexpected_content_type(self) -> bool:
        return bool(self.content_type) and self.content_type not in ACCEPTED_CONTENT_TYPES

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def page(self) -> str:
        """The text of a successful fetch ("" for a failed one, which has none)."""
        return self.text if self.text is not None else ""


def _gunzip(decompressor, data: bytes, limit: int):
    """Up to `limit` bytes of `data` decompressed, and the decompressor for
    what follows. A gzip file may hold several members one after another
    (RFC 1952, section 2.2; what `cat a.gz b.gz` or a streaming proxy writes):
    the page is all of them, so a new member starts where one ends."""
    out = b""
    while data and len(out) < limit:
        if decompressor.eof:
            decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out += decompressor.decompress(data, limit - len(out))
        data = decompressor.unused_data if decompressor.eof else b""
    return out, decompressor


class BearerToken:
    """A bearer token kept in a file (`bearer_token_file`), read again for
    each request: projected service-account tokens rotate. A failed read
    keeps the last good token; the request reports auth errors itself."""

    def __init__(self, path: str | None):
        self.path = path
        self.value: str | None = None

    def headers(self) -> dict[str, str]:
        if not self.path:
            return {}
        try:
            # Bounded like the scrape token (a token is a few KB at most).
            self.value = read_small_file(self.path, 64 * 1024).decode("utf-8").strip()
        except (OSError, ValueError):
            pass
        return {"Authorization": f"Bearer {self.value}"} if self.value else {}


class PageSource(Protocol):
    """What the monitor polls: the engine (Fetcher) or a replay's recorded pages."""

    def fetch(self) -> FetchResult: ...


class RenderedPage:
    """A PageSource over text made in this process (a simulated engine's
    page, a test's pages): each fetch answers what `render()` gives then."""

    def __init__(self, render: Callable[[], str]):
        self.render = render

    def fetch(self) -> FetchResult:
        text = self.render()
        return FetchResult(text, size=len(text))


class Fetcher:
    # The text format ends every line with a newline: a page without one was
    # cut off. A subclass that reads JSON (kvwatch capacity --kvwatch) sets False.
    whole_lines = True

    def __init__(
        self,
        url: str,
        timeout: float,
        max_body_bytes: int,
        bearer_token_file: str | None = None,
        ca_bundle: str | None = None,
        tls_verify: bool = True,
    ):
        self.url = url
        self.timeout = timeout
        self.max_body_bytes = max_body_bytes
        self.bearer_token_file = bearer_token_file
        self.session = requests.Session()
        # The environment's proxies must not redirect a sidecar's loopback poll.
        self.session.trust_env = False
        self.session.verify = ca_bundle if ca_bundle else tls_verify
        for scheme in ("http://", "https://"):
            self.session.mount(scheme, _WatchedAdapter())
        self.session.headers.update({
            "Accept": ACCEPT,
            "Accept-Encoding": "gzip",
            "User-Agent": f"kvwatch/{__version__}",
        })
        self._token = BearerToken(bearer_token_file)
        # The request as the session prepares it (URL, the session's and the
        # token's headers), kept while those stay the same and the session
        # holds no cookie: what Session.get rebuilds on every poll.
        self._prepared: tuple[tuple, requests.PreparedRequest] | None = None
        if not tls_verify:
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
        # Plain http:// targets are read over one kept-alive socket by
        # _PlainHTTP (h11: half of requests' CPU per poll); https:// ones, and
        # a target that sets cookies, through the session.
        self._plain: _PlainHTTP | None = _PlainHTTP() if urlsplit(url).scheme.lower() == "http" else None

    def fetch(self) -> FetchResult:
        started = time.monotonic()
        watchdog = _Watchdog(self.timeout)
        try:
            with watchdog:
                result = self._fetch(started)
        except Exception as exc:  # a fetch reports, it never raises into the poll loop
            result = self._fail("error", f"unexpected {type(exc).__name__}", started)
        if watchdog.fired and result.reason != "timeout":
            # Whatever the cut-off read looked like (an early EOF, a short
            # body), the server did not answer within the deadline.
            return self._fail("timeout", f"response not complete within {self.timeout:g}s (slow server)", started)
        return result

    def _fetch(self, started: float) -> FetchResult:
        deadline = started + self.timeout
        if self._plain is not None and not self.session.cookies:
            return self._fetch_plain(started, deadline)
        try:
            request = self._request()
        except requests.exceptions.InvalidHeader:
            # Its message quotes the header value, that is the token itself.
            message = "the bearer token file does not hold a valid HTTP header value"
            return self._fail("error", message, started, sentence=message)
        try:
            # Prepared apart: an InvalidHeader raised while reading the answer
            # is the server's, never blamed on the token.
            response = self.session.send(request, timeout=(self.timeout, self.timeout),
                                         allow_redirects=False, stream=True)
        except requests.exceptions.SSLError as exc:
            return self._fail("tls", _safe(exc), started)
        except requests.exceptions.ConnectTimeout:
            return self._fail("timeout", f"connect timed out after {self.timeout:g}s", started)
        except requests.exceptions.ReadTimeout:
            return self._fail("timeout", f"no response within {self.timeout:g}s", started)
        except requests.exceptions.ConnectionError as exc:
            return self._fail(connection_reason(exc), _safe(exc), started)
        except (requests.exceptions.InvalidHeader, urllib3.exceptions.InvalidHeader) as exc:
            # urllib3 refuses Content-Length values that disagree: the same
            # page without a single length as the plain path's.
            sentence = FRAMING_SENTENCE.format(host=public_host(self.url))
            return self._fail("truncated", _safe(exc), started, sentence=sentence)
        except requests.exceptions.RequestException as exc:
            return self._fail("error", _safe(exc), started)

        with response:
            status = response.status_code
            if status != 200:
                location = response.headers.get("Location", "")
                detail = f"HTTP {status}" + (f" redirect to {location[:200]} refused" if 300 <= status < 400 else "")
                return self._fail(f"http_{status // 100}xx", detail, started)
            # The content type is only a hint: a replay behind a plain file
            # server says application/octet-stream for a good page. The
            # monitor blames it only when the page holds no engine metrics.
            content_type = response.headers.get("Content-Type", "").split(";")[0].strip().lower()[:80]
            body, failure = self._read_body(response, deadline)
            if failure is not None:
                return self._fail(failure[0], failure[1], started)
        return self._page(body, content_type, started)

    def _fetch_plain(self, started: float, deadline: float) -> FetchResult:
        """The same request, outcomes and reasons as the session's, over
        _PlainHTTP."""
        try:
            request = self._request(copy=False)  # _PlainHTTP only reads it
        except requests.exceptions.InvalidHeader:
            message = "the bearer token file does not hold a valid HTTP header value"
            return self._fail("error", message, started, sentence=message)
        except requests.exceptions.RequestException as exc:
            return self._fail("error", _safe(exc), started)
        plain = self._plain
        if plain is None:  # a cookie moved the polls to the session meanwhile
            return self._fail("error", "the plain-HTTP connection was closed", started)
        answer = plain.get(request, self.timeout, deadline, self.max_body_bytes)
        if answer.failure is not None:
            sentence = answer.sentence.format(host=public_host(self.url)) if answer.sentence else None
            return self._fail(answer.failure[0], answer.failure[1], started, sentence=sentence)
        if answer.sets_cookie:
            # The session keeps cookies and sends them back; this path does
            # not: the next polls go through the session.
            plain.close()
            self._plain = None
        status = answer.status
        if status != 200:
            location = answer.headers.get("location", "")
            detail = f"HTTP {status}" + (f" redirect to {location[:200]} refused" if 300 <= status < 400 else "")
            return self._fail(f"http_{status // 100}xx", detail, started)
        content_type = answer.headers.get("content-type", "").split(";")[0].strip().lower()[:80]
        return self._page(answer.body, content_type, started)

    def _page(self, body: bytes, content_type: str, started: float) -> FetchResult:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return self._fail("decode", f"body is not UTF-8 (byte {exc.start})", started)
        if self.whole_lines and text and not text.endswith("\n"):
            # The text format ends every line with a newline; a page without
            # one was cut off, and half a page would skew every delta.
            return self._fail("truncated", f"page of {len(body)} bytes ends mid-line", started)
        return FetchResult(text, seconds=time.monotonic() - started, size=len(body), content_type=content_type)

    def _request(self, copy: bool = True) -> requests.PreparedRequest:
        """What `self.session.get(self.url, headers=token headers)` sends
        (Session.send fills in the same verify, proxies and cert as get).
        `copy=False`: the kept request itself, for a reader that only reads it."""
        headers = self._token.headers()
        key = tuple(headers.items())
        if self._prepared is None or self._prepared[0] != key or self.session.cookies:
            request = self.session.prepare_request(requests.Request("GET", self.url, headers=headers))
            if self.session.cookies:
                return request  # cookies may change with every answer: prepared afresh each time
            self._prepared = (key, request)
        return self._prepared[1].copy() if copy else self._prepared[1]

    def _read_body(self, response: requests.Response, deadline: float) -> tuple[bytes, tuple[str, str] | None]:
        return read_body(response, self.max_body_bytes, deadline, self.timeout)

    def _fail(self, reason: str, detail: str, started: float, sentence: str | None = None) -> FetchResult:
        sentence = sentence or failure_sentence(reason, public_host(self.url), self.timeout)
        return FetchResult(None, reason, self._redact(detail), time.monotonic() - started, sentence=sentence)

    def _redact(self, text: str) -> str:
        # Exception texts quote the request's URL (its query string included)
        # and sometimes more; a detail reaches logs, the status page and the API.
        for secret in self._secrets():
            text = text.replace(secret, "<redacted>")
        return text

    def _secrets(self) -> list[str]:
        parts = urlsplit(self.url)
        found = [parts.query, parts.username, parts.password]
        found += [unquote(p) for p in (parts.query, parts.username, parts.password) if p]
        if parts.username is not None:
            found.append(parts.netloc.rpartition("@")[0])
        if self._token.value:
            found.append(self._token.value)
            found.extend(self._token.value.splitlines())
        # Longest first, so a secret containing another is replaced whole.
        return sorted({s for s in found if s and len(s) >= 3}, key=len, reverse=True)


def read_body(response: requests.Response, cap: int, deadline: float,
              timeout: float) -> tuple[bytes, tuple[str, str] | None]:
    """A streamed response's body, gzip decompressed here so that `cap`
    counts what is held in memory (a gzip bomb stops at the cap), read until
    `deadline` (time.monotonic()); or b"" and (reason, detail): too_large,
    timeout, truncated. A watchdog (Watchdog) must also be running: a
    socket timeout bounds only the wait for the next byte."""
    encoding = response.headers.get("Content-Encoding", "").lower()
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS) if encoding == "gzip" else None
    parts: list[bytes] = []
    size = 0
    try:
        # decode_content=False: decompress ourselves, so the cap applies to
        # what we hold in memory.
        for chunk in response.raw.stream(CHUNK, decode_content=False):
            if decompressor is not None:
                chunk, decompressor = _gunzip(decompressor, chunk, cap + 1 - size)
            size += len(chunk)
            if size > cap:
                return b"", ("too_large", f"body exceeds the {cap} byte cap")
            parts.append(chunk)
            if time.monotonic() > deadline:
                return b"", ("timeout", f"body not complete within {timeout:g}s (slow server)")
    except (urllib3.exceptions.ProtocolError, urllib3.exceptions.ReadTimeoutError,
            requests.exceptions.RequestException, zlib.error, OSError) as exc:
        reason = "timeout" if "timed out" in str(exc).lower() else "truncated"
        return b"", (reason, _safe(exc))
    if decompressor is not None and not decompressor.eof:
        # A gzip stream cut off at a line boundary would otherwise pass
        # for a whole page.
        return b"", ("truncated", "gzip stream ends before its end marker")
    return b"".join(parts), None


# What an answer may send before its body (status line and headers): h11
# holds at most this much while it waits for their end (http.client's bound
# on one header line).
_MAX_HEAD = 64 * 1024
# The sentence for an answer whose headers leave its end unknown: two
# different Content-Length values, one that is not a number, or a
# Transfer-Encoding other than chunked.
FRAMING_SENTENCE = "the page from {host} has no single, valid length (conflicting or invalid Content-Length)"


_END = h11.EndOfMessage()  # a GET's end: no body


@dataclass(slots=True)
class _Answer:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)  # lower-cased names; a repeated header keeps its last value
    body: bytes = b""
    sets_cookie: bool = False
    failure: tuple[str, str] | None = None  # (reason, detail), as the session's path names them
    sentence: str = ""  # a template ({host}) saying more than the reason's own sentence, where one does


class _Ended(Exception):
    """The server closed the connection before the answer's head was whole."""


class _PlainHTTP:
    """GET over one kept-alive plain-HTTP/1.1 connection, framed by h11:
    what a poll of an http:// target needs of requests, urllib3 and
    http.client at a fraction of their CPU. The request the session prepares
    (h11's event kept while it stays the same); the answer's head and its
    body (Content-Length, chunked or up to the close) framed by h11, the body
    gzip decompressed within the cap (read_body's rules); the same failures
    under the same reasons. An answer that leaves any byte behind its end (a
    stray line end, a second answer nobody asked for) closes the connection,
    and so does a connection that sent anything, or closed, while idle:
    nothing but the answer to this request is read as its answer. A reused
    connection that ends before any byte of the answer is tried once more on
    a new one. The socket is watched by the fetch's Watchdog."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.http: h11.Connection | None = None
        self._sent: tuple[tuple, h11.Request, tuple[str, int]] | None = None
        self._where = ""
        self._received = 0  # bytes of the current answer read so far

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = self.http = None

    def _request(self, request: requests.PreparedRequest) -> tuple[h11.Request, tuple[str, int]]:
        key = (request.url, tuple(request.headers.items()))
        if self._sent is None or self._sent[0] != key:
            url = urllib3.util.parse_url(request.url or "")
            port = url.port or 80
            host = url.host or ""
            headers = [("Host", host if port == 80 else f"{host}:{port}"), *request.headers.items()]
            event = h11.Request(method="GET", target=_latin1(request.path_url),
                                headers=[(_latin1(name), _latin1(value)) for name, value in headers])
            self._sent = (key, event, (host.strip("[]"), port))
            # What a failure's detail quotes, as requests' exceptions quote
            # it (the query string is redacted by the Fetcher).
            self._where = f"host={host!r}, port={port}, url: {request.path_url}"
        return self._sent[1], self._sent[2]

    def _detail(self, exc: Exception) -> str:
        return f"{_safe(exc)} ({self._where})"

    def get(self, request: requests.PreparedRequest, timeout: float, deadline: float, cap: int) -> _Answer:
        try:
            event, address = self._request(request)
        except h11.LocalProtocolError:  # its message quotes the header: the token, perhaps
            return _Answer(failure=("error", "the request's path or a header value is not valid in HTTP/1.1"))
        except (UnicodeEncodeError, ValueError, urllib3.exceptions.LocationParseError) as exc:
            return _Answer(failure=("error", self._detail(exc)))
        reused = self.sock is not None
        if self.sock is not None and _dropped(self.sock):
            self.close()
            reused = False
        answer = self._exchange(event, address, timeout, deadline, cap, reused)
        if answer is None:  # the kept connection had been closed: once more on a new one
            self.close()
            answer = self._exchange(event, address, timeout, deadline, cap, False)
        if answer is None:  # a new connection is never retried: _exchange answers it
            answer = _Answer(failure=("disconnected", "the server closed the connection without an answer"))
        if answer.failure is not None or answer.status != 200:
            self.close()
        return answer

    def _connect(self, address: tuple[str, int], timeout: float) -> _Answer | None:
        try:
            sock = socket.create_connection(address, timeout)
        except socket.gaierror as exc:
            return _Answer(failure=("dns", self._detail(exc)))
        except (socket.timeout, TimeoutError):
            return _Answer(failure=("timeout", f"connect timed out after {timeout:g}s"))
        except ConnectionRefusedError as exc:
            return _Answer(failure=("refused", self._detail(exc)))
        except OSError as exc:
            return _Answer(failure=(connection_reason(exc), self._detail(exc)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.http = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD)
        return None

    def _exchange(self, event: h11.Request, address: tuple[str, int], timeout: float, deadline: float, cap: int,
                  reused: bool) -> _Answer | None:
        if self.sock is None and (refused := self._connect(address, timeout)) is not None:
            return refused
        sock, http = self._live()
        _Watchdog.watch(sock)
        self._received = 0
        try:
            sock.settimeout(timeout)
            sock.sendall((http.send(event) or b"") + (http.send(_END) or b""))
            head = self._head()
        except (socket.timeout, TimeoutError):
            return _Answer(failure=("timeout", f"no response within {timeout:g}s"))
        except (_Ended, OSError) as exc:
            if reused and not self._received:
                return None
            return _Answer(failure=("disconnected", self._detail(exc)))
        except h11.RemoteProtocolError as exc:
            if "Content-Length" in str(exc) or "Transfer-Encoding" in str(exc):
                return _Answer(failure=("truncated", self._detail(exc)), sentence=FRAMING_SENTENCE)
            return _Answer(failure=("disconnected", self._detail(exc)))  # a status line or header that is not HTTP
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in head.headers.raw_items()}
        answer = _Answer(head.status_code, headers, sets_cookie="set-cookie" in headers)
        if answer.status != 200:
            return answer
        answer.body, answer.failure = self._body(headers, timeout, deadline, cap)
        if answer.failure is None and not self._reusable():
            self.close()
        return answer

    def _live(self) -> tuple[socket.socket, h11.Connection]:
        """The open connection; one closed meanwhile reads as ended."""
        if self.sock is None or self.http is None:
            raise _Ended("the connection was closed")
        return self.sock, self.http

    def _read(self) -> int:
        """Hands h11 what the socket holds, up to CHUNK bytes; 0: the server
        closed (h11 judges it: the end of a close-delimited body, or a cut)."""
        sock, http = self._live()
        data = sock.recv(CHUNK)
        self._received += len(data)
        http.receive_data(data)
        return len(data)

    def _next_event(self):
        while (event := self._live()[1].next_event()) is h11.NEED_DATA:
            self._read()
        return event

    def _head(self) -> h11.Response:
        # Read first: an answer starts on an empty buffer (no byte is kept
        # past an answer's end), so h11 would only ask for data.
        while True:
            if not self._read():
                raise _Ended("RemoteDisconnected: the server closed the connection without an answer"
                             if not self._received else "the server closed the connection within the headers")
            while (event := self._live()[1].next_event()) is not h11.NEED_DATA:
                if type(event) is h11.Response:
                    return event
                # an interim answer (100 Continue): the real one follows

    def _body(self, headers: dict, timeout: float, deadline: float, cap: int) -> tuple[bytes, tuple[str, str] | None]:
        decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS) \
            if headers.get("content-encoding", "").lower() == "gzip" else None
        parts: list[bytes] = []
        size = 0
        try:
            while type(event := self._next_event()) is h11.Data:
                chunk = event.data
                if decompressor is not None:
                    chunk, decompressor = _gunzip(decompressor, chunk, cap + 1 - size)
                size += len(chunk)
                if size > cap:
                    return b"", ("too_large", f"body exceeds the {cap} byte cap")
                parts.append(chunk)
                if time.monotonic() > deadline:
                    return b"", ("timeout", f"body not complete within {timeout:g}s (slow server)")
        except (socket.timeout, TimeoutError) as exc:
            return b"", ("timeout", self._detail(exc))
        except (h11.RemoteProtocolError, OSError, zlib.error) as exc:
            return b"", ("truncated", self._detail(exc))
        if decompressor is not None and not decompressor.eof:
            return b"", ("truncated", "gzip stream ends before its end marker")
        return b"".join(parts), None

    def _reusable(self) -> bool:
        """Whether the connection may carry the next request: both sides
        done with this one and not a byte read past the answer's end (a stray
        line end, a second answer nobody asked for): that would be read as
        the next answer."""
        http = self.http
        if http is None or http.our_state is not h11.DONE or http.their_state is not h11.DONE or http.trailing_data[0]:
            return False
        http.start_next_cycle()
        return True


def _latin1(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode("latin-1")


def _dropped(sock: socket.socket) -> bool:
    """Whether a kept-alive connection was closed (or sent something) while
    idle: then it cannot carry the next request."""
    try:
        return urllib3.util.wait.wait_for_read(sock, timeout=0.0)
    except (OSError, ValueError):
        return True


class _Watchdog:
    """Shuts down the sockets of one fetch when its overall deadline passes.

    A socket timeout bounds only the wait for the next byte, so a server that
    sends one byte per second could hold a poll for as long as it likes;
    shutting the socket down wakes the blocked read at once. One thread
    (_Deadlines) watches every fetch in flight: a timer thread per fetch cost
    a thread start per poll and left a reference cycle behind each time."""

    _current = threading.local()

    def __init__(self, seconds: float):
        self.fired = False
        self.seconds = seconds
        self.deadline = 0.0
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def __enter__(self) -> "_Watchdog":
        _Watchdog._current.watchdog = self
        self.deadline = time.monotonic() + self.seconds
        _DEADLINES.watch(self)
        return self

    def __exit__(self, *exc) -> None:
        _DEADLINES.forget(self)
        _Watchdog._current.watchdog = None
        with self._lock:
            self._sockets.clear()

    @classmethod
    def watch(cls, sock: socket.socket | None) -> None:
        watchdog = getattr(cls._current, "watchdog", None)
        if watchdog is None or sock is None:
            return
        with watchdog._lock:
            if watchdog.fired:
                _shutdown(sock)
            else:
                watchdog._sockets.append(sock)

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            for sock in self._sockets:
                _shutdown(sock)


class _Deadlines:
    """The one thread that fires the watchdogs of fetches in flight, started
    with the first fetch and asleep while none is in flight."""

    def __init__(self):
        self._changed = threading.Condition()
        self._armed: set[_Watchdog] = set()
        self._thread: threading.Thread | None = None
        # When the thread wakes next (None: when told): a fetch whose
        # deadline comes later (every poll's, at one timeout) wakes nobody.
        self._wake_at: float | None = None

    def watch(self, watchdog: _Watchdog) -> None:
        with self._changed:
            self._armed.add(watchdog)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvwatch-fetch-deadlines", daemon=True)
                self._thread.start()
            if self._wake_at is None or watchdog.deadline < self._wake_at:
                self._wake_at = watchdog.deadline  # the thread may not be waiting yet: it reads the set first
                self._changed.notify()

    def forget(self, watchdog: _Watchdog) -> None:
        with self._changed:
            self._armed.discard(watchdog)

    def _run(self) -> None:
        with self._changed:
            while True:
                now = time.monotonic()
                for watchdog in [w for w in self._armed if w.deadline <= now]:
                    self._armed.discard(watchdog)
                    watchdog.fire()
                nearest = min((w.deadline for w in self._armed), default=None)
                self._wake_at = nearest
                self._changed.wait(None if nearest is None else nearest - now)


_DEADLINES = _Deadlines()


@contextlib.contextmanager
def deadlines_held() -> Iterator[threading.Thread | None]:
    """Held around a fork (`with deadlines_held() as watcher:`): the
    deadlines' thread (`watcher`, None before the first fetch) is then
    waiting, or waiting to wake, and holds no lock, since all it does is done
    holding the one this takes; a child forked meanwhile never fetches."""
    with _DEADLINES._changed:
        yield _DEADLINES._thread


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


class _WatchedConnectionMixin(urllib3.connection.HTTPConnection):
    # A new connection is watched from its TCP connect on (TLS handshake
    # included); a reused keep-alive connection from its next response on.
    def _new_conn(self):
        sock = super()._new_conn()
        _Watchdog.watch(sock)
        return sock

    def getresponse(self, *args, **kwargs):
        _Watchdog.watch(self.sock)
        return super().getresponse(*args, **kwargs)


class _WatchedHTTPConnection(_WatchedConnectionMixin, urllib3.connection.HTTPConnection):
    pass


class _WatchedHTTPSConnection(_WatchedConnectionMixin, urllib3.connection.HTTPSConnection):
    pass


class _WatchedHTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


class _WatchedAdapter(requests.adapters.HTTPAdapter):
    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _WatchedHTTPPool, "https": _WatchedHTTPSPool}


# reason -> one human sentence ({host}, {timeout}, {engine}); the page, /readyz and the
# CLI show it, the log keeps the detail.
SENTENCES = {
    "refused": "connection refused by {host}: nothing listens there (engine down or starting?)",
    "timeout": "no answer from {host} within {timeout:g} s",
    "dns": "cannot resolve the host name of {host}",
    "disconnected": "{host} closed the connection before answering",
    "connection": "cannot connect to {host}",
    "tls": "TLS handshake with {host} failed (certificate or protocol)",
    "too_large": "the page from {host} is larger than the size cap",
    "decode": "the page from {host} is not UTF-8 text",
    "truncated": "the page from {host} was cut off mid-line",
    "http_3xx": "{host} answered with a redirect, not the metrics page",
    "http_4xx": "{host} refused the request (wrong path, or a token is missing or wrong)",
    "http_5xx": "{host} answered with a server error",
    "no_engine_metrics": "{host} answers, but its page has no {engine} engine metrics (stats logging off, or not "
                         "{engine}?)",
    "content_type": "{host} answers with a page that is not Prometheus metrics",
    "error": "polling {host} failed",
    "internal": "kvwatch failed to process a poll (see its log)",
    "not_polled_yet": "kvwatch has not polled {host} yet",
}


def failure_sentence(reason: str | None, host: str, timeout: float = 0.0, engine: str = "vLLM") -> str:
    """One human sentence for a failure reason: never an exception's text."""
    template = SENTENCES.get(reason or "", "polling {host} failed ({reason})")
    return template.format(host=host, timeout=timeout, reason=reason, engine=engine)


def connection_reason(exc: Exception) -> str:
    text = str(exc)
    if isinstance(exc.__context__, socket.gaierror) or "Name or service not known" in text or "NameResolutionError" in text \
            or "nodename nor servname" in text or "Temporary failure in name resolution" in text:
        return "dns"
    if "Connection refused" in text or "ConnectionRefusedError" in text:
        return "refused"
    if "timed out" in text.lower():
        return "timeout"
    if "RemoteDisconnected" in text or "Connection aborted" in text or "reset by peer" in text:
        return "disconnected"
    return "connection"


def _safe(exc: Exception) -> str:
    # Exception texts name the URL, never headers, so no token can leak; cap
    # the length so a hostile server cannot flood the log.
    return f"{type(exc).__name__}: {str(exc)[:300]}"


# For the other readers of HTTP (the store's query API): the same watchdog
# over their sessions' sockets.
Watchdog = _Watchdog
WatchedAdapter = _WatchedAdapter
