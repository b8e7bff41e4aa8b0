"""The client side of `kvwatch sweep`: HTTP to an OpenAI-compatible server.

Owns streaming `/v1/completions` requests (time to first token measured at the
client, as the first chunk that carries generated output), the small JSON calls the sweep
needs (`/v1/models`, `/tokenize`, one-token probes), and abandoning requests in
flight: each request's socket is registered while it runs, so a stop can shut
it down from another thread and the reader returns at once instead of waiting
for the stream to end.

Standard library HTTP (http.client) rather than requests: it hands over the
socket, which is what makes abandoning a blocked read possible, and it never
reads proxy settings from the environment, so a loopback sweep stays loopback.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvwatch import __version__

# An error body is read only this far: enough for a message, bounded against a
# server that sends a page of HTML.
ERROR_BODY_BYTES = 4096
JSON_BODY_BYTES = 16 * 2**20
READ_SIZE = 65536
# One server-sent event (its data lines, and a line not yet ended): a
# completion chunk is a few hundred bytes; a server that never ends a line
# or an event filled memory until the request's deadline.
MAX_EVENT_BYTES = 2**20
# What is read after [DONE] before the connection is reused (the chunked
# body's end); a server that goes on sending loses its connection instead.
AFTER_DONE_BYTES = 64 * 1024


def read_within(response: http.client.HTTPResponse, conn: http.client.HTTPConnection, cap: int,
                deadline: float) -> tuple[bytes, bool]:
    """Up to `cap` + 1 bytes of the body, by `deadline` (each read waits at
    most what is left, so a server trickling a byte at a time cannot hold it
    longer); and whether the body ended within both."""
    data = b""
    while len(data) <= cap:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return data, False
        if conn.sock is not None:
            conn.sock.settimeout(remaining)
        try:
            chunk = response.read1(min(READ_SIZE, cap + 1 - len(data)))
        except (http.client.IncompleteRead, TimeoutError):
            return data, False
        if not chunk:
            return data, True
        data += chunk
    return data, False


class ServerError(RuntimeError):
    """A call to the server failed; the message says which call and why."""


@dataclass(slots=True)
class RequestResult:
    """One streamed completion as the client saw it. Times are seconds from
    the moment the request was sent."""

    ok: bool
    started: float                    # time.monotonic() when it was sent
    ttft: float | None = None         # to the first chunk carrying generated output
    latency: float | None = None      # to the end of the stream (or the failure)
    chunks: int = 0                   # chunks that carried generated output
    prompt_tokens: int | None = None  # from the usage chunk, when the server sends one
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    abandoned: bool = False

    @property
    def generated_tokens(self) -> int:
        """Tokens the client received: the usage count, else one per chunk of
        output (a server may pack several tokens into a chunk, so this is a floor)."""
        return self.completion_tokens if self.completion_tokens is not None else self.chunks


def split_base_url(base_url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path prefix) of the server's base URL. A trailing
    /v1 is accepted and dropped: people paste the OpenAI base URL."""
    parts = urlsplit(base_url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{base_url!r} is not an http(s) URL such as http://127.0.0.1:8000")
    if parts.query or parts.fragment:
        raise ValueError(f"{base_url!r}: give the server's base URL without a query")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"{base_url!r} has an invalid port") from None
    prefix = parts.path.rstrip("/")
    if prefix.endswith("/v1"):
        prefix = prefix[: -len("/v1")]
    return parts.scheme, parts.hostname, port, prefix


