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
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections import deque
from dataclasses import dataclass, field

from kvwatch.snapshot import COUNTER_ROUNDING, EngineSnapshot, Histogram, Snapshot

EngineKey = tuple[str, str]

# The most one window holds, in bytes as `pair_bytes` counts them. A real
# vLLM 0.32 engine costs 22.9 KB a poll (its histograms' buckets, in
# the snapshot and in the step), so 64 engines polled every 5 s over 5
# minutes (61 polls, 85 MiB) fit with a quarter to spare; the memory limit
# (kvwatch/mixin/config.py) is derived from the worst page's peak with the
# window at this bound (benchmarks/worst_page_probe.py).
WINDOW_MAX_BYTES = 112 * 1024 * 1024

# What readers derive per (model, engine) and poll and keep beside its
# snapshot and step (diagnose.context's Poll, the page's trend points, the
# window's gauge series), the larger of two figures measured with
# tracemalloc over a full window: 0.9 KB for a pair of five families, 2.7 KB
# for a real vLLM 0.32 engine. pair_bytes then counts 5.2 KB and 22.9 KB
# where tracemalloc saw 3.3 KB and 22.7 KB.
DERIVED_PAIR_BYTES = 2816
# What a reader keeps per (model, engine) while the pair is in the window
# (the diagnosis' EnginePolls: its deques of polls, times and gauges, at
# least 760 bytes each), counted where a pair has no step (its first poll,
# or its first after a gap): a gateway that sets one model name per request
# makes one per name, 8.4 KB each, and the window held 34,000 of them at its
# bound (peak RSS 596 MiB against 384Mi, benchmarks/worst_page_probe.py).
NEW_PAIR_BYTES = 4608
_FLOAT = sys.getsizeof(0.0)
_getsizeof = sys.getsizeof


def _histograms_bytes(histograms: dict[str, Histogram]) -> int:
    # Bounds are interned by the adapter (one tuple per layout, shared by
    # every poll), so only the counts are the entry's own.
    total = _getsizeof(histograms)
    for histogram in histograms.values():
        cumulative = histogram.cumulative
        total += _getsizeof(histogram) + _getsizeof(cumulative) + _FLOAT * (len(cumulative) + 2)
    return total


def pair_bytes(key: EngineKey, engine: EngineSnapshot, step: "Step | None") -> int:
    """What one (model, engine) of one window entry holds: its snapshot, its
    step, their dicts, tuples and numbers as sys.getsizeof counts them, the
    key and its names, and what readers derive from it (DERIVED_PAIR_BYTES)."""
    total = (DERIVED_PAIR_BYTES + _getsizeof(key) + _getsizeof(key[0]) + _getsizeof(key[1]) + _getsizeof(engine)
             + _getsizeof(engine.gauges) + _getsizeof(engine.counters)
             + _FLOAT * (len(engine.gauges) + len(engine.counters)) + _histograms_bytes(engine.histograms))
    if step is not None:
        total += (_getsizeof(step) + _getsizeof(step.counters) + _FLOAT * len(step.counters)
                  + _histograms_bytes(step.histograms))
    else:
        total += NEW_PAIR_BYTES
    return total


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
    # What readers derive from this entry once, for every poll it stays in
    # the window (diagnosis' per-engine Polls); it leaves with the entry.
    derived: dict = field(default_factory=dict)
    # pair_bytes of its (model, engine) pairs, summed.
    size: int = 0


# What an entry derived that stays true when the window forgets some of its
# pairs: the changes read between it and the entry before, as they were
# seen (diagnose.changes). The rest is derived again from what is left.
DERIVED_KEPT_WHEN_TRIMMED = ("changes",)


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
        if above > below:
            # A part larger than its whole: the two counters disagree over the
            # window (a restart that left no evidence, with one reset seen and
            # the other not). No answer is better than one above 1.
            return None
        return above / below


