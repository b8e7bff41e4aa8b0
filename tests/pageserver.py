"""Loopback HTTP servers for tests, on 127.0.0.1 only and bounded in time.

- `LoopbackServer`: answers each request with what its `respond(request)`
  returns; a test subclasses it to play a webhook, a proxy, or a service
  with its own metrics.
- `PageServer`: answers a test scripts in order: body, status, headers,
  delays, trickling, cut-off bodies. Used to play an engine.
- `serving(app)`: kvwatch's own app (any ASGI app) served by uvicorn in a
  thread, as `kvwatch serve` runs it.

Every server listens on 127.0.0.1 (port 0 unless a test fixes one), gives a
stalled client at most `request_timeout_s` per socket operation, and stops
within seconds when its `with` block ends.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

# A client that stops sending or reading holds a handler thread no longer than this.
REQUEST_TIMEOUT_S = 30.0
# serve_forever's poll: shutdown() waits up to one, several servers a test.
SHUTDOWN_POLL_S = 0.05
STOP_TIMEOUT_S = 5.0


@dataclass
class Answer:
    body: bytes | str = b""
    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
    delay: float = 0.0  # before the status line
    trickle: float = 0.0  # seconds between bytes
    declared_length: int | None = None  # a Content-Length that lies (cut-off body)
    close_after: int | None = None  # bytes sent before the connection drops


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""
    received_at: float = 0.0  # time.time() when the request line had been read


class LoopbackServer:
    """Serves GET and POST on 127.0.0.1: each request is answered with
    `respond(request)`, then `answered(request, answer)` is called."""

    def __init__(self, port: int = 0, request_timeout_s: float = REQUEST_TIMEOUT_S, name: str = "loopback"):
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout_s

            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802 (http.server's name)
                self._serve("GET")

            def do_POST(self):  # noqa: N802 (http.server's name)
                self._serve("POST")

            def _serve(self, method: str) -> None:
                received_at = time.time()
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                request = Request(method, self.path, dict(self.headers), body, received_at)
                answer = server.respond(request)
                if _send(self, answer):
                    server.answered(request, answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                                       name=name, daemon=True)

    def respond(self, request: Request) -> Answer:
        return Answer(status=404)

    def answered(self, request: Request, answer: Answer) -> None:
        """Called once `answer` has been sent whole."""

    @property
    def base_url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.thread.is_alive():  # shutdown() waits forever for a loop that never ran
            self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(STOP_TIMEOUT_S)


def _send(handler: BaseHTTPRequestHandler, answer: Answer) -> bool:
    """Writes `answer` as scripted; False when the client went away first."""
    body = answer.body.encode() if isinstance(answer.body, str) else answer.body
    if answer.delay:
        time.sleep(answer.delay)
    try:
        handler.send_response(answer.status)
        for key, value in answer.headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(answer.declared_length or len(body)))
        handler.end_headers()
        to_send = body if answer.close_after is None else body[: answer.close_after]
        if answer.trickle:
            for i in range(len(to_send)):
                handler.wfile.write(to_send[i:i + 1])
                handler.wfile.flush()
                time.sleep(answer.trickle)
        else:
            handler.wfile.write(to_send)
        if answer.close_after is not None or answer.declared_length:
            handler.close_connection = True
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        return False
    return True


class PageServer(LoopbackServer):
    """Serves `answers` in order (the last one repeats) on every path, or only
    on `path` (404 elsewhere); keeps each request's path and headers."""

    def __init__(self, answers: list[Answer] | None = None, path: str | None = None, port: int = 0):
        self.answers: list[Answer] = list(answers or [])
        self.requests: list[dict] = []
        self.path = path
        super().__init__(port=port, name="page-server")

    def respond(self, request: Request) -> Answer:
        self.requests.append({"path": request.path, "headers": request.headers})
        if self.path is not None and request.path != self.path:
            return Answer(status=404)
        return self.next_answer()

    def next_answer(self) -> Answer:
        if len(self.answers) > 1:
            return self.answers.pop(0)
        return self.answers[0] if self.answers else Answer(status=404)

    @property
    def url(self) -> str:
        return self.base_url + "/metrics"

    def __enter__(self) -> "PageServer":
        return super().__enter__()


@dataclass
class Served:
    url: str  # http://127.0.0.1:<port>
    port: int
    server: Any  # the uvicorn.Server


@contextlib.contextmanager
def serving(app, port: int = 0, start_timeout_s: float = 30.0, **options) -> Iterator[Served]:
    """`app` served by uvicorn in a thread on 127.0.0.1 (port 0: the OS
    chooses); `options` are uvicorn.Config's (kvwatch's own:
    kvwatch.commands.serve.server_options). Yields once it listens; stopped
    within seconds after."""
    import uvicorn  # kvwatch's dependency; the HTTP servers above need only the standard library

    config = {"log_level": "warning", **options, "host": "127.0.0.1", "port": port}
    server = uvicorn.Server(uvicorn.Config(app, **config))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not (server.started and server.servers):
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start within {start_timeout_s:g} s")
            time.sleep(0.02)
        bound = server.servers[0].sockets[0].getsockname()[1]
        yield Served(f"http://127.0.0.1:{bound}", bound, server)
    finally:
        server.should_exit = True
        thread.join(2 * STOP_TIMEOUT_S)
