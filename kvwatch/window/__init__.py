"""A ring of timestamped snapshots and reset-safe increases over it.

Each snapshot is stored with its increase over the previous one, per engine,
computed once when it arrives, so a window's increase is a sum of stored steps
(Prometheus' `increase()` semantics, without its extrapolation):
- a reset is per series (Prometheus' rule): a counter that went down restarted
  from zero, so its step is its new value; a histogram whose count or any
  bucket went down, or whose bounds changed, restarted too. One series going
  down says nothing about the others: they keep their differences;
- a restart of the whole engine is a separate fact, read only from evidence
  of one: a new process start time (`process_start_time_seconds`), or a
  changed `_created` time together with a series that went down, or every
  counter that had counted something going down at once. Then every series
  counts its new value, even one that already climbed past its old value. `_created` alone is no evidence: a page may move it on every poll
  while its counters climb;
- a canonical key read from another vLLM family than in the previous poll
  (`gpu_prefix_cache_queries` -> `prefix_cache_queries`) means the engine was
  upgraded, so restarted, but the two values may not even share a unit
  (blocks before vLLM 0.9, tokens after) and nothing says the new ones started
  from zero: that step is marked a restart and counts neither increase nor time.
A reset therefore never produces a negative rate or a spike.

The window keeps each engine's sum of steps up to date as snapshots arrive
and leave (one step added and one taken away per poll), so reading a window
costs the same at 10 polls as at 3,600. The sums are exact (integers, and
fixed point at 2**-1074 for fractions, so adding and taking away never
drifts); read back, each is the correctly rounded sum of the steps, which is
what summing the steps one by one gives whenever that is exact (always, for
counts below 2**53). A step holding an infinite or NaN value is summed one
by one instead, until it leaves the window.

The window is bounded in bytes across polls, not only per poll (a gateway
that sets a new served model name per request brought 1,000 new pairs a
poll, and a 5-minute window held 61,000 of them: 493 MiB). Past
`max_bytes`, the window forgets the (model, engine) pairs that are no longer
on the page, those last seen longest ago first, then, if that is not enough,
its oldest polls (it then spans less than its configured time).

The steps and what they add up to are in `steps`, the running sums in
`sums`, what a pair costs in bytes in `sizes`; their public names are
re-exported here.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from typing import Self

from kvwatch.snapshot import Snapshot
from kvwatch.window.sizes import DERIVED_PAIR_BYTES, NEW_PAIR_BYTES, WINDOW_MAX_BYTES, pair_bytes
from kvwatch.window.steps import DERIVED_KEPT_WHEN_TRIMMED, EngineKey, Entry, Increase, Step, step_between
from kvwatch.window.sums import _WindowSums

__all__ = [
    "DERIVED_KEPT_WHEN_TRIMMED", "DERIVED_PAIR_BYTES", "NEW_PAIR_BYTES", "WINDOW_MAX_BYTES", "EngineKey", "Entry",
    "EntryFollower", "Increase", "Step", "Window", "pair_bytes", "step_between",
]


class EntryFollower:
    """What a reader keeps about a window's entries from one poll to the
    next, kept in step with them: entries arrive at the end and leave from
    the front (anything else starts it over, from `reset`). A subclass says
    what an entry adds (`entered`, with the entry before it, None for the
    first) and takes away (`left`); the window keeps one per reader
    (`Window.kept`)."""

    def __init__(self) -> None:
        self.entries: deque[Entry] = deque()

    def reset(self) -> None:
        self.entries = deque()

    def entered(self, previous: Entry | None, entry: Entry) -> None:
        raise NotImplementedError

    def left(self, entry: Entry, first: Entry | None) -> None:
        """`entry` left; `first` is the window's first entry now."""
        raise NotImplementedError

    def sync(self, entries: deque) -> None:
        tracked = self.entries
        first = entries[0] if entries else None
        while tracked and tracked[0] is not first:
            gone = tracked.popleft()
            self.left(gone, tracked[0] if tracked else None)
        count = len(tracked)
        if count and (count > len(entries) or tracked[-1] is not entries[count - 1]):
            self.reset()  # changed behind the window's back: start over
            tracked, count = self.entries, 0
        for entry in itertools.islice(entries, count, None):
            self.entered(tracked[-1] if tracked else None, entry)
            tracked.append(entry)

    @classmethod
    def of(cls, window: "Window", name: str) -> Self:
        """The window's follower of this class under `name`, in step with it."""
        kept = window.kept.get(name)
        if not isinstance(kept, cls):  # absent (a follower of one class per name)
            kept = window.kept[name] = cls()
        kept.sync(window.entries)
        return kept


