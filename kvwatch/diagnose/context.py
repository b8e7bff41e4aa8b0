"""One engine's window, read once for every rule: its polls, the one
exhaustion detector, and small helpers for evidence."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvwatch.diagnose.vocabulary import Finding, severity_of
from kvwatch.snapshot import EngineSnapshot, Histogram
from kvwatch.window import EngineKey, Entry, Increase, Step, Window

if TYPE_CHECKING:
    from kvwatch.diagnose.changes import Change
    from kvwatch.diagnose.hit_rate import HitRateMemory, HitRateVerdict


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


@dataclass
class Exhaustion:
    """What the one exhaustion detector saw for an engine."""

    full_polls: list[Poll]
    peak: Poll | None
    preemptions: float
    started: float  # time of the first poll that was full or had preempted


class EngineContext:
    """One engine's window, read once for all rules."""

    def __init__(self, window: Window, row, thresholds: dict[str, Any], changes: list["Change"] | None = None,
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
        self.polls: list[Poll] = [poll for entry in entries if (poll := polls_of(entry).get(key)) is not None]
        # The oldest entry's step reaches back past the window: its counters
        # (preemptions included) never count.
        self.counted: list[Poll] = (self.polls[1:] if self.polls and entries[0].snapshot.engines.get(key) is not None
                                    else self.polls)
        latest = window.latest
        self.cache_config: dict[str, str] = latest.cache_config.get(row.engine, {}) if latest else {}
        self.capacity_tokens: float | None = row.view.capacity_tokens
        self._exhaustion: Exhaustion | None | bool = False
        self.hit_rate: HitRateVerdict | None = None  # judged once, by hit_rate.verdict
        # The engine's KV-cache event stream report (kvwatch/kvevents) where it is this engine's.
        self.stream: dict[str, Any] | None = None

    def value(self, name: str):
        return self.values.get(name)

    def counters_since(self, since: float, keys: tuple[str, ...], until: float | None = None) -> dict[str, float]:
        """The increase of a few counters after `since` (up to `until`), from
        the window's stored steps (cheaper than a whole Increase with its
        histograms)."""
        total = dict.fromkeys(keys, 0.0)
        for poll in self.counted:
            if poll.time <= since or (until is not None and poll.time > until) or poll.step is None:
                continue
            counters = poll.step.counters
            for key in keys:
                total[key] += counters.get(key, 0.0)
        return total

    def histogram(self, key: str) -> Histogram | None:
        histogram = self.increase.histograms.get(key)
        return histogram if histogram is not None and histogram.count > 0 else None

    def finding(self, symptom: str, cause: str, confidence: str, summary: str, evidence: dict[str, Any],
                next_check: str, *, preempting: bool = False, advisory: bool = False,
                alternatives: tuple = ()) -> Finding:
        """A finding whose severity comes from the one table (vocabulary.SEVERITY):
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
            limit = self.t["exhaustion_usage_ratio"]
            # With the batch at --max-num-seqs, requests wait for a slot, not
            # for blocks, however full the cache is (known only when set).
            slots = self.t["max_num_seqs"]
            full = [p for p in self.polls if p.usage is not None and p.usage >= limit and p.waiting_for_capacity > 0
                    and not (slots is not None and (p.running or 0) >= slots)]
            preemptions = self.increase.counters.get("preemptions", 0.0)
            if not full and preemptions <= 0:
                self._exhaustion = None
            else:
                if full:
                    peak = max(full, key=lambda p: (p.demand, p.usage or 0.0))
                else:
                    with_usage = [p for p in self.polls if p.usage is not None]
                    peak = max(with_usage, key=lambda p: p.usage) if with_usage else None
                first = [p.time for p in full] + [p.time for p in self.counted if p.preempted > 0]
                started = min(first) if first else (self.polls[0].time if self.polls else 0.0)
                self._exhaustion = Exhaustion(full, peak, preemptions, started)
        return self._exhaustion  # type: ignore[return-value]


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
            if not math.isfinite(value):
                continue
            if abs(value) >= 1000:
                value = float(round(value))
            else:
                value = float(f"{value:.4g}")
            if value.is_integer() and abs(value) < 1e15:
                value = int(value)
        tidy[key] = value
    return tidy


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
    configured = ctx.t["max_num_seqs"]
    if configured is not None:
        return float(configured), "configured (diagnosis.max_num_seqs)"
    running_max = ctx.view.running_max
    if running_max:
        return running_max, "at least the most requests seen running at once (vLLM does not export max_num_seqs)"
    return None, "unknown (set diagnosis.max_num_seqs)"