class Client:
    """Calls to one server. Thread-safe: each call opens its own connection or
    uses the calling worker's own (see `Worker`)."""

    def __init__(self, base_url: str, timeout: float, api_key: str | None = None):
        self.scheme, self.host, self.port, self.prefix = split_base_url(base_url)
        self.timeout = timeout
        self.base_url = f"{self.scheme}://{self._netloc()}{self.prefix}"
        self.headers = {"User-Agent": f"kvwatch-sweep/{__version__}",
                        "Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._inflight: dict[int, socket.socket] = {}
        self._inflight_lock = threading.Lock()
        self._closing = threading.Event()

    def _netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        timeout = self.timeout if timeout is None else timeout
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                               context=ssl.create_default_context())
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    # -- small JSON calls --------------------------------------------------------

    def get_json(self, path: str, timeout: float | None = None) -> tuple[int, object]:
        return self._json_call("GET", path, None, timeout)

    def post_json(self, path: str, body: dict, timeout: float | None = None) -> tuple[int, object]:
        return self._json_call("POST", path, body, timeout)

    def _json_call(self, method: str, path: str, body: dict | None,
                   timeout: float | None) -> tuple[int, object]:
        """(HTTP status, parsed JSON or None). Connection failures raise ServerError."""
        url = f"{self.base_url}{path}"
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        conn = self.connect(timeout)
        try:
            payload = None if body is None else json.dumps(body).encode()
            conn.request(method, self.prefix + path, body=payload, headers=self.headers)
            response = conn.getresponse()
            # The whole answer is due by the deadline, not each byte.
            raw, whole = read_within(response, conn, JSON_BODY_BYTES, deadline)
        except (OSError, http.client.HTTPException) as error:
            raise ServerError(f"{method} {url}: {_describe(error)}") from None
        finally:
            conn.close()
        if not whole and len(raw) <= JSON_BODY_BYTES:
            raise ServerError(f"{method} {url}: no whole answer within {timeout:g} s")
        try:
            parsed = json.loads(raw) if raw and len(raw) <= JSON_BODY_BYTES else None
        except ValueError:
            parsed = None
        return response.status, parsed

    # -- streaming completions ---------------------------------------------------

    def stream_completion(self, worker: "Worker", body: dict) -> RequestResult:
        """Send one streaming completion over the worker's connection and read it
        to the end. Never raises: every failure is in the result."""
        payload = json.dumps(body).encode()
        headers = {**self.headers, "Accept": "text/event-stream"}
        started = time.monotonic()
        deadline = started + self.timeout
        result = RequestResult(ok=False, started=started)
        try:
            conn, response = self._send(worker, payload, headers)
            if response.status != 200:
                detail = _error_detail(read_within(response, conn, ERROR_BODY_BYTES, deadline)[0][:ERROR_BODY_BYTES])
                result.error = f"HTTP {response.status}" + (f": {detail}" if detail else "")
                worker.discard()
                return result
            self._read_stream(response, conn, result, deadline)
            result.latency = time.monotonic() - started
            if result.ok:
                # The chunked body is finished, so the connection can carry
                # the next request; one that still sends is not reused.
                _, ended = read_within(response, conn, AFTER_DONE_BYTES, deadline)
                if not ended:
                    worker.discard()
            else:
                worker.discard()
        except socket.timeout:
            result.error = f"no data for {self.timeout:g} s"
            worker.discard()
        except (OSError, http.client.HTTPException, ValueError) as error:
            result.error = "abandoned" if self._closing.is_set() else _describe(error)
            result.abandoned = self._closing.is_set()
            worker.discard()
        finally:
            self._unregister(worker)
            if result.latency is None:
                result.latency = time.monotonic() - started
        return result

    def _send(self, worker: "Worker", payload: bytes,
              headers: dict[str, str]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send the request and read the status line. A kept-alive connection the
        server closed while idle fails before any answer; that is retried once on
        a new connection instead of counting as a failed request."""
        reused = worker.is_open()
        conn = worker.connection()
        try:
            conn.request("POST", self.prefix + "/v1/completions", body=payload, headers=headers)
            self._register(worker, conn)
            return conn, conn.getresponse()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            if not reused or self._closing.is_set():
                raise
        self._unregister(worker)
        worker.discard()
        conn = worker.connection()
        conn.request("POST", self.prefix + "/v1/completions", body=payload, headers=headers)
        self._register(worker, conn)
        return conn, conn.getresponse()

    def _read_stream(self, response: http.client.HTTPResponse, conn: http.client.HTTPConnection,
                     result: RequestResult, deadline: float) -> None:
        pending = b""
        data_lines: list[bytes] = []
        done = False
        while not done:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                result.error = f"not finished within {self.timeout:g} s"
                return
            if conn.sock is not None:
                conn.sock.settimeout(remaining)
            try:
                chunk = response.read1(READ_SIZE)
            except http.client.IncompleteRead:
                chunk = b""  # the connection closed mid-body: judged below like any early end
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if len(pending) + sum(map(len, data_lines)) > MAX_EVENT_BYTES:
                result.error = f"an event of more than {MAX_EVENT_BYTES:,} bytes"
                return
            for line in lines:
                line = line.rstrip(b"\r")
                if line:
                    if line.startswith(b"data:"):
                        data_lines.append(line[5:].lstrip(b" "))
                        if sum(map(len, data_lines)) > MAX_EVENT_BYTES:
                            result.error = f"an event of more than {MAX_EVENT_BYTES:,} bytes"
                            return
                    continue
                # A blank line ends an event.
                if data_lines:
                    done = self._event(b"\n".join(data_lines), result)
                    data_lines = []
                    if done or result.error:
                        break
            if result.error:
                return
        if data_lines and not done and not result.error:
            done = self._event(b"\n".join(data_lines), result)
        if result.error:
            return
        if done or result.finish_reason is not None:
            result.ok = True
        else:
            result.error = "the stream ended before a finish_reason or [DONE]"

    def _event(self, data: bytes, result: RequestResult) -> bool:
        """Apply one server-sent event; True at [DONE]."""
        if data.strip() == b"[DONE]":
            return True
        try:
            event = json.loads(data)
        except ValueError:
            result.error = f"a stream event is not JSON: {data[:120]!r}"
            return False
        if not isinstance(event, dict):
            return False
        if event.get("error") or event.get("object") == "error":
            error = event.get("error", event)
            message = error.get("message") if isinstance(error, dict) else error
            result.error = f"error in the stream: {str(message)[:300]}"
            return False
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            # A choice carries generated tokens even when their text is still empty
            # (a special token, or bytes that do not yet form a character): the
            # engine counts that token as the first, and so does the client.
            delta = choice.get("delta")
            if "text" in choice or (isinstance(delta, dict) and "content" in delta):
                if result.ttft is None:
                    result.ttft = time.monotonic() - result.started
                result.chunks += 1
            if choice.get("finish_reason"):
                result.finish_reason = str(choice["finish_reason"])
        usage = event.get("usage")
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int):
                result.prompt_tokens = prompt
            if isinstance(completion, int):
                result.completion_tokens = completion
        return False

    # -- abandoning --------------------------------------------------------------

    def _register(self, worker: "Worker", conn: http.client.HTTPConnection) -> None:
        with self._inflight_lock:
            if conn.sock is not None:
                self._inflight[id(worker)] = conn.sock
            closing = self._closing.is_set()
        if closing:
            _shutdown(conn.sock)

    def _unregister(self, worker: "Worker") -> None:
        with self._inflight_lock:
            self._inflight.pop(id(worker), None)

    def abandon_all(self) -> int:
        """Shut down the socket of every request in flight (the server sees the
        client go away and aborts them); requests sent after this are abandoned
        as soon as they register. Returns how many were cut."""
        self._closing.set()
        with self._inflight_lock:
            sockets = list(self._inflight.values())
        for sock in sockets:
            _shutdown(sock)
        return len(sockets)


class Worker:
    """One load worker's keep-alive connection."""

    def __init__(self, client: Client):
        self.client = client
        self._conn: http.client.HTTPConnection | None = None

    def connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            self._conn = self.client.connect()
        return self._conn

    def is_open(self) -> bool:
        return self._conn is not None and self._conn.sock is not None

    def open(self) -> None:
        """Connect now, so the first request's time excludes the TCP (and TLS)
        handshake and connections are not opened all at once when a cell starts."""
        try:
            self.connection().connect()
        except OSError:
            self.discard()  # the first request connects again and reports the failure

    def discard(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    close = discard


def _shutdown(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed: nothing left to cut


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    if isinstance(error, ConnectionRefusedError):
        return "connection refused (is the server running?)"
    if isinstance(error, socket.gaierror):
        return f"cannot resolve the host ({text})"
    if isinstance(error, (socket.timeout, TimeoutError)):
        return "timed out"
    return f"{type(error).__name__}: {text[:300]}"


def _error_detail(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace").strip()[:300]
    return error_message(body) or json.dumps(body)[:300]


def error_message(body: Any) -> str | None:
    """The message of an OpenAI-style error body (vLLM's `message`, FastAPI's
    `detail`, or `error`, itself maybe an object with a `message`), cut to 300
    characters; None when the body holds none."""
    if isinstance(body, dict):
        message = body.get("message") or body.get("detail") or body.get("error")
        if isinstance(message, dict):
            message = message.get("message")
        if message:
            return str(message)[:300]
    return None
