"""Renders bounded in bytes, built off the probes' thread.

The probes (/healthz, /readyz) are answered on uvicorn's event loop from a
few attribute reads; every render (the exposition, the JSON routes, the
status page, and their gzip) runs in a worker thread, so a render of any
size never holds a probe. A render stops once it passes RENDER_MAX_BYTES:
/metrics then serves one sentence and kvwatch_renders_refused_total, the
JSON routes and the page answer 503 with the sentence; nothing past the
bound is built.
"""

from __future__ import annotations

import gzip
import html
import json
import logging
import threading
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from starlette.responses import Response

from kvwatch.present import Throttle
from kvwatch.signals import HEALTH_BY_NAME

log = logging.getLogger("kvwatch")

# 16 MiB: 8 engines render 181 KB of /metrics and 150 KB of page, so
# max_series' 100 pairs about 2.3 MB; past this is hostile input (a 1.9 MB
# label value per event made every render 608 MB), not a fleet.
RENDER_MAX_BYTES = 16 * 1024 * 1024
GZIP_MIN_BYTES = 2048
LOG_EVERY_SECONDS = 60.0
# Compress once per State, level 1: at 8 engines 181 KB become 13 KB in
# 0.5 ms of CPU; level 6 takes 3x that for 14 % fewer bytes.
GZIP_LEVEL = 1
ROUTES = ("/", "/metrics", "/api/v1/signals", "/api/v1/diagnosis", "/api/v1/series")


class RenderTooLarge(Exception):
    """A render that passed its bound; its message is the sentence served."""

    def __init__(self, what: str, limit: int):
        super().__init__(f"{what} passed the render bound of {limit / 2**20:g} MiB and was not built: "
                         "some label value or list is far larger than any engine's (see "
                         "kvwatch_renders_refused_total and the log)")


class RefusedRenders(Collector):
    """kvwatch_renders_refused_total{route}, every route present from the start."""

    def __init__(self):
        self.counts = dict.fromkeys(ROUTES, 0)
        self.logged = Throttle(LOG_EVERY_SECONDS)
        self.lock = threading.Lock()

    def count(self, route: str, exc: RenderTooLarge) -> None:
        """Count the refusal; log it once a minute per route at most."""
        with self.lock:
            self.counts[route] = self.counts.get(route, 0) + 1
            if not self.logged.ready(route):
                return
        log.warning("%s", exc)

    def family(self) -> CounterMetricFamily:
        declared = HEALTH_BY_NAME["kvwatch_renders_refused"]
        family = CounterMetricFamily(declared.name, declared.help, labels=list(declared.labels))
        with self.lock:
            for route, count in sorted(self.counts.items()):
                family.add_metric([route], count)
        return family

    def collect(self):
        yield self.family()


def bounded_json(value: Any, what: str, limit: int | None = None) -> str:
    """`value` as JSON (ASCII, so characters are bytes), refused with
    RenderTooLarge as soon as it passes `limit` (RENDER_MAX_BYTES). The
    top three levels are walked here and what is below them encoded in C,
    so a refusal builds at most one such part past the bound: the page's
    state at 8 engines (200 KB) in 4.7 ms of CPU against json.dumps' 3.4
    (walked whole in Python, 13.8)."""
    limit = RENDER_MAX_BYTES if limit is None else limit
    parts: list[str] = []
    size = 0
    for chunk in _pieces(value, WALKED_LEVELS):
        size += len(chunk)
        if size > limit:
            raise RenderTooLarge(what, limit)
        parts.append(chunk)
    return "".join(parts)


# Levels of containers walked by bounded_json; below them, one C encode each.
WALKED_LEVELS = 3
_dumps = json.JSONEncoder(ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode


def _pieces(value: Any, levels: int):
    if levels == 0 or not value or not isinstance(value, (dict, list, tuple)):
        yield _dumps(value)
    elif isinstance(value, dict):
        separator = "{"
        for key, item in value.items():
            # The key as json writes it (a number or None becomes a string).
            yield separator + _dumps({key: 0})[1:-2]
            yield from _pieces(item, levels - 1)
            separator = ","
        yield "}"
    else:
        separator = "["
        for item in value:
            yield separator
            yield from _pieces(item, levels - 1)
            separator = ","
        yield "]"


def accepts_gzip_header(value: str) -> bool:
    """Whether an Accept-Encoding value takes gzip with a q above 0."""
    weights = {}
    for item in value.lower().split(","):
        coding, *params = (part.strip() for part in item.split(";"))
        q = next((p[2:] for p in params if p.startswith("q=")), "1")
        try:
            weights[coding] = float(q)
        except ValueError:
            weights[coding] = 0.0
    return weights.get("gzip", weights.get("*", 0.0)) > 0


def body_response(body: bytes, media_type: str, accept_encoding: str, status: int = 200) -> Response:
    """The body as a response, gzipped here (in the worker thread) for a
    client that accepts it: the GZip middleware would compress on the event
    loop, in front of the probes (it leaves an encoded body alone)."""
    headers = {"vary": "Accept-Encoding"}
    if len(body) >= GZIP_MIN_BYTES and accepts_gzip_header(accept_encoding):
        body = gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)
        headers["content-encoding"] = "gzip"
    return Response(body, status_code=status, media_type=media_type, headers=headers)


