"""Running sums of the window's steps, per engine, kept up to date as
snapshots arrive and leave (one step added and one taken away per poll), so
reading a window costs the same at 10 polls as at 3,600; and the running
maxima and series of its gauges. The sums are exact (integers, and fixed
point at 2**-1074 for fractions, so adding and taking away never drifts);
read back, each is the correctly rounded sum of the steps, which is what
summing the steps one by one gives whenever that is exact (always, for
counts below 2**53). A step holding an infinite or NaN value is summed one
by one instead, until it leaves the window.
"""

from __future__ import annotations

import operator
from collections import deque

from kvwatch.snapshot import Histogram
from kvwatch.window.steps import EngineKey, Entry, Increase, Step

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
        self.exact: list[_ExactSum] = []  # filled when counts become None
        self.sum = _ExactSum()
        self.count = _ExactSum()
        self.add(histogram)

    def add(self, histogram: Histogram) -> None:
        cumulative = histogram.cumulative
        counts = self.counts
        summed_as_floats = False
        if counts is not None:
            # min() after is_integer (no NaN left), max() of the sums: a sum
            # that rounded is at least 2**53.
            if all(map(float.is_integer, cumulative)) and (not cumulative or min(cumulative) >= 0):
                summed = tuple(map(operator.add, counts, cumulative))
                if not summed or max(summed) < _EXACT_FLOATS:
                    self.counts = summed
                    summed_as_floats = True
            if not summed_as_floats:
                self._to_exact()
        if not summed_as_floats:
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
        for value in self.counts or ():
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

    __slots__ = ("counters", "histograms", "seconds", "restarts", "steps", "left_out")

    def __init__(self, left_out: frozenset[str] = frozenset()) -> None:
        self.left_out = left_out  # histograms not summed (_WindowSums)
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
        left_out = self.left_out
        for key, histogram in step.histograms.items():
            if key in left_out:
                continue
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

    def __init__(self, left_out: frozenset[str] = frozenset()) -> None:
        # Histogram keys not summed: no reader of the window reads their increase.
        self.left_out = left_out
        self.engines: dict[EngineKey, _EngineSums] | None = None
        self.marks: tuple | None = None
        self.cached: dict[EngineKey, Increase] = {}
        # (key, gauge) -> deque of (entry, value), values non-increasing
        self.peaks: dict[tuple[EngineKey, str], deque] = {}
        # (key, gauge) -> the entries holding it and their times and values
        self.series: dict[tuple[EngineKey, str], _GaugeSeries] = {}
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
        engines = self.engines
        if engines is None:
            return False
        try:
            for key, step in entry.steps.items():
                sums = engines.get(key)
                if sums is None:
                    sums = engines[key] = _EngineSums(self.left_out)
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
        for (key, gauge), series in self.series.items():
            series.push(entry, key, gauge)

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
        for index, series in list(self.series.items()):
            if series.holders and series.holders[0] is gone:
                series.pop()
            if not series.holders:
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
            sums = self.engines.get(key) if self.engines is not None else None
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
        found = self.gauge_columns(entries, key, gauge)
        return list(zip(found.times, found.values)) if found is not None else []

    def gauge_columns(self, entries: deque, key: EngineKey, gauge: str) -> "_GaugeSeries | None":
        found = self.series.get((key, gauge))
        if found is None:
            found = _GaugeSeries()
            for entry in entries:
                found.push(entry, key, gauge)
            if not found.holders:
                return None
            self.series[(key, gauge)] = found
        return found


class _GaugeSeries:
    """One engine's gauge over the window: the entries that hold it, their
    times and its values, in window order; and, kept as points arrive and
    leave, how many neighbouring times do not increase and how many values
    lie outside 0..1 (or are NaN), so a reader learns both without a pass
    over the series."""

    __slots__ = ("holders", "times", "values", "unordered", "outside")

    def __init__(self) -> None:
        self.holders: deque[Entry] = deque()
        self.times: deque[float] = deque()
        self.values: deque[float] = deque()
        self.unordered = 0
        self.outside = 0

    def push(self, entry: Entry, key: EngineKey, gauge: str) -> None:
        """Add the entry's value of the gauge, if it has one."""
        engine = entry.snapshot.engines.get(key)
        if engine is not None and gauge in engine.gauges:
            time, value = entry.snapshot.time, engine.gauges[gauge]
            times = self.times
            if times and not times[-1] < time:
                self.unordered += 1
            if not 0.0 <= value <= 1.0:
                self.outside += 1
            self.holders.append(entry)
            times.append(time)
            self.values.append(value)

    def pop(self) -> None:
        """Take the oldest point away."""
        times = self.times
        if len(times) > 1 and not times[0] < times[1]:
            self.unordered -= 1
        if not 0.0 <= self.values[0] <= 1.0:
            self.outside -= 1
        self.holders.popleft()
        times.popleft()
        self.values.popleft()


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