class Window:
    """Snapshots of the last `seconds`, with per-engine steps."""

    def __init__(self, seconds: float, max_entries: int = 10_000, max_bytes: int | None = WINDOW_MAX_BYTES,
                 left_out: frozenset[str] = frozenset()):
        self.seconds = seconds
        # Histogram keys whose increase the window does not sum (its
        # readers never read them): absent from `increase`.
        self.left_out = left_out
        # Bounded even if polls come faster than expected.
        self.entries: deque[Entry] = deque(maxlen=max_entries)
        # The entries' pair_bytes, and the bound on it (None: entries only).
        self.bytes = 0
        self.max_bytes = max_bytes
        # What the byte bound took, in all: (pair, poll) items forgotten, and
        # polls dropped before the window's time was up. `trimmed` says it in
        # one sentence while the latest poll's window is short of something.
        self.forgotten_pairs = 0
        self.dropped_polls = 0
        self.trimmed: str | None = None
        self._sums = _WindowSums(left_out)
        # What kvwatch.signals.evaluate_window kept from its last evaluation
        # of this window (derived values and the inputs they came from).
        self.evaluated: dict = {}
        # What other readers keep about the window from one poll to the next
        # (the diagnosis' per-engine polls), by reader; it goes with clear().
        self.kept: dict = {}
        # The window this one follows (follow), whose readers' per-engine
        # polls this one's readers take the tail of; None for a window of its own.
        self.followed: Window | None = None

    def add(self, snapshot: Snapshot) -> Entry:
        entry = Entry(snapshot)
        if self.entries:
            previous = self.entries[-1].snapshot
            seconds = snapshot.time - previous.time
            # Equal maps (the rule, compared in C) rename nothing.
            renamed = snapshot.sources != previous.sources and any(
                previous.sources.get(key, family) != family for key, family in snapshot.sources.items())
            new_process = (previous.process_start is not None and snapshot.process_start is not None
                           and previous.process_start != snapshot.process_start)
            for key, engine in snapshot.engines.items():
                before = previous.engines.get(key)
                if before is not None:
                    entry.steps[key] = step_between(before, engine, seconds, renamed, new_process)
        if self.max_bytes is not None:
            steps = entry.steps
            entry.size = sum(pair_bytes(key, engine, steps.get(key)) for key, engine in snapshot.engines.items())
            self.bytes += entry.size
        self._append(entry)
        return entry

    def follow(self, source: "Window") -> None:
        """Brings this (shorter) window up to `source`'s latest entry by
        sharing its entries, steps and what readers derived from them, not
        computing them again (the now span, diagnose/now.py). Anything else
        than the next entry (a first call, a gap, the source forgetting
        pairs or clearing) starts it over from the source's entries."""
        self.followed = source
        entries = source.entries
        if not entries:
            self.clear()
            return
        latest = entries[-1]
        if self.entries and self.entries[-1] is latest:
            return
        if (not self.entries or source.trimmed is not None or len(entries) < 2
                or entries[-2] is not self.entries[-1]):
            self.clear()
            horizon = latest.snapshot.time - self.seconds
            start = len(entries) - 1
            while start > 0 and entries[start].snapshot.time > horizon:
                start -= 1
            for entry in itertools.islice(entries, start, None):
                self._append(entry)
            return
        self._append(latest)

    def _append(self, entry: Entry) -> None:
        snapshot = entry.snapshot
        sums = self._sums.current(self.entries)
        if self.entries.maxlen is not None and len(self.entries) == self.entries.maxlen:
            self._drop_oldest(sums)  # what append would drop, with the sums kept
        self.entries.append(entry)
        if sums is not None:
            sums.entered(entry, counted=len(self.entries) > 1)
        horizon = snapshot.time - self.seconds
        # Keep one entry at or before the horizon so the window spans it fully.
        while len(self.entries) > 2 and self.entries[1].snapshot.time <= horizon:
            self._drop_oldest(sums)
        self.trimmed = None
        if self.max_bytes is not None and self.bytes > self.max_bytes:
            self._fit(sums, self.max_bytes)
        if sums is not None:
            sums.mark(self.entries)

    def _fit(self, sums: _WindowSums | None, max_bytes: int) -> None:
        """Back within max_bytes: forget the pairs no longer on the page
        (those last seen longest ago first) in every entry but the latest
        two (the latest step's), then drop the oldest polls if need be."""
        entries = self.entries
        latest = entries[-1].snapshot.engines
        last_seen: dict[EngineKey, int] = {}
        for index, entry in enumerate(entries):
            for key in entry.snapshot.engines:
                last_seen[key] = index
        trimmable = list(entries)[:-2]
        gone = sorted((index, key) for key, index in last_seen.items() if key not in latest)
        excess = self.bytes - max_bytes
        chosen: set[EngineKey] = set()
        for _, key in gone:
            if excess <= 0:
                break
            for entry in trimmable:
                engine = entry.snapshot.engines.get(key)
                if engine is not None:
                    excess -= pair_bytes(key, engine, entry.steps.get(key))
                    chosen.add(key)
        forgotten = 0
        if chosen:
            for position, entry in enumerate(trimmable):
                forgotten += self._forget(entry, chosen, sums if position > 0 else None)
            if sums is not None:
                sums.forgot(chosen)
            # What readers kept (the diagnosis' per-engine polls) was built
            # from the entries as they were: they build it again.
            self.kept = {}
            self.forgotten_pairs += forgotten
        dropped = 0
        while len(entries) > 2 and self.bytes > max_bytes:
            self._drop_oldest(sums)
            dropped += 1
        self.dropped_polls += dropped
        if forgotten or dropped:
            parts = []
            if forgotten:
                parts.append(f"forgot {len(chosen)} (model, engine) pairs no longer on the page before their time")
            if dropped:
                parts.append(f"dropped its {dropped} oldest polls (it spans "
                             f"{entries[-1].snapshot.time - entries[0].snapshot.time:.0f} s, not {self.seconds:g} s)")
            self.trimmed = (f"The window reached its bound of {max_bytes / 2 ** 20:.0f} MiB and "
                            + " and ".join(parts) + ".")

    def _forget(self, entry: Entry, keys: set[EngineKey], sums: _WindowSums | None) -> int:
        """Takes `keys` out of one entry (new dicts: a reader may hold the
        old ones); `sums`: the entry's steps count in the running sums."""
        engines = entry.snapshot.engines
        if keys.isdisjoint(engines):
            return 0
        steps = entry.steps
        kept = {key: engine for key, engine in engines.items() if key not in keys}
        for key in keys:
            engine = engines.get(key)
            if engine is None:
                continue
            step = steps.get(key)
            size = pair_bytes(key, engine, step)
            entry.size -= size
            self.bytes -= size
            if step is not None and sums is not None:
                sums.forget_step(key, step, entry)
        entry.snapshot.engines = kept
        entry.steps = {key: step for key, step in steps.items() if key not in keys}
        entry.derived = {name: value for name, value in entry.derived.items() if name in DERIVED_KEPT_WHEN_TRIMMED}
        return len(engines) - len(kept)

    def _drop_oldest(self, sums: _WindowSums | None) -> None:
        gone = self.entries.popleft()
        if self.max_bytes is not None:  # a follower's shared entries count in their own window's bytes
            self.bytes -= gone.size
        if sums is not None:
            # The new first entry only marks where the window starts: its
            # steps (its increase over the one just dropped) stop counting.
            sums.left(gone, self.entries[0] if self.entries else None)

    @property
    def latest(self) -> Snapshot | None:
        return self.entries[-1].snapshot if self.entries else None

    @property
    def earliest(self) -> Snapshot | None:
        return self.entries[0].snapshot if self.entries else None

    def increase(self, key: EngineKey, since: float | None = None) -> Increase:
        """The engine's increase over the window (or since a time inside it)."""
        if since is None:
            sums = self._sums.current(self.entries)
            if sums is not None:
                return sums.increase(key)
        return self._summed_step_by_step(key, since)

    def _summed_step_by_step(self, key: EngineKey, since: float | None = None) -> Increase:
        total = Increase()
        for entry in list(self.entries)[1:]:
            if since is not None and entry.snapshot.time <= since:
                continue
            step = entry.steps.get(key)
            if step is not None:
                total.add(step)
                total.seconds += step.seconds
        for left_out in self.left_out.intersection(total.histograms):
            del total.histograms[left_out]
        return total

    def gauge_series(self, key: EngineKey, gauge: str) -> list[tuple[float, float]]:
        """(time, value) of an engine's gauge in every snapshot of the window that has it."""
        sums = self._sums.current(self.entries)
        if sums is not None:
            return sums.gauge_series(self.entries, key, gauge)
        return self._gauge_series_scanned(key, gauge)

    def gauge_columns(self, key: EngineKey, gauge: str) -> tuple[list[float], list[float], bool, bool]:
        """gauge_series as its times and its values, whether the times
        strictly increase, and whether every value lies within 0..1 (none
        NaN): kept as the window moves, not found by a pass over it."""
        sums = self._sums.current(self.entries)
        if sums is not None:
            found = sums.gauge_columns(self.entries, key, gauge)
            if found is None:
                return [], [], True, True
            return list(found.times), list(found.values), not found.unordered, not found.outside
        series = self._gauge_series_scanned(key, gauge)
        times = [time for time, _ in series]
        values = [value for _, value in series]
        return (times, values, all(map(operator.lt, times, itertools.islice(times, 1, None))),
                all(0.0 <= value <= 1.0 for value in values))

    def _gauge_series_scanned(self, key: EngineKey, gauge: str) -> list[tuple[float, float]]:
        series = []
        for entry in self.entries:
            engine = entry.snapshot.engines.get(key)
            if engine is not None and gauge in engine.gauges:
                series.append((entry.snapshot.time, engine.gauges[gauge]))
        return series

    def gauge_max(self, key: EngineKey, gauge: str) -> float | None:
        """The highest value of an engine's gauge over every snapshot in the
        window (max of gauge_series), or None if none has it."""
        sums = self._sums.current(self.entries)
        if sums is None:
            series = self._gauge_series_scanned(key, gauge)
            return max(value for _, value in series) if series else None
        return sums.gauge_max(self.entries, key, gauge)

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
        self.trimmed = None
        self._sums = _WindowSums(self.left_out)
        self.evaluated = {}
        self.kept = {}
