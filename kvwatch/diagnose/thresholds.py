"""The diagnosis' thresholds: every key under `diagnosis:` in the config, its
default and why, and how a given value is checked."""

from __future__ import annotations

import math
from typing import Any, Callable

from kvwatch.units import did_you_mean, parse_duration

DEFAULT_THRESHOLDS: dict[str, Any] = {
    # --- exhaustion ---
    # KV usage at or above this, with requests waiting for capacity, is a full
    # cache. vLLM counts evictable prefix-cache blocks as free, so usage near 1
    # means blocks held by running requests; one reserved block and rounding to
    # whole blocks keep a truly full cache just under 1 (0.97-0.99 in the real
    # 0.32 captures), and below 0.9 a typical request still finds room.
    "exhaustion_usage_ratio": 0.9,
    # A full cache is "a few very long requests" when, over the window, each
    # running request holds at least this share of it (mean usage / mean
    # running: five or fewer requests fill it) and no more requests wait than
    # run (mean waiting <= mean running: few requests in all), and "too many
    # requests" otherwise. The generated alert rules use the same definition
    # over their rate window. Ordinary chat requests hold a few percent of a
    # production cache; in the real capture the 900-token prompts held about
    # 24 % each with 2 waiting, the 400+400-token burst 17 % each with 18
    # waiting (at times over 20 %, as preemption thins the batch: the queue
    # is what tells it apart).
    "long_request_capacity_share": 0.2,
    # The scheduler's --max-num-seqs. vLLM does not export it; when unset the
    # diagnosis uses the most requests seen running at once as a lower bound
    # (the scheduler admitted that many, so its limit is at least that).
    "max_num_seqs": None,
    # --- slow first token ---
    # Objectives for time to first token over the window. 2 s at p95 is the
    # order of published interactive targets (MLPerf's Llama-2-70B server
    # scenario: TTFT 2 s at p99); 1 s for the mean keeps a chat responsive.
    "ttft_p95_seconds": 2.0,
    "ttft_mean_seconds": 1.0,
    # Fewer first tokens than this in the window and a p95 is one request.
    "ttft_min_requests": 5,
    # A part of mean TTFT (queue, prefill, the rest) is named as a cause when it
    # is at least this share; at most two parts can pass 0.4, and when none
    # does the largest is named with low confidence.
    "ttft_part_share": 0.4,
    # The upstream stage (retrieval, gateway) is the cause when it is at least
    # this share of upstream + engine TTFT: "the larger part".
    "upstream_share": 0.5,
    # --- low hit rate ---
    # Below one prompt token in five from the cache, prefix caching saves
    # little prefill. Workloads with a shared system prompt or few-shot header
    # typically reach 0.3-0.9; a workload without shared prefixes sits near 0.
    "hit_ratio_low": 0.2,
    # A step drop: the recent ratio at most (1 - this) of the earlier baseline,
    # i.e. halved by default; smaller wobbles come from the request mix.
    "hit_drop_fraction": 0.5,
    # The recent part of the window compared against the earlier baseline (at
    # most half the window, so both parts have data).
    "hit_recent_seconds": 60.0,
    # Fewer queried tokens than this (per part) and the ratio counts a handful
    # of blocks: about two requests of 512 tokens.
    "min_query_tokens": 1024,
    # Usage at or above this, while the hit ratio falls from a healthy
    # baseline and the cache is not exhausted, leaves too little free room to
    # keep idle cached prefixes until they are reused (evictable blocks count
    # as free, so high usage means running requests crowd them out). While it
    # is exhausted, only vLLM's residency histograms name eviction.
    "eviction_usage_ratio": 0.8,
    # --- fleet (across the replicas of one model) ---
    # A replica "has room" when its KV usage stayed at or below this over the
    # window and nothing waits: an exhausted or queueing peer beside it is
    # a routing problem, not a capacity one.
    "fleet_room_usage_ratio": 0.5,
    # A replica whose window hit ratio is below this fraction of its peers'
    # pooled ratio (their summed hits over their summed queries), while the
    # peers reuse at least hit_ratio_low, lost the prefix affinity its peers
    # have: half, so ordinary spread between replicas does not count.
    "fleet_affinity_fraction": 0.5,
    # --- the KV-cache event stream (kv_events; diagnose/stream.py) ---
    # Fewer blocks stored than this in the judged part (hit_recent_seconds)
    # and the stream decides nothing: four requests of 256 tokens at 16 a block.
    "stream_min_blocks": 64,
    # A tenth of the stored blocks or more stored again after their eviction
    # is recomputation a cache that kept them would have saved: eviction
    # before reuse. A rotation of 12 prefixes through the real tier's cache
    # stored 75 % again; distinct prompts 0 %.
    "stored_again_ratio_high": 0.1,
    # At most this share stored again while blocks are stored: nothing comes
    # back, so a larger cache would not help (no shared prefix, or a changed one).
    "stored_again_ratio_none": 0.01,
    # No event for this long while the engine stored blocks by its page: the
    # stream stopped (an engine that stores nothing sends none); no publisher
    # connected for this long: it never connected.
    "kv_events_silence_seconds": 60.0,
    # --- a stuck engine, a busy one (diagnose/stuck.py, the monitor) ---
    # Running or waiting requests, or KV usage, that do not move for this long
    # while the engine counts no token at all (prompt, generated, decoded) and
    # finishes no request: the engine is stuck, not exhausted. vLLM counts
    # tokens every step and SGLang every log interval (seconds), so three
    # minutes without one, with requests held, is no slow decode; shorter
    # than the default window (5m), so the window can show it.
    "stuck_seconds": 180.0,
    # A page answered this late while requests run or wait: the engine is
    # busy, not down (vLLM answers /metrics 1.5-12 s late under load on the
    # real tier's CPU). Reported with the lateness measured.
    "busy_late_seconds": 2.0,
    # A poll that times out within this long of a page that showed requests
    # running or waiting is a busy engine's late page, not an unreachable
    # engine; past it, nothing recent says it is busy, and it is unreachable.
    "busy_timeout_seconds": 120.0,
    # --- every finding ---
    # A finding stays active until its condition has been clear for this long
    # (from the first poll that found it clear), reported as clearing
    # meanwhile; it returns to plain active if the condition holds again.
    # Rules judge a window, and a window's quantiles, shares and counts cross
    # their thresholds by noise: a full cache lets so few requests reach a
    # first token that a 1m window held 4 of them for one poll (below
    # ttft_min_requests) and the KV-bound queue vanished mid-exhaustion. The
    # generated alert rules carry the same value as keep_firing_for, which
    # Prometheus measures the same way, so a finding and its alert resolve
    # together. 1m bridges a lapse of one rule evaluation at the usual 1m
    # interval; a real clearing is resolved at most a hold plus one poll later.
    "finding_hold_seconds": 60.0,
    # Whether a finding is active is judged on the last this-many seconds
    # (diagnose/now.py); the window's figures stay its evidence.
    "now_seconds": 30.0,
    # A hit ratio last healthy longer ago than this is no baseline: another
    # stretch of traffic, not the same traffic's shared prefix that stopped.
    "hit_baseline_max_age_seconds": 300.0,
}