def step_between(earlier: EngineSnapshot, later: EngineSnapshot, seconds: float, renamed: bool = False,
                 new_process: bool = False) -> Step:
    """Only series present in both polls count: one that just appeared has no
    increase yet. `renamed`: the page spells a key with another vLLM family
    than the previous one did (a version change). `new_process`: the page's
    process start time changed."""
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
    # Counters that had counted something: did they go down, and all of them?
    # (A fall within COUNTER_ROUNDING of the value is no fall.)
    fell = [later.counters[key] < before - before * COUNTER_ROUNDING for key, before in earlier.counters.items()
            if before > 0 and key in later.counters]
    went_down = any(fell) or any(delta is None for delta in histogram_deltas.values())
    created_moved = earlier.created is not None and later.created is not None and later.created != earlier.created
    # Every counter going down at once (two at least) is a restart too: the
    # evidence pages without `_created` and a process start time have.
    restarted = new_process or (created_moved and went_down) or (len(fell) >= 2 and all(fell))
    counters = {}
    for key, value in later.counters.items():
        before = earlier.counters.get(key)
        if before is not None:
            # A series that went down restarted from zero: its increase is its
            # new value; one that fell within rounding did not move.
            if restarted:
                counters[key] = value
            elif value >= before:
                counters[key] = value - before
            else:
                counters[key] = 0.0 if value >= before - before * COUNTER_ROUNDING else value
    histograms = {key: later.histograms[key] if restarted or delta is None else delta
                  for key, delta in histogram_deltas.items()}
    return Step(seconds, counters, histograms, restarted)


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
    def of(cls, window: "Window", name: str) -> "EntryFollower":
        """The window's follower of this class under `name`, in step with it."""
        kept = window.kept.get(name)
        if kept is None:
            kept = window.kept[name] = cls()
        kept.sync(window.entries)
        return kept


