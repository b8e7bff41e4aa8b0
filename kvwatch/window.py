"""A ring of timestamped snapshots and reset-safe increases over it.

Each snapshot is stored with its increase over the previous one, per engine,
computed once when it arrives, so a window's increase is a sum of stored steps
(Prometheus' `increase()` semantics, without its extrapolation):
- a counter that went down restarted from zero, so the step is its new value;
- a histogram whose count or any bucket went down, or whose bounds changed,
  restarted too;
- a changed `_created` time means a restart even when the new counters already
  climbed past the old ones;
- a canonical key read from another vLLM family than in the previous poll
  (`gpu_prefix_cache_queries` -> `prefix_cache_queries`) means the engine was
  upgraded, so restarted, but the two values may not even share a unit
  (blocks before vLLM 0.9, tokens after) and nothing says the new ones started
  from zero: that step is marked a restart and counts neither increase nor time.
A reset therefore never produces a negative rate or a spike.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvwatch.snapshot import EngineSnapshot, Histogram, Snapshot

EngineKey = tuple[str, str]


@dataclass(slots=True)
class Step:
    """The increase of one engine's counters and histograms between two polls."""

    seconds: float
    counters: dict[str, float]
    histograms: dict[str, Histogram]
    restarted: bool


@dataclass(slots=True)
class Entry:
    snapshot: Snapshot
    steps: dict[EngineKey, Step] = field(default_factory=dict)


@dataclass(slots=True)
class Increase:
    """What a window adds up to for one engine (or one model)."""

    seconds: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    restarts: int = 0
    steps: int = 0

    def add(self, step: Step | "Increase") -> None:
        for key, value in step.counters.items():
            self.counters[key] = self.counters.get(key, 0.0) + value
        for key, histogram in step.histograms.items():
            existing = self.histograms.get(key)
            if existing is None:
                self.histograms[key] = histogram
            else:
                merged = existing.plus(histogram)
                # Bounds changed inside the window: the newer bounds win.
                self.histograms[key] = merged if merged is not None else histogram
        if isinstance(step, Step):
            self.restarts += step.restarted
            self.steps += 1
        else:
            self.restarts += step.restarts
            self.steps += step.steps

    def rate(self, key: str) -> float | None:
        if self.seconds <= 0 or key not in self.counters:
            return None
        return self.counters[key] / self.seconds

    def ratio(self, numerator: str, denominator: str) -> float | None:
        below = self.counters.get(denominator)
        above = self.counters.get(numerator)
        if not below or above is None:
            return None
        return above / below


def step_between(earlier: EngineSnapshot, later: EngineSnapshot, seconds: float, renamed: bool = False) -> Step:
    """Only series present in both polls count: one that just appeared has no
    increase yet. `renamed`: the page spells a key with another vLLM family
    than the previous one did (a version change)."""
    if renamed:
        # Counting the new values (the reset rule) could add lifetime totals
        # in another unit as one step's increase: a spike. Skip the step, its
        # time included, so rates average over the steps that did count.
        return Step(0.0, {}, {}, True)
    histogram_deltas = {
        key: histogram.minus(earlier.histograms[key])
        for key, histogram in later.histograms.items()
        if key in earlier.histograms
    }
    restarted = (
        (earlier.created is not None and later.created is not None and later.created != earlier.created)
        or any(value < earlier.counters[key] for key, value in later.counters.items() if key in earlier.counters)
        or any(delta is None for delta in histogram_deltas.values())
    )
    if restarted:
        # Everything restarted from zero: the increase is the new value.
        counters = {key: value for key, value in later.counters.items() if key in earlier.counters}
        histograms = {key: later.histograms[key] for key in histogram_deltas}
    else:
        counters = {
            key: value - earlier.counters[key] for key, value in later.counters.items() if key in earlier.counters
        }
        histograms = histogram_deltas
    return Step(seconds, counters, histograms, restarted)


class Window:
    """Snapshots of the last `seconds`, with per-engine steps."""

    def __init__(self, seconds: float, max_entries: int = 10_000):
        self.seconds = seconds
        # Bounded even if polls come faster than expected.
        self.entries: deque[Entry] = deque(maxlen=max_entries)

    def add(self, snapshot: Snapshot) -> Entry:
        entry = Entry(snapshot)
        if self.entries:
            previous = self.entries[-1].snapshot
            seconds = snapshot.time - previous.time
            renamed = any(previous.sources.get(key, family) != family for key, family in snapshot.sources.items())
            for key, engine in snapshot.engines.items():
                before = previous.engines.get(key)
                if before is not None:
                    entry.steps[key] = step_between(before, engine, seconds, renamed)
        self.entries.append(entry)
        horizon = snapshot.time - self.seconds
        # Keep one entry at or before the horizon so the window spans it fully.
        while len(self.entries) > 2 and self.entries[1].snapshot.time <= horizon:
            self.entries.popleft()
        return entry

    @property
    def latest(self) -> Snapshot | None:
        return self.entries[-1].snapshot if self.entries else None

    @property
    def earliest(self) -> Snapshot | None:
        return self.entries[0].snapshot if self.entries else None

    def increase(self, key: EngineKey, since: float | None = None) -> Increase:
        """The engine's increase over the window (or since a time inside it)."""
        total = Increase()
        for entry in list(self.entries)[1:]:
            if since is not None and entry.snapshot.time <= since:
                continue
            step = entry.steps.get(key)
            if step is not None:
                total.add(step)
                total.seconds += step.seconds
        return total

    def gauge_series(self, key: EngineKey, gauge: str) -> list[tuple[float, float]]:
        series = []
        for entry in self.entries:
            engine = entry.snapshot.engines.get(key)
            if engine is not None and gauge in engine.gauges:
                series.append((entry.snapshot.time, engine.gauges[gauge]))
        return series

    def clear(self) -> None:
        self.entries.clear()
