"""The HTTP surface: /, /metrics, /healthz, /readyz, /api/v1/signals,
/api/v1/diagnosis, /api/v1/series. Every handler reads the monitor's current State; none
touches the engine."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvwatch import __version__
from kvwatch.sidecar import runbooks_page
from kvwatch.sidecar.collector import Renderer, make_registry
from kvwatch.sidecar.renders import (
    GZIP_LEVEL, GZIP_MIN_BYTES, Exposition, RefusedRenders, accepts_gzip_header, json_route, page_route,
)
from kvwatch.sidecar.report import diagnosis_json, replay_text, signals_json
from kvwatch.sidecar.series import series_json
from kvwatch.settings import read_auth_token
from kvwatch.sidecar.statuspage import render_status_page

OPEN_PATHS = ("/healthz", "/readyz")

log = logging.getLogger("kvwatch")


TEXT = b"text/plain; charset=utf-8"


def create_app(monitor, settings=None) -> FastAPI:
    settings = settings or monitor.settings
    refused = RefusedRenders()
    registry = make_registry(monitor)
    registry.register(refused)
    # Rendered once per State (kvwatch's own process metrics are then as
    # fresh as the latest poll), and ahead, in the poll thread, when the
    # previous poll's exposition was scraped: a Prometheus scraping every
    # 15 s of a 1 s poll leaves most polls unscraped, and they are never
    # rendered.
    exposition = Exposition(Renderer(registry), lambda: monitor.state, refused)
    monitor.after_poll.append(exposition.render_ahead)
    app = FastAPI(title="kvwatch", version=__version__, docs_url=None, redoc_url=None, redirect_slashes=False)
    token = TokenFile(settings.auth_token_file) if settings.auth_token_file else None

    # The routes below stay FastAPI's (the route list, 405 for other methods,
    # and any path form the front layer does not take); HotPaths answers GET on
    # the first three itself, from the same functions.
    # Every render runs in the worker threads (sync routes), within the
    # render bound, and gzips there too (kvwatch/sidecar/renders.py).
    @app.get("/", response_class=HTMLResponse)
    def index(request: Request) -> Response:
        return page_route(lambda: render_status_page(monitor.state, settings), refused, encodings(request))

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(exposition.serve(False), media_type=CONTENT_TYPE_LATEST)

    # The probes take HEAD too: HotPaths answers it (and a 405 for other methods).
    @app.get("/healthz")
    def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok\n")

    @app.get("/readyz")
    def readyz() -> PlainTextResponse:
        status, text = readiness(monitor)
        return PlainTextResponse(text, status_code=status)

    # The runbooks every alert and finding links to (kvwatch/sidecar/runbooks_page.py).
    @app.get("/runbooks", response_class=HTMLResponse)
    def runbooks() -> HTMLResponse:
        return HTMLResponse(runbooks_page.page())

    @app.get("/runbooks.md")
    def runbooks_markdown() -> PlainTextResponse:
        return PlainTextResponse(runbooks_page.markdown_text(), media_type="text/markdown; charset=utf-8")

    @app.get("/api/v1/signals")
    def signals(request: Request) -> Response:
        return json_route(lambda: signals_json(monitor.state, settings), "/api/v1/signals", refused,
                          encodings(request))

    @app.get("/api/v1/diagnosis")
    def diagnosis(request: Request) -> Response:
        return json_route(lambda: diagnosis_json(monitor.state, settings), "/api/v1/diagnosis", refused,
                          encodings(request))

    @app.get("/api/v1/series")
    def series(request: Request) -> Response:
        return json_route(lambda: series_json(monitor.state, settings), "/api/v1/series", refused,
                          encodings(request))

    # The other routes (the runbooks), gzipped for clients that accept it; the
    # page and the JSON routes compress themselves, off the event loop, and the
    # hot paths below answer before this layer and compress /metrics themselves.
    app.add_middleware(GZipMiddleware, minimum_size=GZIP_MIN_BYTES, compresslevel=GZIP_LEVEL)
    app.add_middleware(HotPaths, monitor=monitor, exposition=exposition, token=token, paths=route_paths(app))
    return app


def route_paths(app: FastAPI) -> frozenset[str]:
    return frozenset(path for route in app.routes if "{" not in (path := getattr(route, "path", "{")))


def slash_redirect(path: str, query: bytes) -> bytes:
    """Where `/route/` is sent: `../route`, relative, so never to the host
    a request names (Starlette's own redirect was absolute, built from the
    Host header), and right behind a proxy's path prefix too."""
    target = "../" + path[:-1].rsplit("/", 1)[1]
    return target.encode("latin-1") + (b"?" + query if query else b"")


def encodings(request: Request) -> str:
    return request.headers.get("accept-encoding", "")


