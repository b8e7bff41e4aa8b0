"""One engine's window, read once for every rule: its polls, the one
exhaustion detector, and small helpers for evidence."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from kvwatch.diagnose.thresholds import Thresholds
from kvwatch.stream_report import KVEventsReport
from kvwatch.diagnose.vocabulary import Change, Finding, severity_of
from kvwatch.snapshot import EngineSnapshot, Histogram
from kvwatch.window import EngineKey, EntryFollower, Entry, Increase, Step, Window



class Poll:
    """One engine at one poll, the gauges the rules read taken out once: a
    Poll is built when its window entry arrives and read by every diagnosis
    while the entry stays in the window (300 of them at a 1 s poll)."""

    __slots__ = ("time", "engine", "step", "restarted", "preempted", "usage", "running", "waiting",
                 "waiting_for_capacity", "demand")

    def __init__(self, time: float, engine: EngineSnapshot, step: Step | None):
        gauges = engine.gauges
        self.time = time
        self.engine = engine
        self.step = step  # the increase since the previous poll (None for the engine's first)
        self.restarted = bool(step and step.restarted)
        self.preempted = step.counters.get("preemptions", 0.0) if step is not None else 0.0
        usage = gauges.get("kv_usage")
        self.usage: float | None = None if usage is None else min(1.0, max(0.0, usage))
        self.running: float | None = gauges.get("running")
        self.waiting: float | None = gauges.get("waiting")
        # vLLM 0.20+ splits the queue; "deferred" requests wait on LoRA budget
        # or KV transfer, not on room. Older versions only say "waiting".
        by_reason = gauges.get("waiting_by_reason/capacity")
        self.waiting_for_capacity: float = by_reason if by_reason is not None else (self.waiting or 0.0)
        self.demand: float = (self.running or 0.0) + (self.waiting or 0.0)

    def gauge(self, key: str) -> float | None:
        return self.engine.gauges.get(key)


def polls_of(entry: Entry) -> dict[EngineKey, Poll]:
    """The entry's Polls, one per engine, built on first use."""
    polls = entry.derived.get("polls")
    if polls is None:
        polls = {key: Poll(entry.snapshot.time, engine, entry.steps.get(key))
                 for key, engine in entry.snapshot.engines.items()}
        entry.derived["polls"] = polls
    return polls


