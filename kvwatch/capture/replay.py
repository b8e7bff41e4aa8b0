"""Replaying a capture through the sidecar's own Monitor: a fetcher that
serves the recorded pages (and recorded failures) in order, and a clock that
says each one's recorded fetch time. Window, signals and diagnosis are the
live code; only the source of pages and of time differs.

`replay()` runs as fast as the machine allows (kvwatch diagnose --replay);
`paced()` waits between pages, the recorded gap divided by a speed
(kvwatch serve --replay). The polls fold into the findings timeline of
kvwatch/diagnose/timeline.py, the one `kvwatch diagnose --prometheus` writes.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator

from kvwatch.capture.bundle import Capture, Entry
from kvwatch.diagnose.timeline import Timeline
from kvwatch.scrape import FetchResult


class ReplaySource:
    """Both the Monitor's fetcher and its clock: `now()` is the recorded time
    of the page the next `fetch()` serves."""

    def __init__(self, pages: Iterable[tuple[Entry, str | None]],
                 events: list[tuple[float, int, bytes]] | None = None):
        self._pages: Iterator[tuple[Entry, str | None]] = iter(pages)
        self._next: tuple[Entry, str | None] | None = next(self._pages, None)
        self._last_time = 0.0
        # The engine's recorded KV-cache event messages, fed to `feed` (the
        # monitor's KVEventSource.feed) up to each page's answer, as they
        # arrived live before it.
        self._events = _in_time_order(list(events or ()))
        self._event_index = 0
        self.feed: Callable[..., Any] | None = None

    @property
    def exhausted(self) -> bool:
        return self._next is None

    @property
    def next_entry(self) -> Entry | None:
        return self._next[0] if self._next is not None else None

    def now(self) -> float:
        return self._next[0].time if self._next is not None else self._last_time

    def fetch(self) -> FetchResult:
        if self._next is None:
            return FetchResult(None, "replay_ended", "every recorded page was replayed")
        entry, text = self._next
        self._last_time = entry.time
        self._next = next(self._pages, None)
        self._feed_until(entry.time + entry.seconds)
        if text is None:
            # What was recorded (redacted at recording), not a sentence made up
            # now from this replay's settings.
            return FetchResult(None, entry.reason or "error", entry.detail, entry.seconds, sentence=entry.detail)
        return FetchResult(text, seconds=entry.seconds, size=entry.size, content_type="text/plain")


    def _feed_until(self, until: float) -> None:
        events, index = self._events, self._event_index
        while index < len(events) and events[index][0] <= until:
            at, seq, payload = events[index]
            if self.feed is not None:
                self.feed(seq, payload, at)
            index += 1
        self._event_index = index


def _in_time_order(events: list[tuple[float, int, bytes]]) -> list[tuple[float, int, bytes]]:
    """The records in their recorded order, each fed no later than any after
    it: a record stamped later than the next one (a bad stamp, a clock stepped
    back) takes the next one's time, so it cannot hold back what follows."""
    out = []
    due = float("inf")
    for at, seq, payload in reversed(events):
        due = min(due, at)
        out.append((due, seq, payload))
    out.reverse()
    return out


def with_events(source: ReplaySource, monitor) -> Any:
    """The monitor, its KV-cache event source fed from the capture's
    recorded stream (when both exist)."""
    stream = getattr(monitor, "kv_events", None)
    if stream is not None:
        source.feed = lambda seq, payload, at: stream.feed(seq, payload, now=at)
    return monitor


def replay(capture: Capture, monitor_for: Callable[[ReplaySource], Any],
           on_state: Callable[[Any], None] | None = None) -> Timeline:
    """Every recorded fetch through a Monitor built by `monitor_for(source)`
    (which passes the source as fetcher and `source.now` as clock), without
    waiting; returns the findings timeline."""
    source = ReplaySource(capture.pages(), capture.events)
    monitor = with_events(source, monitor_for(source))
    timeline = Timeline()
    while not source.exhausted:
        state = monitor.poll_once()
        timeline.add_state(state)
        if on_state is not None:
            on_state(state)
    return timeline.finish()


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return False  # never asked to stop


def paced(source: ReplaySource, poll: Callable[[], Any], speed: float,
          wait: Callable[[float], bool] = lambda seconds: _sleep(seconds),
          monotonic: Callable[[], float] = time.monotonic) -> int:
    """Poll once per recorded page, each at its recorded offset from the first
    page divided by `speed` in wall time (speed 0: no waiting); `wait(seconds)`
    waits and says whether to stop. Returns the polls made."""
    polls = 0
    first: float | None = None
    started = monotonic()
    while not source.exhausted:
        at = source.now()
        first = at if first is None else first
        if speed > 0:
            due = started + (at - first) / speed
            if wait(max(0.0, due - monotonic())):
                break
        poll()
        polls += 1
    return polls
