"""Replaying a capture through the sidecar's own Monitor: a fetcher that
serves the recorded pages (and recorded failures) in order, and a clock that
says each one's recorded fetch time. Window, signals and diagnosis are the
live code; only the source of pages and of time differs.

`replay()` runs as fast as the machine allows (kvwatch diagnose --replay);
`paced()` waits between pages, the recorded gap divided by a speed
(kvwatch serve --replay). `Timeline` folds the polls into episodes of
findings: when each started and ended, and its evidence at the worst point.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator

from kvwatch.capture.bundle import Capture, Entry
from kvwatch.diagnose.vocabulary import CONFIDENCES, SEVERITIES
from kvwatch.scrape import FetchResult
from kvwatch.sidecar.report import _clean

_SEVERITY_RANK = {severity: len(SEVERITIES) - index for index, severity in enumerate(SEVERITIES)}
_CONFIDENCE_RANK = {confidence: len(CONFIDENCES) - index for index, confidence in enumerate(CONFIDENCES)}


class ReplaySource:
    """Both the Monitor's fetcher and its clock: `now()` is the recorded time
    of the page the next `fetch()` serves."""

    def __init__(self, pages: Iterable[tuple[Entry, str | None]]):
        self._pages: Iterator[tuple[Entry, str | None]] = iter(pages)
        self._next: tuple[Entry, str | None] | None = next(self._pages, None)
        self._last_time = 0.0

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
        if text is None:
            # What was recorded (redacted at recording), not a sentence made up
            # now from this replay's settings.
            return FetchResult(None, entry.reason or "error", entry.detail, entry.seconds, sentence=entry.detail)
        return FetchResult(text, seconds=entry.seconds, size=entry.size, content_type="text/plain")


@dataclass
class Episode:
    """One finding (symptom, cause, model, engine) active over consecutive
    successful polls."""

    symptom: str
    cause: str
    model: str
    engine: str | None
    start: float
    end: float
    polls: int = 1
    worst: dict[str, Any] = field(default_factory=dict)
    active_at_end: bool = False

    def rank(self) -> tuple[int, int]:
        return (_SEVERITY_RANK.get(self.worst.get("severity"), 0),
                _CONFIDENCE_RANK.get(self.worst.get("confidence"), 0))


def _worst_of(finding, at: float) -> dict[str, Any]:
    return {"time": at, "severity": finding.severity, "confidence": finding.confidence,
            "summary": finding.summary, "evidence": _clean(dict(finding.evidence)), "next_check": finding.next_check}


class Timeline:
    """Feed it every State the monitor publishes, in order. A finding's
    episode runs from the first successful poll that reports it to the last
    one that does; a failed poll neither starts nor ends one (the window did
    not move), and is counted in `outages`. The worst point is the first
    poll at the episode's highest severity, then confidence."""

    def __init__(self):
        self.episodes: list[Episode] = []
        self.outages: list[dict[str, Any]] = []
        self._open: dict[tuple, Episode] = {}
        self.polls = 0
        self.failed = 0
        self.first: float | None = None
        self.last: float | None = None

    def add(self, state) -> None:
        at = state.last_poll_time
        self.polls += 1
        self.first = at if self.first is None else self.first
        self.last = at
        if not state.up:
            self.failed += 1
            outage = self.outages[-1] if self.outages else None
            if outage and outage["reason"] == state.reason and outage["open"]:
                outage.update(end=at, polls=outage["polls"] + 1)
            else:
                self.outages.append({"reason": state.reason, "detail": state.detail, "start": at, "end": at,
                                     "polls": 1, "open": True})
            return
        if self.outages:
            self.outages[-1]["open"] = False
        seen = set()
        for finding in state.findings:
            key = (finding.symptom, finding.cause, finding.model, finding.engine)
            seen.add(key)
            episode = self._open.get(key)
            if episode is None:
                episode = Episode(*key, start=at, end=at, worst=_worst_of(finding, at))
                self._open[key] = episode
                self.episodes.append(episode)
                continue
            episode.end = at
            episode.polls += 1
            candidate = (_SEVERITY_RANK.get(finding.severity, 0), _CONFIDENCE_RANK.get(finding.confidence, 0))
            if candidate > episode.rank():
                episode.worst = _worst_of(finding, at)
        for key in [key for key in self._open if key not in seen]:
            del self._open[key]

    def finish(self) -> "Timeline":
        for episode in self._open.values():
            episode.active_at_end = True
        for outage in self.outages:
            outage.pop("open", None)
        return self

    def to_json(self) -> dict[str, Any]:
        return {
            "polls": self.polls,
            "failed_polls": self.failed,
            "start": self.first,
            "end": self.last,
            "findings": [asdict(e) for e in self.episodes],
            "outages": [dict(o) for o in self.outages],
        }

    def signature(self) -> list[tuple]:
        """The timeline as comparable values (tests compare a replay with live)."""
        return [(e.symptom, e.cause, e.model, e.engine, e.start, e.end, e.polls, e.worst["time"],
                 e.worst["severity"], tuple(sorted(e.worst["evidence"].items()))) for e in self.episodes]


def replay(capture: Capture, monitor_for: Callable[[ReplaySource], Any],
           on_state: Callable[[Any], None] | None = None) -> Timeline:
    """Every recorded fetch through a Monitor built by `monitor_for(source)`
    (which passes the source as fetcher and `source.now` as clock), without
    waiting; returns the findings timeline."""
    source = ReplaySource(capture.pages())
    monitor = monitor_for(source)
    timeline = Timeline()
    while not source.exhausted:
        state = monitor.poll_once()
        timeline.add(state)
        if on_state is not None:
            on_state(state)
    return timeline.finish()


def paced(source: ReplaySource, poll: Callable[[], Any], speed: float,
          wait: Callable[[float], bool] = lambda seconds: (time.sleep(seconds), False)[1],
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