class EnginePolls:
    """One engine's Polls over the window, in order, and what the rules read
    of them kept as polls arrive and leave (WindowPolls), so a diagnosis
    reads a 300-poll window without walking it in Python: the values the
    sums add, in the window's order (summed in C by the same `sum`, so the
    same float additions as the walk), counts of the polls a fast read
    cannot take (a missing gauge, a restart), and the running maxima as
    monotonic queues (the front is the first poll with the highest value,
    as `max` picks it). What depends on the thresholds is kept for one set
    of them (`for_limits`)."""

    __slots__ = ("polls", "times", "usage", "running", "waiting", "no_usage", "no_running", "no_usage_or_running",
                 "no_waiting", "restarts", "preempted", "usage_peaks", "waiting_usage_peaks", "counters", "limits",
                 "full", "full_peaks", "unordered", "share_peaks", "unordered_shares")

    def __init__(self) -> None:
        self.polls: deque[Poll] = deque()
        self.times: deque[float] = deque()
        self.usage: deque = deque()
        self.running: deque = deque()
        self.waiting: deque = deque()
        self.no_usage = self.no_running = self.no_usage_or_running = self.no_waiting = self.restarts = 0
        # The queues below start as the shared empty tuple and become deques
        # on their first poll (_pushed, _appended): an empty deque is 760
        # bytes, and a gateway that names one model per request makes an
        # EnginePolls per name and poll, most of whose queues stay empty.
        self.preempted: deque[Poll] | tuple = _EMPTY  # polls whose step preempted
        self.usage_peaks: deque | tuple = _EMPTY  # (poll, usage)
        self.waiting_usage_peaks: deque | tuple = _EMPTY  # (poll, usage) of polls with requests waiting
        # counter key -> its step's value at every poll (0.0 where none): built when first read
        self.counters: dict[str, deque] = {}
        self.limits: tuple | None = None  # (exhaustion_usage_ratio, max_num_seqs) of the next four
        self.full: deque[Poll] | tuple = _EMPTY  # the exhaustion detector's full polls
        self.full_peaks: deque | tuple = _EMPTY  # (poll, (demand, usage)) of the full polls
        self.unordered = 0  # full polls whose demand is NaN: no order, so no queue
        self.share_peaks: deque | tuple = _EMPTY  # (poll, usage / running) of polls at the usage threshold
        self.unordered_shares = 0  # of those, the ones whose share is NaN

    def entered(self, poll: Poll) -> None:
        self.polls.append(poll)
        self.times.append(poll.time)
        usage, running, waiting = poll.usage, poll.running, poll.waiting
        self.usage.append(usage)
        self.running.append(running)
        self.waiting.append(waiting)
        self.no_usage += usage is None
        self.no_running += running is None
        self.no_usage_or_running += usage is None or running is None
        self.no_waiting += waiting is None
        self.restarts += poll.restarted
        if poll.preempted > 0:
            self.preempted = _appended(self.preempted, poll)
        if usage is not None:
            self.usage_peaks = _pushed(self.usage_peaks, poll, usage)
            if (waiting or 0) > 0:
                self.waiting_usage_peaks = _pushed(self.waiting_usage_peaks, poll, usage)
        step = poll.step
        for key, values in self.counters.items():
            values.append(step.counters.get(key, 0.0) if step is not None else 0.0)
        if self.limits is not None:
            self._enter_limited(poll)

    def left(self, poll: Poll) -> None:
        """`poll`, the engine's oldest, left the window."""
        self.polls.popleft()
        self.times.popleft()
        self.usage.popleft()
        self.running.popleft()
        self.waiting.popleft()
        usage, running = poll.usage, poll.running
        self.no_usage -= usage is None
        self.no_running -= running is None
        self.no_usage_or_running -= usage is None or running is None
        self.no_waiting -= poll.waiting is None
        self.restarts -= poll.restarted
        for queue in (self.preempted, self.full):
            if queue and queue[0] is poll:
                queue.popleft()  # type: ignore[union-attr]  # not empty: a deque
        for queue in (self.usage_peaks, self.waiting_usage_peaks, self.full_peaks, self.share_peaks):
            if queue and queue[0][0] is poll:  # type: ignore[index]
                queue.popleft()  # type: ignore[union-attr]  # not empty: a deque
        for values in self.counters.values():
            values.popleft()
        if self.limits is not None:
            if self._full(poll) and poll.demand != poll.demand:
                self.unordered -= 1
            share = self._share(poll)
            if share is not None and share != share:
                self.unordered_shares -= 1

    def counter_values(self, key: str) -> deque:
        values = self.counters.get(key)
        if values is None:
            values = self.counters[key] = deque(
                [p.step.counters.get(key, 0.0) if p.step is not None else 0.0 for p in self.polls])
        return values

    def for_limits(self, limit: float, slots) -> "EnginePolls":
        if self.limits != (limit, slots):
            self.limits = (limit, slots)
            self.full, self.full_peaks, self.share_peaks = _EMPTY, _EMPTY, _EMPTY
            self.unordered = self.unordered_shares = 0
            for poll in self.polls:
                self._enter_limited(poll)
        return self

    def _full(self, p: Poll) -> bool:
        """The exhaustion detector's test of one poll (EngineContext.exhaustion)."""
        limit, slots = self.limits  # type: ignore[misc]  # set before any poll is judged
        return (p.usage is not None and p.usage >= limit and p.waiting_for_capacity > 0
                and not (slots is not None and (p.running or 0) >= slots))

    def _enter_limited(self, poll: Poll) -> None:
        if self._full(poll):
            self.full = _appended(self.full, poll)
            if poll.demand != poll.demand:
                self.unordered += 1
            else:
                self.full_peaks = _pushed(self.full_peaks, poll, (poll.demand, poll.usage or 0.0))
        share = self._share(poll)
        if share is not None:
            if share != share:
                self.unordered_shares += 1
            else:
                self.share_peaks = _pushed(self.share_peaks, poll, share)

    def _share(self, p: Poll) -> float | None:
        """The share of the cache one running request held at a poll at the
        usage threshold (exhaustion.exhaustion_findings' full_shares)."""
        return p.usage / p.running if p.usage is not None and p.usage >= self.limits[0] and p.running else None  # type: ignore[index]

    def full_share_max(self) -> tuple[bool, float | None]:
        """(known, the highest share) of the polls at the usage threshold;
        unknown while a share is NaN (no order)."""
        if self.unordered_shares:
            return False, None
        return True, self.share_peaks[0][1] if self.share_peaks else None


