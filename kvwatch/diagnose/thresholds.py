"""The diagnosis' thresholds: every key under `diagnosis:` in the config, its
default and why, and how a given value is checked."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Callable, TypeVar

from kvwatch.units import did_you_mean, parse_duration

_T = TypeVar("_T")


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


def _checked(default: _T, check: Callable[[Any], _T]) -> _T:
    """A field with its default and the check a configured value passes."""
    return field(default=default, metadata={"check": check})


@dataclass(frozen=True)
class Thresholds:
    """The diagnosis' thresholds, one field per key under `diagnosis:` in the
    config; each field's check (in its metadata) says what a configured value
    may be."""

    # --- exhaustion ---
    # KV usage at or above this, with requests waiting for capacity, is a full
    # cache. vLLM counts evictable prefix-cache blocks as free, so usage near 1
    # means blocks held by running requests; one reserved block and rounding to
    # whole blocks keep a truly full cache just under 1 (0.97-0.99 in the real
    # 0.32 captures), and below 0.9 a typical request still finds room.
    exhaustion_usage_ratio: float = _checked(0.9, _ratio)
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
    long_request_capacity_share: float = _checked(0.2, _ratio)
    # The scheduler's --max-num-seqs. vLLM does not export it; when unset the
    # diagnosis uses the most requests seen running at once as a lower bound
    # (the scheduler admitted that many, so its limit is at least that).
    max_num_seqs: int | None = _checked(None, _optional_count)
    # --- slow first token ---
    # Objectives for time to first token over the window. 2 s at p95 is the
    # order of published interactive targets (MLPerf's Llama-2-70B server
    # scenario: TTFT 2 s at p99); 1 s for the mean keeps a chat responsive.
    ttft_p95_seconds: float = _checked(2.0, _seconds)
    ttft_mean_seconds: float = _checked(1.0, _seconds)
    # Fewer first tokens than this in the window and a p95 is one request.
    ttft_min_requests: int = _checked(5, _count)
    # A part of mean TTFT (queue, prefill, the rest) is named as a cause when it
    # is at least this share; at most two parts can pass 0.4, and when none
    # does the largest is named with low confidence.
    ttft_part_share: float = _checked(0.4, _ratio)
    # The upstream stage (retrieval, gateway) is the cause when it is at least
    # this share of upstream + engine TTFT: "the larger part".
    upstream_share: float = _checked(0.5, _ratio)
    # --- low hit rate ---
    # Below one prompt token in five from the cache, prefix caching saves
    # little prefill. Workloads with a shared system prompt or few-shot header
    # typically reach 0.3-0.9; a workload without shared prefixes sits near 0.
    hit_ratio_low: float = _checked(0.2, _ratio)
    # A step drop: the recent ratio at most (1 - this) of the earlier baseline,
    # i.e. halved by default; smaller wobbles come from the request mix.
    hit_drop_fraction: float = _checked(0.5, _ratio)
    # The recent part of the window compared against the earlier baseline (at
    # most half the window, so both parts have data).
    hit_recent_seconds: float = _checked(60.0, _seconds)
    # Fewer queried tokens than this (per part) and the ratio counts a handful
    # of blocks: about two requests of 512 tokens.
    min_query_tokens: int = _checked(1024, _count)
    # Usage at or above this, while the hit ratio falls from a healthy
    # baseline and the cache is not exhausted, leaves too little free room to
    # keep idle cached prefixes until they are reused (evictable blocks count
    # as free, so high usage means running requests crowd them out). While it
    # is exhausted, only vLLM's residency histograms name eviction.
    eviction_usage_ratio: float = _checked(0.8, _ratio)
    # --- fleet (across the replicas of one model) ---
    # A replica "has room" when its KV usage stayed at or below this over the
    # window and nothing waits: an exhausted or queueing peer beside it is
    # a routing problem, not a capacity one.
    fleet_room_usage_ratio: float = _checked(0.5, _ratio)
    # A replica whose window hit ratio is below this fraction of its peers'
    # pooled ratio (their summed hits over their summed queries), while the
    # peers reuse at least hit_ratio_low, lost the prefix affinity its peers
    # have: half, so ordinary spread between replicas does not count.
    fleet_affinity_fraction: float = _checked(0.5, _ratio)
    # --- the KV-cache event stream (kv_events; diagnose/stream.py) ---
    # Fewer blocks stored than this in the judged part (hit_recent_seconds)
    # and the stream decides nothing: four requests of 256 tokens at 16 a block.
    stream_min_blocks: int = _checked(64, _count)
    # A tenth of the stored blocks or more stored again after their eviction
    # is recomputation a cache that kept them would have saved: eviction
    # before reuse. A rotation of 12 prefixes through the real tier's cache
    # stored 75 % again; distinct prompts 0 %.
    stored_again_ratio_high: float = _checked(0.1, _ratio)
    # At most this share stored again while blocks are stored: nothing comes
    # back, so a larger cache would not help (no shared prefix, or a changed one).
    stored_again_ratio_none: float = _checked(0.01, _ratio)
    # No event for this long while the engine stored blocks by its page: the
    # stream stopped (an engine that stores nothing sends none); no publisher
    # connected for this long: it never connected.
    kv_events_silence_seconds: float = _checked(60.0, _seconds)
    # --- a stuck engine, a busy one (diagnose/stuck.py, the monitor) ---
    # Running or waiting requests, or KV usage, that do not move for this long
    # while the engine counts no token at all (prompt, generated, decoded) and
    # finishes no request: the engine is stuck, not exhausted. vLLM counts
    # tokens every step and SGLang every log interval (seconds), so three
    # minutes without one, with requests held, is no slow decode; shorter
    # than the default window (5m), so the window can show it.
    stuck_seconds: float = _checked(180.0, _seconds)
    # A page answered this late while requests run or wait: the engine is
    # busy, not down (vLLM answers /metrics 1.5-12 s late under load on the
    # real tier's CPU). Reported with the lateness measured.
    busy_late_seconds: float = _checked(2.0, _seconds)
    # A poll that times out within this long of a page that showed requests
    # running or waiting is a busy engine's late page, not an unreachable
    # engine; past it, nothing recent says it is busy, and it is unreachable.
    busy_timeout_seconds: float = _checked(120.0, _seconds)
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
    finding_hold_seconds: float = _checked(60.0, _hold)
    # Whether a finding is active is judged on the last this-many seconds
    # (diagnose/now.py); the window's figures stay its evidence.
    now_seconds: float = _checked(30.0, _seconds)
    # A hit ratio last healthy longer ago than this is no baseline: another
    # stretch of traffic, not the same traffic's shared prefix that stopped.
    hit_baseline_max_age_seconds: float = _checked(300.0, _seconds)


# Each field's check, read from its metadata: the one list of what a
# configured value may be. A field added without a check fails the import (a
# check that -O keeps), not the first user who configures it.
def field_checks(cls: type) -> dict[str, Callable[[Any], Any]]:
    """Each field's check by name; a TypeError names a field without one."""
    checks = {}
    for each in fields(cls):
        check = each.metadata.get("check")
        if not callable(check):
            raise TypeError(f"threshold {each.name!r} has no check: declare it with _checked(default, check)")
        checks[each.name] = check
    return checks


_CHECKS = field_checks(Thresholds)

DEFAULT_THRESHOLDS = Thresholds()


def validate_thresholds(thresholds: Mapping[str, Any]) -> list[str]:
    """Every problem in a `diagnosis:` mapping at once: unknown keys (with the
    known ones listed) and values of the wrong kind or range."""
    problems = []
    for key, value in thresholds.items():
        check = _CHECKS.get(key)
        if check is None:
            problems.append(f"unknown threshold {key!r}{did_you_mean(key, _CHECKS)} (known: {', '.join(sorted(_CHECKS))})")
            continue
        try:
            check(value)
        except (ValueError, TypeError) as exc:
            problems.append(f"{key}: {exc}")
    return problems


def resolve_thresholds(thresholds: Mapping[str, Any] | Thresholds | None) -> Thresholds:
    """Defaults overlaid with the valid given values (settings already
    rejected invalid ones; a bad value here falls back to its default).
    Thresholds already resolved are returned as they are."""
    if isinstance(thresholds, Thresholds):
        return thresholds
    given = {}
    for key, value in (thresholds or {}).items():
        check = _CHECKS.get(key)
        if check is None:
            continue
        try:
            given[key] = check(value)
        except (ValueError, TypeError):
            pass
    return Thresholds(**given)