def json_route(build, route: str, refused: RefusedRenders, accept_encoding: str) -> Response:
    """A JSON route's answer: build() rendered within the bound, or 503
    with the sentence (counted)."""
    try:
        body = bounded_json(build(), f"{route}'s answer").encode("ascii")
    except RenderTooLarge as exc:
        refused.count(route, exc)
        return body_response(json.dumps({"error": str(exc)}).encode(), "application/json", "", 503)
    return body_response(body, "application/json", accept_encoding)


def page_route(build, refused: RefusedRenders, accept_encoding: str, route: str = "/") -> Response:
    """The status page's answer: build() within the bound, or 503 with the sentence."""
    try:
        body = build().encode("utf-8")
        if len(body) > RENDER_MAX_BYTES:
            raise RenderTooLarge(f"{route}'s page", RENDER_MAX_BYTES)
    except RenderTooLarge as exc:
        refused.count(route, exc)
        text = f"<!doctype html><title>kvwatch</title><p>{html.escape(str(exc), quote=False)}.</p>"
        return body_response(text.encode(), "text/html; charset=utf-8", "", 503)
    return body_response(body, "text/html; charset=utf-8", accept_encoding)


def refused_exposition(exc: RenderTooLarge, refused: RefusedRenders) -> bytes:
    """What /metrics serves for a state whose exposition passed the bound:
    the sentence as a comment, and the refusals counter."""
    family = refused.family()
    lines = [f"# kvwatch: {exc}.", f"# HELP {family.name}_total {family.documentation}",
             f"# TYPE {family.name}_total counter"]
    lines += [f'{family.name}_total{{route="{s.labels["route"]}"}} {s.value:g}' for s in family.samples]
    return ("\n".join(lines) + "\n").encode()


class Exposition:
    """The exposition rendered once per State and served to every scraper
    until the next (50 scrapers cost one render), its gzip made on the
    first scrape that asks, also once per State. `cached` is what the event
    loop may serve itself: bytes already made, read without the lock."""

    def __init__(self, renderer, current_state, refused: RefusedRenders):
        self.renderer, self.current_state, self.refused = renderer, current_state, refused
        # (state, body, gzip or None), replaced whole: one read is consistent.
        self.entry: tuple = (None, b"", None)
        self.lock = threading.Lock()
        self.served = self.served_gzip = False

    def cached(self, gzipped: bool) -> bytes | None:
        state, body, packed = self.entry
        if state is not self.current_state():
            return None
        found = packed if gzipped else body
        if found is not None:
            self.mark_served(gzipped)
        return found

    def get(self, gzipped: bool = False, state=None) -> bytes:
        state = state or self.current_state()
        with self.lock:
            current, body, packed = self.entry
            if current is not state:
                body, packed = self._render(), None
                self.entry = (state, body, None)
                self.served = self.served_gzip = False
            if gzipped and packed is None:
                packed = gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)
                self.entry = (state, body, packed)
            return packed if gzipped else body

    def serve(self, gzipped: bool) -> bytes:
        body = self.get(gzipped)
        self.mark_served(gzipped)
        return body

    def mark_served(self, gzipped: bool) -> None:
        self.served = True
        self.served_gzip |= gzipped

    def render_ahead(self, state) -> None:
        """Render `state` now (the poll thread, right after a poll) when the
        previous poll's exposition was scraped: this one most likely will
        be, and its first scrapers need not wait for the render."""
        if self.served:
            self.get(self.served_gzip, state)

    def _render(self) -> bytes:
        try:
            return self.renderer.render()
        except RenderTooLarge as exc:
            self.refused.count("/metrics", exc)
            return refused_exposition(exc, self.refused)