def _ratio(value: Any) -> float:
    number = _plain_number(value)
    if not 0.0 < number <= 1.0:
        raise ValueError(f"{value!r} must be a ratio in (0, 1]")
    return number


def _seconds(value: Any) -> float:
    return parse_duration(value)


def _hold(value: Any) -> float:
    # 0 turns the hold off (a finding ends at the first poll that finds it clear).
    if not isinstance(value, bool) and value in (0, "0", "0s"):
        return 0.0
    return parse_duration(value)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise ValueError(f"{value!r} must be a positive integer")
    return int(value)


def _optional_count(value: Any) -> int | None:
    return None if value is None else _count(value)


def _plain_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a number")
    return float(value)


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "exhaustion_usage_ratio": _ratio,
    "long_request_capacity_share": _ratio,
    "max_num_seqs": _optional_count,
    "ttft_p95_seconds": _seconds,
    "ttft_mean_seconds": _seconds,
    "ttft_min_requests": _count,
    "ttft_part_share": _ratio,
    "upstream_share": _ratio,
    "hit_ratio_low": _ratio,
    "hit_drop_fraction": _ratio,
    "hit_recent_seconds": _seconds,
    "min_query_tokens": _count,
    "eviction_usage_ratio": _ratio,
    "fleet_room_usage_ratio": _ratio,
    "fleet_affinity_fraction": _ratio,
    "stream_min_blocks": _count,
    "stored_again_ratio_high": _ratio,
    "stored_again_ratio_none": _ratio,
    "kv_events_silence_seconds": _seconds,
    "stuck_seconds": _seconds,
    "busy_late_seconds": _seconds,
    "busy_timeout_seconds": _seconds,
    "finding_hold_seconds": _hold,
    "now_seconds": _seconds,
    "hit_baseline_max_age_seconds": _seconds,
}
if set(_PARSERS) != set(DEFAULT_THRESHOLDS):  # a check -O keeps: a threshold nothing parses, or the reverse
    raise TypeError(f"thresholds without a parser or a default: {sorted(set(_PARSERS) ^ set(DEFAULT_THRESHOLDS))}")


def validate_thresholds(thresholds: dict[str, Any]) -> list[str]:
    """Every problem in a `diagnosis:` mapping at once: unknown keys (with the
    known ones listed) and values of the wrong kind or range."""
    problems = []
    for key, value in thresholds.items():
        parser = _PARSERS.get(key)
        if parser is None:
            problems.append(f"unknown threshold {key!r}{did_you_mean(key, _PARSERS)} (known: {', '.join(sorted(_PARSERS))})")
            continue
        try:
            parser(value)
        except (ValueError, TypeError) as exc:
            problems.append(f"{key}: {exc}")
    return problems


def resolve_thresholds(thresholds: dict[str, Any] | None) -> dict[str, Any]:
    """Defaults overlaid with the valid given values (settings already
    rejected invalid ones; a bad value here falls back to its default)."""
    resolved = dict(DEFAULT_THRESHOLDS)
    for key, value in (thresholds or {}).items():
        parser = _PARSERS.get(key)
        if parser is None:
            continue
        try:
            resolved[key] = parser(value)
        except (ValueError, TypeError):
            pass
    return resolved