_EMPTY: tuple = ()


def _appended(queue: deque | tuple, poll: Poll) -> deque:
    """`queue` with `poll` at its end (a deque from the first one on)."""
    if not isinstance(queue, deque):
        return deque((poll,))
    queue.append(poll)
    return queue


def _pushed(peaks: deque | tuple, poll: Poll, value) -> deque:
    """Add a poll to a monotonic queue of maxima: the values a later,
    higher one outlasts leave, equal ones stay, so the front is the first
    poll with the highest value (as `max` picks it). Values never NaN.
    Returns the queue (a deque from the first poll on)."""
    if not isinstance(peaks, deque):
        return deque(((poll, value),))
    while peaks and peaks[-1][1] < value:
        peaks.pop()
    peaks.append((poll, value))
    return peaks


class WindowPolls(EntryFollower):
    """Every engine's EnginePolls over a window, kept in step with its
    entries from one diagnosis to the next (on the window, Window.kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.engines: dict[EngineKey, EnginePolls] = {}

    def reset(self) -> None:
        super().reset()
        self.engines = {}

    def entered(self, previous: Entry | None, entry: Entry) -> None:
        engines = self.engines
        for key, poll in polls_of(entry).items():
            track = engines.get(key)
            if track is None:
                track = engines[key] = EnginePolls()
            track.entered(poll)

    def left(self, entry: Entry, first: Entry | None) -> None:
        for key, poll in polls_of(entry).items():
            track = self.engines[key]
            track.left(poll)
            if not track.polls:
                del self.engines[key]


def window_polls(window: Window) -> WindowPolls:
    return WindowPolls.of(window, "diagnosis_polls")


def _tail(track: EnginePolls | None, entries) -> list[Poll]:
    """The engine's polls from the first of `entries` on: the part of a
    window's track (its polls in time order) that a following span holds."""
    if track is None or not entries:
        return []
    start = entries[0].snapshot.time
    polls = track.polls
    count = len(polls) - bisect_left(track.times, start)
    return list(islice(reversed(polls), count))[::-1]


@dataclass
class Exhaustion:
    """What the one exhaustion detector saw for an engine."""

    full_polls: list[Poll]
    peak: Poll | None
    preemptions: float
    started: float  # time of the first poll that was full or had preempted


