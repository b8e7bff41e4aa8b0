"""A router's page read as a second source beside the engines
(`router_target`): one RouterReading per poll kept over the window, and per
model the window's attribution (kvwatch/routing/attribution.py) against the
engines' prefix-cache counters of the same window. Its failure is its own:
a router that does not answer is reported in its status, never the engine's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvwatch.diagnose.vocabulary import Finding
from kvwatch.present import origin, public_url
from kvwatch.routing import RouterReading, RoutingWindow, attribute, judge_routing, read_router_page
from kvwatch.routing.tenants import window_rows
from kvwatch.scrape import SECOND_SOURCE_MAX_BYTES, Fetcher
from kvwatch.window import Window

# The most readings kept (one per poll): a window of an hour at a 1 s poll.
MAX_READINGS = 3600
MAX_MODELS = 100


class RouterSource:
    def __init__(self, settings: Any, window_seconds: float, clock: Callable[[], float] = time.time) -> None:
        self.target: str = settings.router_target
        self.model: str | None = settings.router_model
        self.refresh: float | None = settings.router_refresh_interval
        self.bound: float | None = settings.router_staleness_bound
        # Half the poll interval at most, as the other second sources: the engine's fetch comes first.
        timeout = min(settings.fetch_timeout, max(0.2, 0.5 * settings.poll_interval))
        same_origin = origin(self.target) == origin(settings.target or "")
        self.fetcher = Fetcher(self.target, timeout, min(settings.max_body_bytes, SECOND_SOURCE_MAX_BYTES),
                               settings.bearer_token_file if same_origin else None,
                               settings.ca_bundle, settings.tls_verify)
        self.window_seconds = window_seconds
        self.clock = clock
        self.top_k: int = settings.tenant_top_k
        self.readings: deque[tuple[float, RouterReading]] = deque(maxlen=MAX_READINGS)
        self.last: dict[str, Any] | None = None

    def poll(self, engines: Window, at: float | None = None, text: str | None = None) -> list[Finding]:
        """Fetch (or take `text`), keep the reading, and judge each model's
        window; the report is kept in `last`."""
        now = self.clock() if at is None else at
        if text is None:
            result = self.fetcher.fetch()
            if not result.ok:
                self.last = {"target": public_url(self.target), "up": False, "reason": result.reason,
                             "detail": result.detail, "time": now, "windows": []}
                return []
            text = result.text or ""
        reading = read_router_page(text)
        if reading.dialect is None and reading.stale_endpoints is None:
            self.last = {"target": public_url(self.target), "up": False, "reason": "no_router_metrics",
                         "detail": "no router's prefix prediction on the page (llm-d, Dynamo or SGLang names)",
                         "time": now, "windows": []}
            return []
        self.readings.append((now, reading))
        while self.readings and self.readings[0][0] < now - self.window_seconds:
            self.readings.popleft()
        windows = self.windows(engines)
        findings = [f for window in windows for f in judge_routing(window)]
        self.last = {"target": public_url(self.target), "up": True, "reason": None, "detail": "", "time": now,
                     "router": reading.dialect, "windows": windows, "tenants": self.tenants()}
        return findings

    def tenants(self) -> dict[str, list[dict[str, Any]]]:
        """kind -> the window's top K tenants and "other" (llm-d's fairness_id, from the router's page)."""
        start, end = self.readings[0][1], self.readings[-1][1]
        rows = window_rows("fairness_id", start.tenants, end.tenants, self.top_k)
        return {"fairness_id": [row.as_dict() for row in rows]} if rows else {}

    def windows(self, engines: Window) -> list[RoutingWindow]:
        """Each model's attribution over the readings' span and the engines' window."""
        return model_windows(self.readings[0][1], self.readings[-1][1], [engines], self.model, self.refresh,
                             self.bound)


def model_windows(start: RouterReading, end: RouterReading, engines: list[Window], model: str | None = None,
                  refresh: float | None = None, bound: float | None = None) -> list[RoutingWindow]:
    """Each model's attribution between two readings of a router's page,
    beside the prefix-cache hits and queries its engines counted over their
    windows (a sidecar's one window, or central mode's every replica's):
    `model` alone where the router is known to route one, else every model
    the engines serve now. The sidecar's router source and central mode
    both judge these windows."""
    latest = [(window, window.latest.engines) for window in engines if window.latest is not None]
    models = [model] if model else sorted({name for _window, keys in latest for name, _engine in keys})
    out = []
    for name in models[:MAX_MODELS]:
        hits = queries = 0.0
        known = False
        for window, keys in latest:
            for key in keys:
                if key[0] != name:
                    continue
                counters = window.increase(key).counters
                if "prefix_queries" in counters:
                    known = True
                    hits += counters.get("prefix_hits", 0.0)
                    queries += counters["prefix_queries"]
        out.append(attribute(name, start, end, hits if known else None, queries if known else None, refresh, bound))
    return out
