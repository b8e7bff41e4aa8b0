"""The HTTP surface: /, /metrics, /healthz, /readyz, /api/v1/signals,
/api/v1/diagnosis. Every handler reads the monitor's current State; none
touches the engine."""

from __future__ import annotations

import hmac
import threading
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvwatch import __version__
from kvwatch.collector import make_registry
from kvwatch.report import diagnosis_json, signals_json
from kvwatch.statuspage import render_status_page

OPEN_PATHS = ("/healthz", "/readyz")


def create_app(monitor, settings=None) -> FastAPI:
    settings = settings or monitor.settings
    registry = make_registry(monitor)
    app = FastAPI(title="kvwatch", version=__version__, docs_url=None, redoc_url=None)
    token = Path(settings.auth_token_file).read_text().strip() if settings.auth_token_file else None

    if token:
        @app.middleware("http")
        async def require_token(request: Request, call_next):
            if request.url.path not in OPEN_PATHS:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                    return PlainTextResponse("unauthorized\n", status_code=401,
                                             headers={"WWW-Authenticate": "Bearer"})
            return await call_next(request)

    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        return HTMLResponse(render_status_page(monitor.state, settings))

    # The exposition changes once per poll, not per scrape: render it once per
    # State and serve those bytes to every scraper until the next poll, so 50
    # scrapers cost one render, not 50 (kvwatch's own process metrics are then
    # as fresh as the latest poll).
    rendered = {"state": None, "body": b""}
    render_lock = threading.Lock()

    # async: the render is once per poll and the rest is a dict lookup, so the
    # event loop answers at once instead of a thread-pool round trip per
    # scrape (p99 under 50 concurrent scrapers: 88 ms -> 18 ms, make bench).
    @app.get("/metrics")
    async def metrics() -> Response:
        state = monitor.state
        with render_lock:
            if rendered["state"] is not state:
                rendered["body"] = generate_latest(registry)
                rendered["state"] = state
            body = rendered["body"]
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok\n")

    @app.get("/readyz")
    def readyz() -> PlainTextResponse:
        ready, why = monitor.ready()
        return PlainTextResponse(("ready" if ready else f"not ready: {why}") + "\n", status_code=200 if ready else 503)

    @app.get("/api/v1/signals")
    def signals() -> JSONResponse:
        return JSONResponse(signals_json(monitor.state, settings))

    @app.get("/api/v1/diagnosis")
    def diagnosis() -> JSONResponse:
        return JSONResponse(diagnosis_json(monitor.state, settings))

    return app