class EngineContext:
    """One engine's window, read once for all rules.

    With `incremental` (the default) the polls and what the rules sum and
    compare over them come from the window's EnginePolls, kept as polls
    arrive and leave; without, every read walks the polls (the full
    evaluation, which stays the definition: tests/test_incremental_diagnosis.py
    requires the same signals, findings and evidence both ways at every poll
    of every real recording)."""

    incremental = True

    def __init__(self, window: Window, row, thresholds: Thresholds, changes: list["Change"] | None = None,
                 hit_memory: "HitRateMemory | None" = None):
        self.changes = changes or []
        self.hit_memory = hit_memory  # the last healthy hit ratio per engine, beyond the window
        self.t = thresholds
        self.model = row.model
        self.engine = row.engine
        self.key = (row.model, row.engine)
        self.view = row.view
        self.values = row.values
        self.increase: Increase = row.view.increase
        key = self.key
        entries = window.entries
        self.track: EnginePolls | None = None
        self.polls: list[Poll]
        if self.incremental and window.followed is not None:
            # A span that follows a window (the now span): its polls are the
            # tail of the window's own, read by walking them (a few, over a
            # short span), so no second per-engine track is kept.
            self.polls = _tail(window_polls(window.followed).engines.get(key), entries)
        elif self.incremental:
            self.track = window_polls(window).engines.get(key)
            if self.track is None:
                self.track = EnginePolls()
            self.polls = list(self.track.polls)
        else:
            self.polls = [poll for entry in entries if (poll := polls_of(entry).get(key)) is not None]
        # The oldest entry's step reaches back past the window: its counters
        # (preemptions included) never count.
        self.skipped = 1 if self.polls and entries[0].snapshot.engines.get(key) is not None else 0
        self.counted: list[Poll] = self.polls[1:] if self.skipped else self.polls
        latest = window.latest
        self.cache_config: dict[str, str] = latest.cache_config.get(row.engine, {}) if latest else {}
        self.capacity_tokens: float | None = row.view.capacity_tokens
        self._exhaustion: Exhaustion | None | bool = False
        self.hit_rate: HitRateVerdict | None = None  # judged once, by hit_rate.verdict
        # The engine's KV-cache event stream report (kvwatch/kvevents) where it is this engine's.
        self.stream: KVEventsReport | None = None

    def value(self, name: str):
        return self.values.get(name)

    def counters_since(self, since: float, keys: tuple[str, ...], until: float | None = None) -> dict[str, float]:
        """The increase of a few counters after `since` (up to `until`), from
        the window's stored steps (cheaper than a whole Increase with its
        histograms), each summed in window order by `sum` from 0.0."""
        track = self.track
        if track is not None:
            times = track.times
            start = max(self.skipped, bisect_right(times, since))
            end = len(times) if until is None else bisect_right(times, until)
            return {key: sum(islice(track.counter_values(key), start, end), 0.0) if end > start else 0.0
                    for key in keys}
        steps = [poll.step.counters for poll in self.counted if poll.time > since
                 and (until is None or poll.time <= until) and poll.step is not None]
        return {key: sum([counters.get(key, 0.0) for counters in steps], 0.0) for key in keys}

    def usage_in(self, since: float | None = None, until: float | None = None) -> tuple[float | None, float | None]:
        """The highest and the mean KV usage of the polls after `since` (up
        to `until`) that report it."""
        track = self.track
        if track is not None and not track.no_usage:
            start = 0 if since is None else bisect_right(track.times, since)
            end = len(track.times) if until is None else bisect_right(track.times, until)
            if end <= start:
                return None, None
            if start == 0 and end == len(track.times):
                return track.usage_peaks[0][1], sum(track.usage) / end
            values = list(islice(track.usage, start, end))
            return max(values), sum(values) / len(values)
        values = [p.usage for p in self.polls if p.usage is not None and (since is None or p.time > since)
                  and (until is None or p.time <= until)]
        if not values:
            return None, None
        return max(values), sum(values) / len(values)

    def restarted_polls(self) -> list[int]:
        """The positions of the polls whose step is a restart."""
        if self.track is not None and not self.track.restarts:
            return []
        return [i for i, p in enumerate(self.polls) if p.restarted]

    def histogram(self, key: str) -> Histogram | None:
        histogram = self.increase.histograms.get(key)
        return histogram if histogram is not None and histogram.count > 0 else None

    def finding(self, symptom: str, cause: str, confidence: str, summary: str, evidence: dict[str, Any],
                next_check: str, *, preempting: bool = False, advisory: bool = False,
                alternatives: tuple = ()) -> Finding:
        """A finding whose severity comes from its cause's record (causes.py):
        `preempting` raises an exhaustion cause to its preempting severity;
        `advisory` marks a warning sign seen before any harm (info);
        `alternatives` are the causes the data cannot tell from this one
        (arbitration.alternative)."""
        severity = "info" if advisory else severity_of(cause, preempting)
        return Finding(symptom, cause, severity, confidence, self.model, self.engine, summary,
                       tidy(evidence), next_check, alternatives=tuple(alternatives))

    @property
    def exhaustion(self) -> Exhaustion | None:
        """KV exhaustion in the window: a poll with usage at the threshold while
        requests waited for capacity and the batch was below max_num_seqs, or
        any preemption (the V1 scheduler preempts only when it cannot allocate
        a KV block)."""
        if self._exhaustion is False:
            limit = self.t.exhaustion_usage_ratio
            # With the batch at --max-num-seqs, requests wait for a slot, not
            # for blocks, however full the cache is (known only when set).
            slots = self.t.max_num_seqs
            track = self.track.for_limits(limit, slots) if self.track is not None else None
            if track is not None:
                full = list(track.full)
            else:
                full = [p for p in self.polls if p.usage is not None and p.usage >= limit
                        and p.waiting_for_capacity > 0 and not (slots is not None and (p.running or 0) >= slots)]
            preemptions = self.increase.counters.get("preemptions", 0.0)
            if not full and preemptions <= 0:
                self._exhaustion = None
            elif track is not None and not (full and track.unordered):
                # The same choices as below, from the kept queues (times only grow).
                peak = (track.full_peaks if full else track.usage_peaks)[0][0] if (
                    full or track.usage_peaks) else None
                preempted = track.preempted
                counted_preempted = preempted[0] if preempted and not (
                    self.skipped and preempted[0] is self.polls[0]) else (
                    preempted[1] if len(preempted) > 1 else None)
                first = [p.time for p in (full[0] if full else None, counted_preempted) if p is not None]
                started = min(first) if first else (self.polls[0].time if self.polls else 0.0)
                self._exhaustion = Exhaustion(full, peak, preemptions, started)
            else:
                if full:
                    peak = max(full, key=lambda p: (p.demand, p.usage or 0.0))
                else:
                    with_usage = [p for p in self.polls if p.usage is not None]
                    peak = max(with_usage, key=lambda p: p.usage or 0.0) if with_usage else None
                first = [p.time for p in full] + [p.time for p in self.counted if p.preempted > 0]
                started = min(first) if first else (self.polls[0].time if self.polls else 0.0)
                self._exhaustion = Exhaustion(full, peak, preemptions, started)
        return self._exhaustion  # type: ignore[return-value]


