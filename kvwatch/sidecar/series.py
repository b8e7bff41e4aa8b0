"""Trends over the window the sidecar holds, as JSON for the status page's
charts (`/api/v1/series`): per engine, one point per window entry of KV
usage, waiting, hit ratio, TTFT p95 and its queue/prefill/other split, and
preemptions per second; plus the findings and changes to mark on the time
axis.

Gauges are read at each entry. Rates, ratios and quantiles are taken over the
trailing CHART_RATE_SECONDS before each entry (one step alone holds a handful of
requests at a 5 s poll): the difference of the two cumulative snapshots when
no restart lies between them, else the sum of the steps since (the window's
reset rule). Each entry's points are computed once and kept on the entry
while it stays in the window, so a refresh costs only the newest polls.
"""

from __future__ import annotations

from typing import Any

from kvwatch.diagnose.vocabulary import finding_key
from kvwatch.snapshot import Histogram
from kvwatch.window import Increase

# Not the catalogue's TREND_SECONDS (the exhaustion trend's fit, 5 min): the
# span each chart point's rates and quantiles are taken over.
CHART_RATE_SECONDS = 30.0
# Bounded whatever the window and poll interval: at most this many points per
# series (evenly spaced entries when the window holds more).
MAX_POINTS = 400
SERIES = ("kv_usage", "waiting", "hit_ratio", "ttft_p95", "queue_share", "prefill_share", "other_share",
          "preemptions_per_second")
_CACHE_KEY = "page_series"


def _round(value: float | None) -> float | None:
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return None
    return float(f"{value:.4g}")


def _trailing(entries: list, index: int, start: int, key) -> Increase | None:
    """The increase of one engine from entries[start] to entries[index]."""
    later = entries[index].snapshot.engines.get(key)
    earlier = entries[start].snapshot.engines.get(key)
    if later is None or earlier is None or start >= index:
        return None
    steps = [entries[k].steps.get(key) for k in range(start + 1, index + 1)]
    seconds = entries[index].snapshot.time - entries[start].snapshot.time
    if all(step is not None and not step.restarted for step in steps) and later.created == earlier.created:
        histograms = {}
        for name in ("ttft", "queue_time", "prefill_time"):
            if name in later.histograms and name in earlier.histograms:
                delta = later.histograms[name].minus(earlier.histograms[name])
                if delta is not None:
                    histograms[name] = delta
        counters = {name: later.counters[name] - earlier.counters[name]
                    for name in ("prefix_hits", "prefix_queries", "preemptions")
                    if name in later.counters and name in earlier.counters}
        if all(value >= 0 for value in counters.values()):
            return Increase(seconds=seconds, counters=counters, histograms=histograms)
    total = Increase()
    for step in steps:
        if step is not None:
            total.add(step)
            total.seconds += step.seconds
    return total


def _mean(histogram: Histogram | None) -> float | None:
    return histogram.mean() if histogram is not None else None


def _point(entries: list, index: int, start: int, key) -> dict[str, Any] | None:
    engine = entries[index].snapshot.engines.get(key)
    if engine is None:
        return None
    usage = engine.gauges.get("kv_usage")
    point: dict[str, Any] = {
        "kv_usage": _round(None if usage is None else min(1.0, max(0.0, usage))),
        "waiting": _round(engine.gauges.get("waiting")),
    }
    increase = _trailing(entries, index, start, key)
    if increase is None:
        return point
    point["hit_ratio"] = _round(increase.ratio("prefix_hits", "prefix_queries"))
    point["preemptions_per_second"] = _round(increase.rate("preemptions"))
    ttft = increase.histograms.get("ttft")
    if ttft is not None and ttft.count > 0:
        p95 = ttft.reported_quantile(0.95)
        if p95 is not None:
            point["ttft_p95"] = _round(p95.value)
            if p95.bound:
                point["ttft_p95_pinned"] = p95.bound  # "<" or ">", as in /api/v1/signals' `pinned`
        mean = ttft.mean()
        if mean:
            queue = min(1.0, (_mean(increase.histograms.get("queue_time")) or 0.0) / mean)
            prefill = min(1.0 - queue, (_mean(increase.histograms.get("prefill_time")) or 0.0) / mean)
            point.update(queue_share=_round(queue), prefill_share=_round(prefill),
                         other_share=_round(max(0.0, 1.0 - queue - prefill)))
    return point


def _points(entries: list) -> list[dict]:
    """{engine key: point} per entry, computed once per entry."""
    out = []
    start = 0
    for index, entry in enumerate(entries):
        time = entry.snapshot.time
        while start < index and entries[start + 1].snapshot.time <= time - CHART_RATE_SECONDS:
            start += 1
        cached = entry.derived.get(_CACHE_KEY)
        # A point depends on where its trailing span starts, which only moves
        # when the window drops the entries before it: keep it with that start.
        anchor = entries[start] if start < index else None
        if cached is None or cached[0] is not anchor:
            points = {key: _point(entries, index, start, key) for key in entry.snapshot.engines}
            cached = (anchor, points)
            entry.derived[_CACHE_KEY] = cached
        out.append(cached[1])
    return out


def _markers(state) -> list[dict[str, Any]]:
    markers = [
        {"time": event.time, "kind": "change", "change": event.kind, "model_name": event.model,
         "engine": event.engine, "text": event.detail}
        for event in state.events
    ]
    now = state.snapshot.time if state.snapshot is not None else None
    since = getattr(state, "findings_since", {}) or {}
    for finding in state.findings:
        # Marked where it was first seen (the `since` of /api/v1/diagnosis).
        markers.append({
            "time": since.get(finding_key(finding)) or now, "kind": "finding", "severity": finding.severity,
            "symptom": finding.symptom, "cause": finding.cause, "model_name": finding.model,
            "engine": finding.engine, "text": finding.summary,
        })
    return markers


def series_json(state, settings) -> dict[str, Any]:
    entries = list(state.entries) if state.up else []
    if len(entries) > MAX_POINTS:
        stride = len(entries) / MAX_POINTS
        picked: list[int] | range = sorted({int(i * stride) for i in range(MAX_POINTS)} | {len(entries) - 1})
    else:
        picked = range(len(entries))
    points = _points(entries)
    times = [entries[i].snapshot.time for i in picked]
    keys = sorted(state.snapshot.engines) if state.up and state.snapshot is not None else []
    engines = []
    for key in keys:
        row: dict[str, Any] = {"model_name": key[0], "engine": key[1]}
        for name in SERIES:
            row[name] = [(points[i].get(key) or {}).get(name) for i in picked]
        pinned = [(points[i].get(key) or {}).get("ttft_p95_pinned") for i in picked]
        if any(pinned):
            row["ttft_p95_pinned"] = pinned
        engines.append(row)
    return {
        "window_seconds": settings.window,
        "poll_interval_seconds": settings.poll_interval,
        "trend_seconds": CHART_RATE_SECONDS,
        "max_points": MAX_POINTS,
        "times": times,
        "engines": engines,
        "markers": _markers(state) if state.up else [],
    }
