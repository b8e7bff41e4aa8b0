"""The server side of `kvwatch sweep`: a background thread polling /metrics
while a cell runs, and what one cell adds up to.

Each cell gets a fresh `Window` of snapshots, opened by a poll at the cell's
start and closed by one after its last request; counters and histograms are
summed over the window's reset-safe steps (kvwatch/window/steps.py), gauges are the
maxima seen by the polls in between. Engines are those serving the sweep's
model (all engines when none carries its name); data-parallel engines are
added up: counters and histograms summed, running and waiting summed per poll,
KV usage the highest of any engine.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvwatch.engines.vllm import VllmAdapter
from kvwatch.scrape import Fetcher
from kvwatch.snapshot import Histogram, Snapshot
from kvwatch.window import EngineKey, Increase, Window

MAX_BODY_BYTES = 32 * 2**20


@dataclass
class CellMetrics:
    """What the server's /metrics say about one cell."""

    polls: int = 0
    poll_errors: int = 0
    last_poll_error: str | None = None
    peak_kv_usage: float | None = None
    peak_running: float | None = None
    peak_waiting: float | None = None
    seconds: float = 0.0
    restarts: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)

    def counter(self, key: str) -> float | None:
        return self.counters.get(key)

    def finished(self) -> float | None:
        values = [v for k, v in self.counters.items() if k.startswith("finished/")]
        return sum(values) if values else None


def select_engines(snapshot: Snapshot, model: str) -> list[EngineKey]:
    """The engines serving `model`, or every engine when none is labelled with it
    (a server may label its series with the model path instead)."""
    named = [key for key in snapshot.engines if key[0] == model]
    return sorted(named or snapshot.engines)


class MetricsPoller:
    """Polls one /metrics URL every `interval` seconds in a daemon thread."""

    def __init__(self, url: str, model: str, interval: float, timeout: float):
        self.url = url
        self.model = model
        self.interval = interval
        self.fetcher = Fetcher(url, timeout=timeout, max_body_bytes=MAX_BODY_BYTES)
        self.adapter = VllmAdapter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._window: Window | None = None
        self._cell: CellMetrics | None = None
        self.latest: Snapshot | None = None

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvwatch-sweep-poller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.fetcher.timeout + 1.0)

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.poll()
            next_at += self.interval
            delay = next_at - time.monotonic()
            if delay < 0:  # a slow fetch: start the next period from now, never burst
                next_at, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    # -- polls -------------------------------------------------------------------

    def poll(self) -> tuple[Snapshot | None, str | None]:
        """One fetch now: (snapshot, None) or (None, why it failed). Feeds the open cell."""
        with self._lock:
            result = self.fetcher.fetch()
            if not result.ok:
                error = f"{result.reason}: {result.detail}"
                if self._cell is not None:
                    self._cell.poll_errors += 1
                    self._cell.last_poll_error = error
                return None, error
            snapshot = self.adapter.adapt(result.page, at=time.time())
            self.latest = snapshot
            if self._cell is not None and self._window is not None:
                self._record(snapshot)
            return snapshot, None

    def _record(self, snapshot: Snapshot) -> None:
        cell, window = self._cell, self._window
        if cell is None or window is None:
            return
        window.add(snapshot)
        cell.polls += 1
        keys = select_engines(snapshot, self.model)
        engines = [snapshot.engines[key] for key in keys]
        usage = [e.gauges["kv_usage"] for e in engines if "kv_usage" in e.gauges]
        running = [e.gauges["running"] for e in engines if "running" in e.gauges]
        waiting = [e.gauges["waiting"] for e in engines if "waiting" in e.gauges]
        if usage:
            cell.peak_kv_usage = max(cell.peak_kv_usage or 0.0, max(usage))
        if running:
            cell.peak_running = max(cell.peak_running or 0.0, sum(running))
        if waiting:
            cell.peak_waiting = max(cell.peak_waiting or 0.0, sum(waiting))

    def begin_cell(self) -> Snapshot | None:
        """Open a cell with a poll now; None when that poll failed."""
        with self._lock:
            self._window = Window(seconds=float("inf"))
            self._cell = CellMetrics()
        snapshot, _ = self.poll()
        return snapshot

    def current(self) -> CellMetrics:
        """The open cell's totals so far."""
        with self._lock:
            return self._totals()

    def end_cell(self) -> CellMetrics:
        """Close the cell with a last poll and return its totals."""
        self.poll()
        with self._lock:
            totals = self._totals()
            self._window = None
            self._cell = None
            return totals

    def _totals(self) -> CellMetrics:
        cell = self._cell
        window = self._window
        if cell is None or window is None:
            return CellMetrics()
        out = CellMetrics(polls=cell.polls, poll_errors=cell.poll_errors,
                          last_poll_error=cell.last_poll_error, peak_kv_usage=cell.peak_kv_usage,
                          peak_running=cell.peak_running, peak_waiting=cell.peak_waiting)
        latest = window.latest
        if latest is None:
            return out
        total = Increase()
        for key in select_engines(latest, self.model):
            increase = window.increase(key)
            total.add(increase)
            total.seconds = max(total.seconds, increase.seconds)
        out.seconds = total.seconds
        out.restarts = total.restarts
        out.counters = dict(total.counters)
        out.histograms = dict(total.histograms)
        return out