class HitRateMemory:
    """Each engine's last healthy hit ratio and when it was seen, kept beyond
    the window (the monitor holds one for the life of the process): a ratio
    that fell stays a regression after the low part fills the window, until
    reuse comes back. The rules keep the same memory in recording rules
    (kvwatch/mixin/promql.py Fragments.memory_rules). Bounded in engines and
    in bytes (entry_bytes: the model and engine names are label values, as
    long as a page admits): the engines seen longest ago are forgotten first.
    An engine whose names alone are over the byte bound is not remembered."""

    ENTRY_BYTES = 400  # a dict slot, the key tuple, the value tuple, two floats, two str headers (CPython 3.11)

    def __init__(self, max_engines: int = 1024, max_bytes: int = 1024 * 1024):
        self.max_engines = max_engines
        self.max_bytes = max_bytes
        self.bytes = 0
        self._healthy: dict[tuple[str, str], tuple[float, float]] = {}

    @classmethod
    def entry_bytes(cls, key: tuple[str, str]) -> int:
        return cls.ENTRY_BYTES + len(key[0]) + len(key[1])

    def remember(self, key: tuple[str, str], ratio: float, time: float) -> None:
        cost = self.entry_bytes(key)
        if self._healthy.pop(key, None) is not None:
            self.bytes -= cost
        if cost > self.max_bytes:
            return
        self._healthy[key] = (ratio, time)
        self.bytes += cost
        while len(self._healthy) > self.max_engines or self.bytes > self.max_bytes:
            oldest = next(iter(self._healthy))
            del self._healthy[oldest]
            self.bytes -= self.entry_bytes(oldest)

    def recall(self, key: tuple[str, str], now: float | None = None,
               max_age: float | None = None) -> tuple[float, float] | None:
        """The last healthy (ratio, time), or None once older than `max_age`:
        a baseline from another workload's stretch is no baseline."""
        found = self._healthy.get(key)
        if found is not None and now is not None and max_age is not None and now - found[1] > max_age:
            return None
        return found