class HotPaths:
    """A pure-ASGI layer in front of FastAPI's routing: bearer auth for every
    path but /healthz and /readyz, and GET /metrics, /healthz and /readyz
    answered here. Those are what Prometheus and the kubelet call all the
    time; answered here they skip routing, dependency solving and Response
    objects, and /healthz and /readyz skip the thread pool (both are a
    few attribute reads). /metrics is served here only when this State's
    bytes are made; a render waits in a worker thread, never on the event
    loop that answers the probes. Under 50 concurrent scrapers that takes /healthz's
    p99 from 17-22 to 8 ms and /metrics' from 15-18 to 10-12 ms at one engine
    (docs/performance.md). Anything else, other methods on these paths
    included, goes on to FastAPI as before."""

    def __init__(self, app, monitor, exposition, token: "TokenFile | None", paths: frozenset[str] = frozenset()):
        self.app, self.monitor, self.exposition = app, monitor, exposition
        self.token, self.paths = token, paths
        self._render_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.token is not None and path not in OPEN_PATHS and not self.authorized(scope):
            await answer(send, 401, b"unauthorized\n", TEXT, [(b"www-authenticate", b"Bearer")])
            return
        if path in OPEN_PATHS and scope["method"] != "GET":
            # Probes and uptime checkers that ask with HEAD (they got 405).
            if scope["method"] != "HEAD":
                await answer(send, 405, b'{"detail":"Method Not Allowed"}', b"application/json",
                             [(b"allow", b"GET, HEAD")])
            elif path == "/healthz":
                await answer(send, 200, b"ok\n", TEXT, head=True)
            else:
                status, text = readiness(self.monitor)
                await answer(send, status, text.encode(), TEXT, head=True)
            return
        if path.endswith("/") and path[:-1] in self.paths and scope["method"] in ("GET", "HEAD"):
            await answer(send, 307, b"", TEXT, [(b"location", slash_redirect(path, scope.get("query_string", b"")))])
            return
        if scope["method"] == "GET":
            if path == "/metrics":
                gzipped = accepts_gzip(scope)
                headers = [(b"vary", b"Accept-Encoding")]
                if gzipped:
                    headers.append((b"content-encoding", b"gzip"))
                body = self.exposition.cached(gzipped) or await self.render(gzipped)
                await answer(send, 200, body, CONTENT_TYPE_LATEST.encode(), headers)
                return
            if path == "/healthz":
                await answer(send, 200, b"ok\n", TEXT)
                return
            if path == "/readyz":
                status, text = readiness(self.monitor)
                await answer(send, status, text.encode(), TEXT)
                return
        await self.app(scope, receive, send)

    async def render(self, gzipped: bool) -> bytes:
        """This State's exposition, rendered in a worker thread by the first
        scraper; the others wait on the event loop and take its bytes (50
        scrapers each hopping to a thread to queue on the render's lock took
        /metrics' p99 at 8 engines from 11.5 to 26 ms). The lock is made per
        event loop: an asyncio lock belongs to the loop that first waits on it."""
        loop = asyncio.get_running_loop()
        if self._render_lock is None or self._render_lock[0] is not loop:
            self._render_lock = (loop, asyncio.Lock())
        async with self._render_lock[1]:
            return self.exposition.cached(gzipped) or await anyio.to_thread.run_sync(self.exposition.serve, gzipped)

    def authorized(self, scope) -> bool:
        # The first Authorization header, as the bytes that came, against the
        # token's UTF-8 bytes, in constant time (decoding the header as
        # latin-1 first made a UTF-8 token never match).
        expected = self.token.expected() if self.token is not None else None
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return expected is not None and hmac.compare_digest(given, expected)


class TokenFile:
    """The scrape token's file, read again when it changes (a rotated
    Kubernetes secret is swapped in under the same path), as the engine's
    token is read on every poll. A file that no longer holds a valid token
    lets nobody in until it does, and says so once in the log."""

    def __init__(self, path: str):
        self.path = path
        self.stamp: tuple | None = None
        self.value: bytes | None = None
        self.expected()

    def expected(self) -> bytes | None:
        try:
            info = os.stat(self.path)
            stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
        except OSError:
            stamp = None
        if stamp != self.stamp or stamp is None:
            self.stamp = stamp
            try:
                self.value = f"Bearer {read_auth_token(self.path)}".encode()
            except ValueError as exc:
                if self.value is not None or stamp is not None:
                    log.warning("auth_token_file: %s; every request but /healthz and /readyz is refused", exc)
                self.value = None
        return self.value


def readiness(monitor) -> tuple[int, str]:
    """/readyz's status and text, for both ways it is answered."""
    ready, why = monitor.ready()
    replay = getattr(getattr(monitor, "state", None), "replay", None)
    if replay:  # a replay never is the engine's live state: say so
        return (200, f"ready: {replay_text(replay)}\n") if ready else (503, f"not ready: {why} ({replay_text(replay)})\n")
    return (200, "ready\n") if ready else (503, f"not ready: {why}\n")