class Window:
    """Snapshots of the last `seconds`, with per-engine steps."""

    def __init__(self, seconds: float, max_entries: int = 10_000, max_bytes: int | None = WINDOW_MAX_BYTES):
        self.seconds = seconds
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
        self._sums = _WindowSums()
        # What kvwatch.signals.evaluate_window kept from its last evaluation
        # of this window (derived values and the inputs they came from).
        self.evaluated: dict = {}
        # What other readers keep about the window from one poll to the next
        # (the diagnosis' per-engine polls), by reader; it goes with clear().
        self.kept: dict = {}

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
            self._fit(sums)
        if sums is not None:
            sums.mark(self.entries)
        return entry

    def _fit(self, sums: _WindowSums | None) -> None:
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
        excess = self.bytes - self.max_bytes
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
        while len(entries) > 2 and self.bytes > self.max_bytes:
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
            self.trimmed = (f"The window reached its bound of {self.max_bytes / 2 ** 20:.0f} MiB and "
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
        return total

    def gauge_series(self, key: EngineKey, gauge: str) -> list[tuple[float, float]]:
        """(time, value) of an engine's gauge in every snapshot of the window that has it."""
        sums = self._sums.current(self.entries)
        if sums is not None:
            return sums.gauge_series(self.entries, key, gauge)
        return self._gauge_series_scanned(key, gauge)

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
        self._sums = _WindowSums()
        self.evaluated = {}
        self.kept = {}


# --------------------------------------------------------------------------
# Running sums of the window's steps
# --------------------------------------------------------------------------

# Whole floats below this in size add and subtract exactly.
_EXACT_FLOATS = float(2 ** 53)


class _ExactSum:
    """A sum of floats that can take values away again without drifting:
    whole values as a float while their sum stays strictly between -2**53
    and 2**53 (each such sum of whole numbers is exact), else as one int;
    the rest in fixed point (`fraction` / 2**`scale`, the scale the finest
    value seen so far needs: every finite double is a whole multiple of
    2**-1074, but the sums stay small ints, cheap to add, while the values
    are coarser)."""

    __slots__ = ("quick", "whole", "fraction", "scale")

    def __init__(self) -> None:
        self.quick = 0.0
        self.whole = 0
        self.fraction = 0
        self.scale = 0

    def add(self, value: float) -> None:
        if type(value) is float and value.is_integer():
            quick = self.quick + value
            if -_EXACT_FLOATS < quick < _EXACT_FLOATS:
                self.quick = quick
            else:
                self.whole += int(value)
        elif type(value) is int:  # a time given as an int
            self.whole += value
        else:
            # ValueError (NaN) and OverflowError (inf) reach the window, which
            # then sums step by step.
            numerator, denominator = value.as_integer_ratio()
            # denominator is 2**(bit_length - 1)
            shift = self.scale + 1 - denominator.bit_length()
            if shift < 0:
                self.fraction <<= -shift
                self.scale -= shift
                shift = 0
            self.fraction += numerator << shift

    def take(self, value: float) -> None:
        if type(value) is float and value.is_integer():
            quick = self.quick - value
            if -_EXACT_FLOATS < quick < _EXACT_FLOATS:
                self.quick = quick
            else:
                self.whole -= int(value)
        elif type(value) is int:
            self.whole -= value
        else:
            numerator, denominator = value.as_integer_ratio()
            shift = self.scale + 1 - denominator.bit_length()
            if shift < 0:
                self.fraction <<= -shift
                self.scale -= shift
                shift = 0
            self.fraction -= numerator << shift

    def value(self) -> float:
        if not self.whole and not self.fraction:
            return self.quick
        whole = self.whole + int(self.quick)
        # Both divisions and int-to-float conversions round correctly.
        try:
            if not self.fraction:
                return float(whole)
            return ((whole << self.scale) + self.fraction) / (1 << self.scale)
        except OverflowError:
            return float("inf") if (whole << self.scale) + self.fraction > 0 else float("-inf")


class _HistogramRun:
    """The sum of the window's trailing run of steps that share one set of
    bounds (summing step by step, a change of bounds starts over: the newer
    bounds win), and the entry whose step began the run (None once it left)."""

    __slots__ = ("bounds", "start", "steps", "counts", "exact", "sum", "count")

    def __init__(self, histogram: Histogram, start: Entry):
        self.bounds = histogram.bounds
        self.start: Entry | None = start
        self.steps = 0
        # Bucket counts are whole and far below 2**53 in practice: summed as
        # a tuple of floats, in C, while every bucket of every step added is
        # a whole number >= 0 and every sum stays below 2**53. Then each sum
        # is exact, and so is taking a step away again (what is left is a
        # sum of whole numbers >= 0 no larger than before). `exact` replaces
        # it for the first step that breaks that.
        self.counts: tuple[float, ...] | None = (0.0,) * len(histogram.bounds)
        self.exact: list[_ExactSum] | None = None
        self.sum = _ExactSum()
        self.count = _ExactSum()
        self.add(histogram)

    def add(self, histogram: Histogram) -> None:
        cumulative = histogram.cumulative
        counts = self.counts
        if counts is not None:
            # min() after is_integer (no NaN left), max() of the sums: a sum
            # that rounded is at least 2**53.
            if all(map(float.is_integer, cumulative)) and (not cumulative or min(cumulative) >= 0):
                summed = tuple(map(operator.add, counts, cumulative))
                if not summed or max(summed) < _EXACT_FLOATS:
                    self.counts = summed
                    cumulative = None
            if cumulative is not None:
                self._to_exact()
        if cumulative is not None:
            for total, value in zip(self.exact, cumulative):
                total.add(value)
        self.sum.add(histogram.sum)
        self.count.add(histogram.count)
        self.steps += 1

    def take(self, histogram: Histogram) -> None:
        if self.counts is not None:
            self.counts = tuple(map(operator.sub, self.counts, histogram.cumulative))
        else:
            for total, value in zip(self.exact, histogram.cumulative):
                total.take(value)
        self.sum.take(histogram.sum)
        self.count.take(histogram.count)
        self.steps -= 1

    def _to_exact(self) -> None:
        self.exact = []
        for value in self.counts:
            total = _ExactSum()
            total.whole = int(value)
            self.exact.append(total)
        self.counts = None

    def histogram(self) -> Histogram:
        if self.counts is not None:
            cumulative = self.counts
        else:
            cumulative = tuple(total.value() for total in self.exact)
        return Histogram(self.bounds, cumulative, self.sum.value(), self.count.value())


class _EngineSums:
    """One engine's sum of steps over the window."""

    __slots__ = ("counters", "histograms", "seconds", "restarts", "steps")

    def __init__(self) -> None:
        self.counters: dict[str, list] = {}  # key -> [_ExactSum, steps holding it]
        self.histograms: dict[str, _HistogramRun] = {}
        self.seconds = _ExactSum()
        self.restarts = 0
        self.steps = 0

    def add(self, step: Step, entry: Entry) -> None:
        for key, value in step.counters.items():
            total = self.counters.get(key)
            if total is None:
                total = self.counters[key] = [_ExactSum(), 0]
            # _ExactSum.add's first case, inline: counters are whole floats.
            if (type(value) is float and value.is_integer()
                    and -_EXACT_FLOATS < (quick := total[0].quick + value) < _EXACT_FLOATS):
                total[0].quick = quick
            else:
                total[0].add(value)
            total[1] += 1
        for key, histogram in step.histograms.items():
            run = self.histograms.get(key)
            if run is None or run.bounds != histogram.bounds:
                self.histograms[key] = _HistogramRun(histogram, entry)
            else:
                run.add(histogram)
        self.seconds.add(step.seconds)
        self.restarts += step.restarted
        self.steps += 1

    def take(self, step: Step, entry: Entry) -> None:
        for key, value in step.counters.items():
            total = self.counters[key]
            if (type(value) is float and value.is_integer()
                    and -_EXACT_FLOATS < (quick := total[0].quick - value) < _EXACT_FLOATS):
                total[0].quick = quick  # _ExactSum.take's first case, inline
            else:
                total[0].take(value)
            total[1] -= 1
            if not total[1]:
                del self.counters[key]
        for key, histogram in step.histograms.items():
            run = self.histograms.get(key)
            if run is None:
                continue
            if run.start is entry:
                run.start = None
            elif run.start is not None:
                continue  # a step from before the run's bounds took over
            run.take(histogram)
            if not run.steps:
                del self.histograms[key]
        self.seconds.take(step.seconds)
        self.restarts -= step.restarted
        self.steps -= 1

    def increase(self) -> Increase:
        return Increase(
            seconds=self.seconds.value(),
            counters={key: total[0].value() for key, total in self.counters.items()},
            histograms={key: run.histogram() for key, run in self.histograms.items()},
            restarts=self.restarts,
            steps=self.steps,
        )


class _WindowSums:
    """Per-engine sums of the counted steps (those of every entry but the
    first), kept in step with the entries by Window.add. `current` checks
    that the entries are still the ones summed (anything that changed them
    behind the window's back, or a step that could not be summed exactly,
    makes it rebuild, or give way to step-by-step sums until the odd step
    has left)."""

    def __init__(self) -> None:
        self.engines: dict[EngineKey, _EngineSums] | None = None
        self.marks: tuple | None = None
        self.cached: dict[EngineKey, Increase] = {}
        # (key, gauge) -> deque of (entry, value), values non-increasing
        self.peaks: dict[tuple[EngineKey, str], deque] = {}
        # (key, gauge) -> (entries holding it, deque of their (time, value))
        self.series: dict[tuple[EngineKey, str], tuple[deque, deque]] = {}
        self.failed_at: Entry | None = None  # the entry whose step could not be summed

    @staticmethod
    def _marks_of(entries: deque) -> tuple:
        return (len(entries), entries[0] if entries else None, entries[-1] if entries else None)

    def current(self, entries: deque) -> _WindowSums | None:
        marks = self.marks
        if self.engines is not None and marks is not None and marks[0] == len(entries) \
                and (not entries or (marks[1] is entries[0] and marks[2] is entries[-1])):
            return self
        return self._rebuild(entries)

    def _rebuild(self, entries: deque) -> _WindowSums | None:
        if self.failed_at is not None and any(entry is self.failed_at for entry in list(entries)[1:]):
            return None  # the odd step still counts: sum step by step
        self.failed_at = None
        self.engines = {}
        self.cached = {}
        self.peaks = {}
        self.series = {}
        for entry in list(entries)[1:]:
            if not self._add_steps(entry):
                return None
        self.mark(entries)
        return self

    def _add_steps(self, entry: Entry) -> bool:
        try:
            for key, step in entry.steps.items():
                sums = self.engines.get(key)
                if sums is None:
                    sums = self.engines[key] = _EngineSums()
                sums.add(step, entry)
        except (ValueError, OverflowError, TypeError, AttributeError):
            # NaN, infinity, or a value that is no float (a hand-built step)
            self.failed_at = entry
            self.engines = None
            self.marks = None
            return False
        return True

    def mark(self, entries: deque) -> None:
        if self.engines is not None:
            self.marks = self._marks_of(entries)

    def entered(self, entry: Entry, counted: bool) -> None:
        self.cached = {}
        if counted:
            self._add_steps(entry)
        if self.engines is None:
            return
        for (key, gauge), peaks in self.peaks.items():
            _push_peak(peaks, entry, key, gauge)
        for (key, gauge), (holders, points) in self.series.items():
            _push_point(holders, points, entry, key, gauge)

    def left(self, gone: Entry, first: Entry | None) -> None:
        """`gone` left the window; `first` became its first entry, so its
        steps stop counting."""
        self.cached = {}
        if self.engines is None:
            return
        if first is not None:
            for key, step in first.steps.items():
                sums = self.engines[key]
                sums.take(step, first)
                if not sums.steps:
                    del self.engines[key]
        for index, peaks in list(self.peaks.items()):
            if peaks and peaks[0][0] is gone:
                peaks.popleft()
            if not peaks:
                del self.peaks[index]
        for index, (holders, points) in list(self.series.items()):
            if holders and holders[0] is gone:
                holders.popleft()
                points.popleft()
            if not holders:
                del self.series[index]

    def forget_step(self, key: EngineKey, step: Step, entry: Entry) -> None:
        """A counted entry's step of `key` stops counting (the window forgot
        the pair there); entries are forgotten oldest first, as they leave."""
        if self.engines is None:
            return
        sums = self.engines.get(key)
        if sums is None:
            return
        sums.take(step, entry)
        if not sums.steps:
            del self.engines[key]

    def forgot(self, keys: set[EngineKey]) -> None:
        """The window forgot `keys` in some entries: what is kept about them
        is read again from the entries when asked for."""
        self.cached = {}
        for index in [index for index in self.peaks if index[0] in keys]:
            del self.peaks[index]
        for index in [index for index in self.series if index[0] in keys]:
            del self.series[index]

    def increase(self, key: EngineKey) -> Increase:
        found = self.cached.get(key)
        if found is None:
            sums = self.engines.get(key)
            found = self.cached[key] = sums.increase() if sums is not None else Increase()
        # A fresh Increase per call: callers may add to it.
        return Increase(found.seconds, dict(found.counters), dict(found.histograms), found.restarts, found.steps)

    def gauge_max(self, entries: deque, key: EngineKey, gauge: str) -> float | None:
        peaks = self.peaks.get((key, gauge))
        if peaks is None:
            peaks = deque()
            for entry in entries:
                _push_peak(peaks, entry, key, gauge)
            if not peaks:
                return None
            self.peaks[(key, gauge)] = peaks
        return peaks[0][1]


    def gauge_series(self, entries: deque, key: EngineKey, gauge: str) -> list[tuple[float, float]]:
        found = self.series.get((key, gauge))
        if found is None:
            found = (deque(), deque())
            for entry in entries:
                _push_point(*found, entry, key, gauge)
            if not found[0]:
                return []
            self.series[(key, gauge)] = found
        return list(found[1])


def _push_point(holders: deque, points: deque, entry: Entry, key: EngineKey, gauge: str) -> None:
    """Add the entry's value of the gauge, if it has one, to a gauge's series."""
    engine = entry.snapshot.engines.get(key)
    if engine is not None and gauge in engine.gauges:
        holders.append(entry)
        points.append((entry.snapshot.time, engine.gauges[gauge]))


def _push_peak(peaks: deque, entry: Entry, key: EngineKey, gauge: str) -> None:
    """Add the entry's value of the gauge to a monotonic queue of maxima:
    values that a newer, higher one outlasts are dropped, so the front is
    always the window's maximum."""
    engine = entry.snapshot.engines.get(key)
    if engine is not None and gauge in engine.gauges:
        value = engine.gauges[gauge]
        while peaks and peaks[-1][1] < value:
            peaks.pop()
        peaks.append((entry, value))