@dataclass
class HitRateVerdict:
    """The hit-rate rule's decision for one engine: its finding, if any, and
    what the exhaustion finding carries about the hit ratio (the ratio, and
    why no low-hit-rate cause stands beside the exhaustion)."""

    findings: list[Finding] = field(default_factory=list)
    exhaustion_evidence: dict[str, Any] = field(default_factory=dict)


def tidy(evidence: dict[str, Any]) -> dict[str, Any]:
    """Drop unknowns and round to 4 significant digits: evidence is read by
    people, and 0.30000000000000004 helps nobody. A figure of 1,000 or more
    keeps every digit of its whole part (a capacity of 16,384 tokens must not
    read 16,380 beside the signal that says 16,384)."""
    tidy = {}
    for key, value in evidence.items():
        if value is None:
            continue
        if isinstance(value, float):
            # Most of a poll's figures (thresholds, capacities, the window's
            # means of idle engines) are the ones the poll before rounded:
            # looked up, not formatted again. Equal floats round alike (0.0
            # and -0.0 both to 0); NaN is never found, so never kept.
            rounded = _ROUNDED.get(value)
            if rounded is None:
                if not math.isfinite(value):
                    continue
                rounded = _round_figure(value)
                if len(_ROUNDED) >= _ROUNDED_MAX:
                    _ROUNDED.clear()
                _ROUNDED[value] = rounded
            value = rounded
        tidy[key] = value
    return tidy


def _round_figure(value: float) -> float | int:
    """tidy's rounding of one finite figure."""
    if abs(value) >= 1000:
        value = float(round(value))
    else:
        value = float(f"{value:.4g}")
    if value.is_integer() and abs(value) < 1e15:
        return int(value)
    return value


# Figures tidy rounded, by value: a few hundred a poll at 8 engines, emptied
# when full rather than kept in order of use (a poll refills what it reads).
_ROUNDED: dict[float, float | int] = {}
_ROUNDED_MAX = 4096


def share(part: float | None, whole: float | None) -> float | None:
    if part is None or not whole:
        return None
    return part / whole


def quantile_value(histogram: Histogram | None, q: float) -> tuple[float | None, str | None]:
    if histogram is None:
        return None, None
    quantile = histogram.quantile(q)
    if quantile is None:
        return None, None
    return quantile.value, quantile.pinned



def max_num_seqs(ctx: EngineContext) -> tuple[float | None, str]:
    configured = ctx.t.max_num_seqs
    if configured is not None:
        return float(configured), "configured (diagnosis.max_num_seqs)"
    running_max = ctx.view.running_max
    if running_max:
        return running_max, "at least the most requests seen running at once (vLLM does not export max_num_seqs)"
    return None, "unknown (set diagnosis.max_num_seqs)"