async def answer(send, status: int, body: bytes, content_type: bytes, headers=(), head: bool = False) -> None:
    """`head`: HEAD's answer, the GET's status and headers without the body."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", content_type), *headers]})
    await send({"type": "http.response.body", "body": b"" if head else body})


def accepts_gzip(scope) -> bool:
    """Whether Accept-Encoding takes gzip with a q above 0 (named, or by *
    when gzip is not named)."""
    values = [value.decode("latin-1") for name, value in scope["headers"] if name == b"accept-encoding"]
    return accepts_gzip_header(",".join(values))


# Bounds on kvwatch's own HTTP connections, below the auth check: the image
# listens on 0.0.0.0. Without them 1,100 half-sent requests made /healthz
# unreachable (and the polls ran out of file descriptors), a 96 MB header
# held the event loop for seconds, past the liveness probe's timeout, and
# 300 requests declaring a 100 MB body, then trickling it a byte every 3 s,
# held the connection cap for good (every probe answered 503).
# A request line and headers within 16 KiB: Prometheus and the kubelet send
# a few hundred bytes (nginx's default limit is 8 KiB per line, 32 KiB total).
MAX_HEADER_BYTES = 16 * 1024
# kvwatch's endpoints read no request body: a declared or sent body over this
# is refused with 413 and the connection closed.
MAX_BODY_BYTES = 64 * 1024
# From the connection's (or the request's) first byte to the end of the
# request, its body included.
HEADER_TIMEOUT_SECONDS = 10.0
# Open connections at most; beyond it the oldest connection still sending
# its request (headers or body) is closed to make room, so a flood of
# half-sent requests cannot lock the probes out (a fresh probe is never the
# oldest, and sends its whole request at once).
MAX_CONNECTIONS = 256


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header size cap, a body size cap,
    a deadline on the whole request and a connection cap (uvicorn bounds
    none of these for httptools, and its limit_concurrency answers 503, the
    probes included)."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.header_bytes = 0
        self.header_tail = b""
        self.body_bytes = 0
        # in_headers: the next bytes are a request's line and headers;
        # receiving: a request has begun and has not been read to its end.
        self.in_headers = True
        self.receiving = False
        self.refused = False
        self.header_timer: asyncio.TimerHandle | None = None
        self.opened_at = self.loop.time()
        self._start_header_timer()
        if len(self.connections) > MAX_CONNECTIONS:
            self._make_room()

    def connection_lost(self, exc) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused or self.transport.is_closing():
            return
        if self.in_headers:
            # Up to the blank line that ends the headers (a body in the same
            # read is the body's, counted against MAX_BODY_BYTES).
            seen = self.header_tail + data
            end = seen.find(b"\r\n\r\n")
            self.header_bytes += len(data) if end < 0 else max(0, end + 4 - len(self.header_tail))
            self.header_tail = seen[-3:]
            if self.header_bytes > MAX_HEADER_BYTES:
                self._refuse(b"431 Request Header Fields Too Large")
                return
        if self.in_headers or self.receiving:
            self._start_header_timer()
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.receiving = True
        self.body_bytes = 0

    def on_headers_complete(self) -> None:
        self.in_headers = False
        declared = next((value for name, value in self.headers if name == b"content-length"), b"0")
        try:
            too_large = int(declared) > MAX_BODY_BYTES
        except ValueError:
            too_large = False  # httptools refuses a malformed length itself
        if too_large:
            self._refuse(b"413 Content Too Large")
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self.refused:
            return
        self.body_bytes += len(body)
        if self.body_bytes > MAX_BODY_BYTES:  # chunked, or more than declared
            self._refuse(b"413 Content Too Large")
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self.refused:
            return
        super().on_message_complete()
        # What comes next on this connection is the next request's headers;
        # until it comes, uvicorn's keep-alive timeout bounds the idle time.
        self.receiving = False
        self._stop_header_timer()
        self.in_headers = True
        self.header_bytes = 0
        self.header_tail = b""

    def _start_header_timer(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(HEADER_TIMEOUT_SECONDS, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_too_slow(self) -> None:
        self.header_timer = None
        if (self.in_headers or self.receiving) and not self.transport.is_closing():
            self._refuse(b"408 Request Timeout")

    def _refuse(self, status: bytes) -> None:
        """Close the connection, with `status` unless a response to this
        request has already begun (it would be cut into)."""
        self._stop_header_timer()
        self.in_headers = self.receiving = False
        self.refused = True
        if not self.transport.is_closing():
            if self.cycle is None or not self.cycle.response_started or self.cycle.response_complete:
                self.transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()
        if self.cycle is not None:
            # An app still waiting on the body sees a disconnect.
            self.cycle.disconnected = True
            self.cycle.message_event.set()

    def _make_room(self) -> None:
        waiting = [c for c in self.connections if c is not self and isinstance(c, BoundedHttpProtocol)
                   and (c.in_headers or c.receiving) and not c.transport.is_closing()]
        if waiting:
            oldest = min(waiting, key=lambda c: c.opened_at)
            oldest._stop_header_timer()
            oldest.transport.abort()
        else:  # every other connection is busy with a whole request: this one waits its turn elsewhere
            self._refuse(b"503 Service Unavailable")
