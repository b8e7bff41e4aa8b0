"""Diagnosis: symptom -> likely cause, with the evidence that decided it and
the next thing to check.

Symptoms and the causes told apart (these `symptom`/`cause` values are also the
labels of `kvwatch_finding` and of the generated alert rules; do not rename):

exhaustion        concurrency_beyond_capacity, long_requests,
                  capacity_below_max_num_seqs
low_hit_rate      caching_disabled, cold_cache, prefix_changed,
                  eviction_before_reuse, no_reuse
slow_first_token  queueing_kv_bound, queueing_compute_bound, prefill,
                  front_end, upstream
change            model_changed, lora_changed, cache_dtype_changed,
                  cache_config_changed, engine_restarted

Rules run per (model, engine): the KV cache, its queue and its counters belong
to one engine core. Every rule reads only the window (so a finding is active
exactly while its evidence is inside the window, like an alert over
`rate(...[5m])`) plus the change events the monitor recorded. One detector
decides whether an engine's KV cache was exhausted, and the exhaustion rules,
the queueing split and the hit-rate rules all use it: exhaustion is never
called compute-bound queueing (nor the reverse), and while the cache is
exhausted a low hit rate is named only on evidence the exhaustion does not
explain (caching off, a restart, a change at the drop, a drop that showed
before the exhaustion, residency histograms). The exhaustion causes are
decided once per window from its means, as the generated alert rule decides
them over its rate window, so the two agree and exactly one of
concurrency_beyond_capacity and long_requests is named.

Findings never claim more than their evidence. A prefix-cache hit means KV
computed for earlier tokens was reused; it proves neither that an answer is
current nor that the caller may see it, and no finding says otherwise.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from kvwatch.snapshot import EngineSnapshot, Histogram, config_number
from kvwatch.window import EngineKey, Entry, Increase, Step, Window

log = logging.getLogger("kvwatch")

SEVERITIES = ("critical", "warning", "info")
CONFIDENCES = ("high", "medium", "low")

# symptom -> causes, in the order the rules consider them.
CAUSES: dict[str, tuple[str, ...]] = {
    "exhaustion": ("concurrency_beyond_capacity", "long_requests", "capacity_below_max_num_seqs"),
    "low_hit_rate": ("caching_disabled", "cold_cache", "prefix_changed", "eviction_before_reuse", "no_reuse"),
    "slow_first_token": ("queueing_kv_bound", "queueing_compute_bound", "prefill", "front_end", "upstream"),
    "change": ("model_changed", "lora_changed", "cache_dtype_changed", "cache_config_changed", "engine_restarted"),
}

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
}


@dataclass(frozen=True)
class Finding:
    symptom: str  # exhaustion | low_hit_rate | slow_first_token | change
    cause: str
    severity: str  # critical | warning | info
    confidence: str  # high | medium | low
    model: str
    engine: str | None
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    next_check: str = ""


# --------------------------------------------------------------------------
# Thresholds
# --------------------------------------------------------------------------


def _ratio(value: Any) -> float:
    number = _plain_number(value)
    if not 0.0 < number <= 1.0:
        raise ValueError(f"{value!r} must be a ratio in (0, 1]")
    return number


def _seconds(value: Any) -> float:
    from kvwatch.settings import parse_duration

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
}
assert set(_PARSERS) == set(DEFAULT_THRESHOLDS)


def validate_thresholds(thresholds: dict[str, Any]) -> list[str]:
    """Every problem in a `diagnosis:` mapping at once: unknown keys (with the
    known ones listed) and values of the wrong kind or range."""
    problems = []
    for key, value in thresholds.items():
        parser = _PARSERS.get(key)
        if parser is None:
            problems.append(f"unknown threshold {key!r} (known: {', '.join(sorted(_PARSERS))})")
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


# --------------------------------------------------------------------------
# Reading the window for one engine
# --------------------------------------------------------------------------


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


def _polls_of(entry: Entry) -> dict[EngineKey, Poll]:
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

    def __init__(self, window: Window, row, thresholds: dict[str, Any], changes: list["Change"] | None = None):
        self.changes = changes or []
        self.t = thresholds
        self.model = row.model
        self.engine = row.engine
        self.key = (row.model, row.engine)
        self.view = row.view
        self.values = row.values
        self.increase: Increase = row.view.increase
        key = self.key
        entries = window.entries
        self.polls: list[Poll] = [poll for entry in entries if (poll := _polls_of(entry).get(key)) is not None]
        # The oldest entry's step reaches back past the window: its counters
        # (preemptions included) never count.
        self.counted: list[Poll] = (self.polls[1:] if self.polls and entries[0].snapshot.engines.get(key) is not None
                                    else self.polls)
        latest = window.latest
        self.cache_config: dict[str, str] = latest.cache_config.get(row.engine, {}) if latest else {}
        self.capacity_tokens: float | None = row.view.capacity_tokens
        self._exhaustion: Exhaustion | None | bool = False
        self._hit_rate: HitRateVerdict | None = None

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

    @property
    def hit_rate(self) -> "HitRateVerdict":
        """The hit-rate rule's verdict, judged once: the low_hit_rate rule
        reports its finding, the exhaustion rule its notes."""
        if self._hit_rate is None:
            self._hit_rate = _judge_hit_rate(self)
        return self._hit_rate

    def finding(self, symptom: str, cause: str, severity: str, confidence: str, summary: str,
                evidence: dict[str, Any], next_check: str) -> Finding:
        return Finding(symptom, cause, severity, confidence, self.model, self.engine, summary,
                       _tidy(evidence), next_check)

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


def _tidy(evidence: dict[str, Any]) -> dict[str, Any]:
    """Drop unknowns and round to 4 significant digits: evidence is read by
    people, and 0.30000000000000004 helps nobody."""
    tidy = {}
    for key, value in evidence.items():
        if value is None:
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                continue
            value = float(f"{value:.4g}")
            if value.is_integer() and abs(value) < 1e15:
                value = int(value)
        tidy[key] = value
    return tidy


def _share(part: float | None, whole: float | None) -> float | None:
    if part is None or not whole:
        return None
    return part / whole


def _quantile_value(histogram: Histogram | None, q: float) -> tuple[float | None, str | None]:
    if histogram is None:
        return None, None
    quantile = histogram.quantile(q)
    if quantile is None:
        return None, None
    return quantile.value, quantile.pinned


# --------------------------------------------------------------------------
# Exhaustion
# --------------------------------------------------------------------------

NEXT_CHECK = {
    "concurrency_beyond_capacity":
        "Compare kvwatch_requests_running_max and waiting with kvwatch_kv_cache_capacity_requests: cap concurrency in "
        "front of the engine near that bound, add replicas, or give the cache more memory (gpu_memory_utilization, a "
        "smaller kv cache dtype, more tensor parallelism).",
    "long_requests":
        "Find the long requests (vllm:request_prompt_tokens and request_generation_tokens p95, the gateway log): cap "
        "max_tokens or max_model_len, or route long-context requests to engines sized for them; more replicas of the "
        "same size help less than sizing for length.",
    "capacity_below_max_num_seqs":
        "Lower --max-num-seqs to about kvwatch_kv_cache_capacity_requests or enlarge the cache, so the scheduler stops "
        "admitting requests it must later preempt; `kvwatch capacity` computes the bound for a model and memory budget.",
    "caching_disabled":
        "If prompts share prefixes (system prompt, few-shot examples, documents), start vLLM with "
        "--enable-prefix-caching; until then hit ratios are not measured.",
    "cold_cache":
        "Expected after a restart: compare hit ratios only after the cache warmed up (a few repeats of each prefix), "
        "and find why the engine restarted (deploy, OOM, crash).",
    "prefix_changed":
        "Diff the prompt templates and system prompts deployed at that time: per-request text (timestamps, ids) placed "
        "before the shared text breaks reuse; keep shared text first and byte-identical.",
    "eviction_before_reuse":
        "Run vLLM with --kv-cache-metrics and compare kv_block_idle_before_evict with kv_block_reuse_gap; give idle "
        "prefixes room (more KV memory, fewer concurrent long requests) or route requests that share a prefix to the "
        "same engine.",
    "no_reuse":
        "Nothing to repair in the cache: these prompts share no prefix. If they should, put the shared text first and "
        "keep it byte-identical across requests.",
    "queueing_kv_bound":
        "The queue waits for KV blocks (see the exhaustion finding): fewer or shorter concurrent requests, or a larger "
        "cache, shorten it.",
    "queueing_compute_bound":
        "The queue waits for compute or scheduler slots, not KV blocks, so a bigger KV cache does not shorten it: add "
        "replicas or lower the arrival rate; check step time, --max-num-seqs and --max-num-batched-tokens.",
    "prefill":
        "Long uncached prompts: raise prefix reuse (shared text first), shorten prompts, tune chunked prefill "
        "(--max-num-batched-tokens) or separate prefill from decode.",
    "front_end":
        "Time outside queue and prefill: tokenization, multimodal preprocessing, API-server CPU, scheduling gaps; "
        "check the API server's CPU and --api-server-count.",
    "upstream":
        "Most of the time to first token is spent before the engine: look at the upstream stage (retrieval, gateway) "
        "named by the histogram; a bigger or smaller KV cache does not repair it.",
    "model_changed":
        "Compare signals only within one model; recheck capacity and thresholds for the new model.",
    "lora_changed":
        "Adapters share the engine's KV cache and batch: compare hit ratios and latency per adapter set, not across "
        "the change.",
    "cache_dtype_changed":
        "Re-evaluate task accuracy on the new KV-cache dtype (a quantised cache can change outputs); capacity and "
        "latency baselines changed too.",
    "cache_config_changed":
        "Baselines from before the change are not comparable: recheck kvwatch_kv_cache_capacity_requests and the "
        "exhaustion evidence against the new block size and capacity.",
    "engine_restarted":
        "Find why it restarted (deploy, OOM, crash in the engine log); its counters restarted from zero and its "
        "prefix cache is cold.",
}


def _max_num_seqs(ctx: EngineContext) -> tuple[float | None, str]:
    configured = ctx.t["max_num_seqs"]
    if configured is not None:
        return float(configured), "configured (diagnosis.max_num_seqs)"
    running_max = ctx.view.running_max
    if running_max:
        return running_max, "at least the most requests seen running at once (vLLM does not export max_num_seqs)"
    return None, "unknown (set diagnosis.max_num_seqs)"


def _length_evidence(ctx: EngineContext) -> dict[str, Any]:
    prompt_p95, _ = _quantile_value(ctx.histogram("prompt_len"), 0.95)
    generated_p95, _ = _quantile_value(ctx.histogram("generation_len"), 0.95)
    return {
        "prompt_tokens_mean": ctx.value("kvwatch_prompt_tokens_per_request_mean"),
        "generation_tokens_mean": ctx.value("kvwatch_generation_tokens_per_request_mean"),
        "prompt_tokens_p95": prompt_p95,
        "generation_tokens_p95": generated_p95,
    }


def _load_shape(ctx: EngineContext) -> dict[str, float | None]:
    """Window means of usage, running and waiting (polls that report usage
    and running), and the share of the cache one running request held: mean
    usage / mean running. The PromQL of the exhaustion alert computes the
    same means with avg_over_time over its rate window."""
    polls = [p for p in ctx.polls if p.usage is not None and p.running is not None]
    if not polls:
        return {"kv_usage_mean": None, "running_mean": None, "waiting_mean": None, "share": None}
    usage = sum(p.usage for p in polls) / len(polls)
    running = sum(p.running for p in polls) / len(polls)
    waiting = sum(p.waiting or 0.0 for p in polls) / len(polls)
    return {"kv_usage_mean": usage, "running_mean": running, "waiting_mean": waiting,
            "share": usage / running if running > 0 else None}


def _exhaustion_findings(ctx: EngineContext) -> list[Finding]:
    state = ctx.exhaustion
    capacity_requests = ctx.value("kvwatch_kv_cache_capacity_requests")
    max_seqs, max_seqs_source = _max_num_seqs(ctx)
    stated_concurrency = config_number(ctx.cache_config, "kv_cache_max_concurrency")
    findings = []

    below = None
    if capacity_requests is not None and max_seqs is not None and capacity_requests < max_seqs:
        # An inferred bound only counts when strictly more requests ran than fit.
        below = max_seqs

    if state is None:
        if below is not None and ctx.t["max_num_seqs"] is not None:
            findings.append(ctx.finding(
                "exhaustion", "capacity_below_max_num_seqs", "info", "medium",
                f"Not exhausted in the window, but at current lengths the cache holds {capacity_requests:g} requests "
                f"and the scheduler admits up to {max_seqs:g}: more concurrency will preempt.",
                {"kv_cache_capacity_requests": capacity_requests, "max_num_seqs": max_seqs,
                 "max_num_seqs_source": max_seqs_source, "kv_cache_max_concurrency_at_max_model_len": stated_concurrency,
                 **_length_evidence(ctx)},
                NEXT_CHECK["capacity_below_max_num_seqs"]))
        return findings

    severity = "critical" if state.preemptions > 0 else "warning"
    usage_now = ctx.value("kvwatch_kv_cache_usage_ratio")
    limit = ctx.t["exhaustion_usage_ratio"]
    long_share = ctx.t["long_request_capacity_share"]
    prompt_mean = ctx.value("kvwatch_prompt_tokens_per_request_mean")
    generated_mean = ctx.value("kvwatch_generation_tokens_per_request_mean")
    request_mean = prompt_mean + generated_mean if prompt_mean is not None and generated_mean is not None else None
    shape = _load_shape(ctx)
    share = shape["share"]
    try:
        hit_evidence = ctx.hit_rate.exhaustion_evidence
    except Exception:  # the hit-rate rule's own failure must not drop this finding
        log.exception("diagnosis: judging the hit rate failed for %s/%s", ctx.model, ctx.engine)
        hit_evidence = {}
    common = {
        "kv_usage_max": ctx.value("kvwatch_kv_cache_usage_max_ratio"),
        "kv_usage_now": usage_now,
        "kv_usage_threshold": limit,
        "preemptions": state.preemptions,
        "preemptions_per_second": ctx.value("kvwatch_preemptions_per_second"),
        "kv_cache_capacity_tokens": ctx.capacity_tokens,
        "kv_cache_capacity_requests": capacity_requests,
        **_length_evidence(ctx),
        "request_tokens_mean": request_mean,
        "kv_usage_mean": shape["kv_usage_mean"],
        "running_mean": shape["running_mean"],
        "waiting_mean": shape["waiting_mean"],
        "capacity_share_per_running_request": share,
        "long_request_capacity_share": long_share,
        **hit_evidence,
        "window_seconds": ctx.increase.seconds,
    }
    ongoing = usage_now is not None and usage_now >= limit

    # One cause per window, decided as the alert rule decides it: a few long
    # requests when each running request held a large share of the cache and
    # no more requests waited than ran; many requests otherwise (also when no
    # poll reported usage and running, with only preemptions to go by).
    long = (share is not None and share >= long_share
            and (shape["waiting_mean"] or 0.0) <= (shape["running_mean"] or 0.0))

    def footprint(poll: Poll) -> float | None:
        running = poll.running
        if poll.usage is None or not running or not ctx.capacity_tokens:
            return None
        return poll.usage * ctx.capacity_tokens / running

    def at_peak(poll: Poll | None) -> dict[str, Any]:
        if poll is None:
            return {}
        return {"peak_seconds_ago": ctx.polls[-1].time - poll.time, "kv_usage_at_peak": poll.usage,
                "running_at_peak": poll.running, "waiting_at_peak": poll.waiting,
                "waiting_for_capacity_at_peak": poll.waiting_for_capacity,
                "tokens_per_running_request_at_peak": footprint(poll)}

    peak = state.peak
    when = "now" if ongoing and peak is not None and peak is ctx.polls[-1] else "earlier in the window"
    proven = state.full_polls and (state.preemptions > 0 or (peak and peak.gauge("waiting_by_reason/capacity")))
    confidence = "high" if proven else "medium"

    if long:
        tokens = share * ctx.capacity_tokens if ctx.capacity_tokens else None
        findings.append(ctx.finding(
            "exhaustion", "long_requests", severity, confidence,
            f"KV cache full {when} with few requests: {shape['running_mean']:.1f} running on average, each holding "
            f"{share:.0%} of the cache"
            + (f" (about {tokens:.0f} tokens)" if tokens is not None else "")
            + f", and {shape['waiting_mean']:.1f} waiting: a few very long requests fill it.",
            {**common, **at_peak(peak)},
            NEXT_CHECK["long_requests"]))
    else:
        demand = peak.demand if peak else None
        beyond = capacity_requests is not None and demand is not None and demand > capacity_requests
        summary = f"KV cache full {when}"
        if demand is not None and capacity_requests is not None:
            summary += (f": {demand:g} requests running or waiting at the peak, the cache holds about "
                        f"{capacity_requests:g} at current mean lengths")
        elif not state.full_polls:
            summary += f": {state.preemptions:g} preemptions, no poll caught the cache full"
        if share is not None:
            summary += (f"; each running request held {share:.0%} of it on average, with "
                        f"{shape['waiting_mean']:.1f} waiting for {shape['running_mean']:.1f} running")
        findings.append(ctx.finding(
            "exhaustion", "concurrency_beyond_capacity", severity,
            confidence if (beyond or capacity_requests is None) else "low", summary + ".",
            {**common, "demand_at_peak": demand, **at_peak(peak)},
            NEXT_CHECK["concurrency_beyond_capacity"]))
    if below is not None:
        findings.append(ctx.finding(
            "exhaustion", "capacity_below_max_num_seqs", "warning",
            "high" if ctx.t["max_num_seqs"] is not None else "medium",
            f"At current mean lengths the cache holds {capacity_requests:g} requests but the scheduler admits "
            f"{'up to' if ctx.t['max_num_seqs'] is not None else 'at least'} {max_seqs:g}, so it starts requests it "
            "cannot keep and preempts them.",
            {"kv_cache_capacity_requests": capacity_requests, "max_num_seqs": max_seqs,
             "max_num_seqs_source": max_seqs_source, "running_max": ctx.view.running_max,
             "kv_cache_max_concurrency_at_max_model_len": stated_concurrency, "preemptions": state.preemptions,
             **_length_evidence(ctx)},
            NEXT_CHECK["capacity_below_max_num_seqs"]))
    return findings


# --------------------------------------------------------------------------
# Low prefix-cache hit rate
# --------------------------------------------------------------------------


def _residency(ctx: EngineContext) -> tuple[bool | None, dict[str, Any]]:
    """vLLM's --kv-cache-metrics histograms, when exported: blocks evicted
    after sitting idle for less than the usual gap between reuses were evicted
    before their reuse could come."""
    idle = ctx.histogram("kv_block_idle_before_evict")
    gap = ctx.histogram("kv_block_reuse_gap")
    idle_p50, _ = _quantile_value(idle, 0.5)
    gap_p50, _ = _quantile_value(gap, 0.5)
    lifetime_p50, _ = _quantile_value(ctx.histogram("kv_block_lifetime"), 0.5)
    evidence = {"kv_block_idle_before_evict_p50_seconds": idle_p50, "kv_block_reuse_gap_p50_seconds": gap_p50,
                "kv_block_lifetime_p50_seconds": lifetime_p50}
    if idle_p50 is None or gap_p50 is None:
        return None, evidence
    return idle_p50 < gap_p50, evidence


def _usage_in(ctx: EngineContext, since: float | None = None,
              until: float | None = None) -> tuple[float | None, float | None]:
    values = [p.usage for p in ctx.polls if p.usage is not None and (since is None or p.time > since)
              and (until is None or p.time <= until)]
    if not values:
        return None, None
    return max(values), sum(values) / len(values)


PREFIX_COUNTERS = ("prefix_queries", "prefix_hits")


def _ratio_of(counters: dict[str, float]) -> tuple[float | None, float]:
    queries = counters.get("prefix_queries", 0.0)
    hits = counters.get("prefix_hits", 0.0)
    return (hits / queries if queries > 0 else None), queries


@dataclass
class StepDrop:
    """A part of the window split into an earlier baseline and a recent part."""

    baseline_ratio: float | None
    baseline_queries: float
    recent_ratio: float | None
    recent_queries: float
    span: float  # seconds of the recent part
    split: float  # time the recent part starts

    def dropped(self, t: dict[str, Any]) -> bool:
        """The recent ratio fell to (1 - hit_drop_fraction) of a baseline
        that had real reuse, both parts with enough queried tokens."""
        return (self.recent_ratio is not None and self.baseline_ratio is not None
                and self.recent_queries >= t["min_query_tokens"] and self.baseline_queries >= t["min_query_tokens"]
                and self.baseline_ratio >= t["hit_ratio_low"]
                and self.recent_ratio <= self.baseline_ratio * (1 - t["hit_drop_fraction"]))

    def low_in_both(self, t: dict[str, Any]) -> bool:
        """Low in the baseline and in the recent part, both with enough
        queried tokens: low and stable, not a moment's mix."""
        return (self.recent_ratio is not None and self.baseline_ratio is not None
                and self.recent_queries >= t["min_query_tokens"] and self.baseline_queries >= t["min_query_tokens"]
                and self.recent_ratio < t["hit_ratio_low"] and self.baseline_ratio < t["hit_ratio_low"])


def _step_drop(ctx: EngineContext, last_time: float) -> StepDrop:
    """The polls up to `last_time` split into a baseline and a recent part of
    at most `hit_recent_seconds` (and at most half, so both have data)."""
    first_time = ctx.polls[0].time if ctx.polls else last_time
    span = min(ctx.t["hit_recent_seconds"], (last_time - first_time) / 2)
    split = last_time - span
    recent_ratio, recent_queries = _ratio_of(ctx.counters_since(split, PREFIX_COUNTERS, until=last_time))
    baseline_ratio, baseline_queries = _ratio_of(ctx.counters_since(first_time, PREFIX_COUNTERS, until=split))
    return StepDrop(baseline_ratio, baseline_queries, recent_ratio, recent_queries, span, split)


@dataclass
class HitRateVerdict:
    """The hit-rate rule's decision for one engine: its finding, if any, and
    what the exhaustion finding carries about the hit ratio (the ratio, and
    why no low-hit-rate cause stands beside the exhaustion)."""

    findings: list[Finding] = field(default_factory=list)
    exhaustion_evidence: dict[str, Any] = field(default_factory=dict)


NO_REUSE_UNDER_EXHAUSTION = ("With the cache exhausted, a low hit rate from a workload without shared prefixes is "
                             "not a separate problem.")


def _low_hit_rate_findings(ctx: EngineContext) -> list[Finding]:
    return ctx.hit_rate.findings


def _judge_hit_rate(ctx: EngineContext) -> HitRateVerdict:
    """Low hit rate, cause by cause. While the cache is exhausted (the one
    detector), a low ratio is named only on evidence the exhaustion does not
    explain: caching off, a restart, a configuration/model/adapter change at
    a drop, a drop that showed before the cache was exhausted, or vLLM's
    residency histograms showing blocks evicted before their reuse. A
    workload without shared prefixes is then no separate problem (the
    exhaustion finding says so), and a drop that came with the exhaustion is
    either evicted prefixes or changed ones: kvwatch does not guess which."""
    t = ctx.t
    counters = ctx.increase.counters
    prompt_tokens = counters.get("prompt_tokens", 0.0)
    enabled = ctx.cache_config.get("enable_prefix_caching")
    if enabled is not None and enabled.strip().lower() == "false":
        if prompt_tokens <= 0:
            return HitRateVerdict()
        return HitRateVerdict([ctx.finding(
            "low_hit_rate", "caching_disabled", "info", "high",
            "Prefix caching is disabled (cache_config enable_prefix_caching=False): no prompt reuses earlier KV.",
            {"enable_prefix_caching": enabled, "prompt_tokens": prompt_tokens,
             "prefix_queries": counters.get("prefix_queries"), "window_seconds": ctx.increase.seconds},
            NEXT_CHECK["caching_disabled"])])

    ratio, queries = _ratio_of(counters)
    if ratio is None or queries < t["min_query_tokens"]:
        return HitRateVerdict()
    min_tokens = t["min_query_tokens"]
    exhausted = ctx.exhaustion
    latest_time = ctx.polls[-1].time if ctx.polls else 0.0
    usage_max, usage_mean = _usage_in(ctx)
    base_evidence = {"hit_ratio": ratio, "prefix_queries": queries, "prefix_hits": counters.get("prefix_hits"),
                     "hit_ratio_low": t["hit_ratio_low"], "kv_usage_max": usage_max, "kv_usage_mean": usage_mean,
                     "kv_cache_exhausted": exhausted is not None, "window_seconds": ctx.increase.seconds}
    on_exhaustion = {"prefix_cache_hit_ratio": ratio}

    def verdict(finding: Finding | None = None, note: str | None = None) -> HitRateVerdict:
        return HitRateVerdict([finding] if finding else [], {**on_exhaustion, "hit_ratio_note": note})

    # A restart empties the cache: judge only the part after the last one.
    restarts = [i for i, p in enumerate(ctx.polls) if p.restarted]
    if restarts:
        before_restart = ctx.polls[restarts[-1] - 1].time
        after = ctx.counters_since(before_restart, PREFIX_COUNTERS)
        after_ratio, after_queries = _ratio_of(after)
        earlier = {k: v - after.get(k, 0.0) for k, v in counters.items()}
        earlier_ratio, earlier_queries = _ratio_of(earlier)
        if after_ratio is not None and after_queries >= min_tokens and (
            after_ratio < t["hit_ratio_low"]
            or (earlier_ratio is not None and earlier_queries >= min_tokens
                and after_ratio <= earlier_ratio * (1 - t["hit_drop_fraction"]))
        ):
            return verdict(ctx.finding(
                "low_hit_rate", "cold_cache", "info", "high",
                f"The engine restarted {latest_time - ctx.polls[restarts[-1]].time:.0f}s ago and its prefix cache "
                f"is cold: hit ratio {after_ratio:.0%} since the restart.",
                {**base_evidence, "hit_ratio_since_restart": after_ratio, "hit_ratio_before_restart": earlier_ratio,
                 "prefix_queries_since_restart": after_queries},
                NEXT_CHECK["cold_cache"]))
        return verdict()

    # Step drop: the recent part of the window against the earlier baseline.
    drop = _step_drop(ctx, latest_time)
    dropped = drop.dropped(t)
    low = ratio < t["hit_ratio_low"]
    if not dropped and not low:
        return verdict()

    evicts, residency_evidence = _residency(ctx)
    recent_usage_max, _ = _usage_in(ctx, since=drop.split)
    evidence = {**base_evidence, **residency_evidence, "eviction_usage_ratio": t["eviction_usage_ratio"]}
    if dropped:
        evidence.update({"hit_ratio_baseline": drop.baseline_ratio, "hit_ratio_recent": drop.recent_ratio,
                         "recent_seconds": drop.span, "kv_usage_recent_max": recent_usage_max})
        # A change of configuration, model or adapters at the drop explains it.
        interval = (latest_time - ctx.polls[0].time) / max(1, len(ctx.polls) - 1)
        at_drop = [c for c in ctx.changes if c.time > drop.split - interval
                   and c.kind in ("cache_config", "models", "lora") and c.engine in (None, ctx.engine)]
        drop_text = (f"Hit ratio fell from {drop.baseline_ratio:.0%} to {drop.recent_ratio:.0%} in the last "
                     f"{drop.span:.3g}s")
        if at_drop:
            evidence["changes_at_drop"] = "; ".join(f"{c.kind}: {c.detail}" for c in at_drop)
            return verdict(ctx.finding("low_hit_rate", "prefix_changed", "warning", "high",
                                       drop_text + f", when {at_drop[0].kind.replace('_', ' ')} changed.",
                                       evidence, NEXT_CHECK["prefix_changed"]))
        if evicts:
            return verdict(ctx.finding(
                "low_hit_rate", "eviction_before_reuse", "warning", "high",
                f"{drop_text}; blocks are evicted after less idle time than the usual gap between reuses.",
                evidence, NEXT_CHECK["eviction_before_reuse"]))

        def judged_without_exhaustion(part: StepDrop, until: float, text: str, extra: dict) -> Finding:
            """A drop while the cache had room: crowded out when usage was high
            (and no residency histogram says otherwise), else a changed prefix."""
            usage_max, _ = _usage_in(ctx, since=part.split, until=until)
            extra = {**evidence, **extra}
            if evicts is None and usage_max is not None and usage_max >= t["eviction_usage_ratio"]:
                return ctx.finding(
                    "low_hit_rate", "eviction_before_reuse", "warning", "medium",
                    f"{text} while KV usage reached {usage_max:.0%} without exhausting the cache: running "
                    "requests leave idle prefixes little room.", extra, NEXT_CHECK["eviction_before_reuse"])
            why = ("blocks stay cached longer than the usual gap between reuses" if evicts is False
                   else f"KV usage moderate (at most {usage_max or 0:.0%})")
            return ctx.finding(
                "low_hit_rate", "prefix_changed", "warning", "medium",
                f"{text} with {why}: the requests stopped sharing the prefix they shared before.",
                extra, NEXT_CHECK["prefix_changed"])

        if exhausted is None:
            return verdict(judged_without_exhaustion(drop, latest_time, drop_text, {}))
        # Exhausted: the drop says something apart from the exhaustion when
        # it showed before the cache was exhausted (judged as if the window
        # ended there), or when residency rules eviction out.
        before = [p for p in ctx.polls if p.time < exhausted.started]
        early = _step_drop(ctx, before[-1].time) if before else None
        if early is not None and early.dropped(t):
            return verdict(judged_without_exhaustion(
                early, before[-1].time,
                f"Hit ratio fell from {early.baseline_ratio:.0%} to {early.recent_ratio:.0%} before the KV cache "
                f"was exhausted ({latest_time - exhausted.started:.0f}s ago)",
                {"hit_ratio_baseline_before_exhaustion": early.baseline_ratio,
                 "hit_ratio_recent_before_exhaustion": early.recent_ratio,
                 "exhausted_seconds_ago": latest_time - exhausted.started}))
        if evicts is False:
            return verdict(ctx.finding(
                "low_hit_rate", "prefix_changed", "warning", "medium",
                f"{drop_text}, while the KV cache was exhausted, but blocks stay cached longer than the usual gap "
                "between reuses: not eviction; the requests stopped sharing the prefix they shared before.",
                evidence, NEXT_CHECK["prefix_changed"]))
        return verdict(note=(
            f"The hit ratio fell from {drop.baseline_ratio:.0%} to {drop.recent_ratio:.0%} as the cache was "
            "exhausted: idle prefixes evicted by the load, or a changed prefix; vLLM's --kv-cache-metrics "
            "histograms tell them apart, so no low-hit-rate cause is named."))

    # Low without a drop.
    if evicts:
        return verdict(ctx.finding(
            "low_hit_rate", "eviction_before_reuse", "warning", "medium",
            f"Hit ratio {ratio:.0%}; blocks are evicted after less idle time than the usual gap between reuses.",
            evidence, NEXT_CHECK["eviction_before_reuse"]))
    if exhausted is not None:
        return verdict(note=NO_REUSE_UNDER_EXHAUSTION)
    if not drop.low_in_both(t):
        return verdict()  # low for a moment only: not yet a workload's character
    evidence.update({"hit_ratio_baseline": drop.baseline_ratio, "hit_ratio_recent": drop.recent_ratio})
    crowded = evicts is None and usage_mean is not None and usage_mean >= t["eviction_usage_ratio"]
    return verdict(ctx.finding(
        "low_hit_rate", "no_reuse", "info", "low" if crowded else "medium",
        f"Hit ratio {ratio:.0%} and stable, the cache not exhausted: the requests share little prefix"
        + (f" (KV usage averaged {usage_mean:.0%}, so idle prefixes may also be evicted before reuse; "
           "vLLM's --kv-cache-metrics histograms tell)." if crowded
           else f" (KV usage mean {usage_mean if usage_mean is not None else 0:.0%})."),
        evidence, NEXT_CHECK["no_reuse"]))


# --------------------------------------------------------------------------
# Slow first token
# --------------------------------------------------------------------------


def _slow_first_token_findings(ctx: EngineContext, upstream: dict[str, Any] | None) -> list[Finding]:
    t = ctx.t
    ttft = ctx.histogram("ttft")
    if ttft is None or ttft.count < t["ttft_min_requests"]:
        return []
    ttft_mean = ttft.mean()
    p95, pinned = _quantile_value(ttft, 0.95)
    upstream_mean = None
    if upstream and upstream.get("up") and (upstream.get("count") or 0) >= t["ttft_min_requests"]:
        upstream_mean = upstream.get("mean_seconds")
    engine_slow = (p95 is not None and p95 > t["ttft_p95_seconds"] and pinned != "first") or \
        (ttft_mean is not None and ttft_mean > t["ttft_mean_seconds"])
    total_mean = (ttft_mean or 0.0) + (upstream_mean or 0.0)
    total_slow = upstream_mean is not None and total_mean > t["ttft_mean_seconds"]
    if not engine_slow and not total_slow:
        return []

    queue_histogram = ctx.histogram("queue_time")
    prefill_histogram = ctx.histogram("prefill_time")
    queue_observed = queue_histogram.mean() if queue_histogram else None
    prefill = prefill_histogram.mean() if prefill_histogram else None
    # The same lag from the gauges: by Little's law the mean wait is the mean
    # queue length over the arrival rate (first tokens per second). It counts
    # the requests still waiting, which no histogram has seen yet; when the
    # queue is steady the two agree.
    waiting = [p.waiting for p in ctx.polls[1:] if p.waiting is not None]
    queue_little = None
    if waiting and ctx.increase.seconds > 0:
        queue_little = (sum(waiting) / len(waiting)) / (ttft.count / ctx.increase.seconds)
    queue = max((q for q in (queue_observed, queue_little) if q is not None), default=None)
    other = None
    if ttft_mean and queue is not None and prefill is not None:
        other = max(0.0, ttft_mean - queue - prefill)
    parts = {"queue": queue, "prefill": prefill, "other": other}
    # Requests with a first token but not finished yet have a TTFT and no
    # queue or prefill time, so their whole TTFT lands in the rest. Its lower
    # bound charges each of them the TTFT p99 before the rest is named.
    other_lower = None
    if other is not None:
        unfinished = max(0.0, ttft.count - min(queue_histogram.count, prefill_histogram.count))
        p99, _ = _quantile_value(ttft, 0.99)
        other_lower = max(0.0, other - unfinished * (p99 or 0.0) / ttft.count)
    shares = {name: min(1.0, _share(v, ttft_mean)) for name, v in parts.items() if _share(v, ttft_mean) is not None}
    evidence = {
        "ttft_p95_seconds": p95, "ttft_p95_pinned": pinned, "ttft_mean_seconds": ttft_mean,
        "ttft_requests": ttft.count, "objective_p95_seconds": t["ttft_p95_seconds"],
        "objective_mean_seconds": t["ttft_mean_seconds"],
        "queue_mean_seconds": queue_observed, "queue_from_waiting_seconds": queue_little,
        "prefill_mean_seconds": prefill, "other_mean_seconds": other,
        "queue_share": shares.get("queue"), "prefill_share": shares.get("prefill"), "other_share": shares.get("other"),
        "other_lower_bound_seconds": other_lower,
        "window_seconds": ctx.increase.seconds,
    }
    headline = (f"Time to first token p95 {p95:.2f}s{'+' if pinned == 'last' else ''}, mean {ttft_mean:.2f}s "
                f"(objective p95 {t['ttft_p95_seconds']:g}s, mean {t['ttft_mean_seconds']:g}s)")
    findings = []

    if upstream_mean is not None:
        upstream_share = upstream_mean / total_mean if total_mean else 0.0
        if upstream_share >= t["upstream_share"]:
            findings.append(ctx.finding(
                "slow_first_token", "upstream", "warning", "medium",
                f"{upstream_mean:.2f}s of {total_mean:.2f}s mean time to first token ({upstream_share:.0%}) is spent "
                f"before the engine, in {upstream.get('histogram')}.",
                {**evidence, "upstream_histogram": upstream.get("histogram"), "upstream_mean_seconds": upstream_mean,
                 "upstream_p95_seconds": upstream.get("p95_seconds"), "upstream_share": upstream_share,
                 "upstream_requests": upstream.get("count")},
                NEXT_CHECK["upstream"]))
    if not engine_slow or not shares:
        return findings

    named = [name for name, share in shares.items() if share >= t["ttft_part_share"]]
    confidence = "medium"
    if not named:
        named = [max(shares, key=shares.get)]
        confidence = "low"
    # The rest is a residual: named only when its lower bound is a part too.
    if "other" in named and (other_lower is None or other_lower / ttft_mean < t["ttft_part_share"]):
        named = [name for name in named if name != "other"]
        if not named:
            return findings
    for part in sorted(named, key=lambda name: -shares[name]):
        share_text = f"{shares[part]:.0%} of it"
        if part == "queue":
            exhaustion = ctx.exhaustion
            waiting_polls = [p for p in ctx.polls if (p.waiting or 0) > 0]
            usage_while_waiting = max((p.usage for p in waiting_polls if p.usage is not None), default=None)
            queue_evidence = {**evidence, "kv_usage_max_while_waiting": usage_while_waiting,
                              "kv_usage_threshold": t["exhaustion_usage_ratio"],
                              "running_max": ctx.view.running_max, "preemptions": ctx.increase.counters.get("preemptions")}
            if exhaustion is not None:
                findings.append(ctx.finding(
                    "slow_first_token", "queueing_kv_bound", "warning", confidence,
                    f"{headline}; the queue is {share_text}, and the KV cache was exhausted while requests waited.",
                    queue_evidence, NEXT_CHECK["queueing_kv_bound"]))
            else:
                max_seqs, source = _max_num_seqs(ctx)
                configured = ctx.t["max_num_seqs"]
                if configured is not None and (ctx.view.running_max or 0) >= configured:
                    why = f"the batch was full at max_num_seqs={configured}"
                else:
                    why = f"KV usage at most {usage_while_waiting or 0:.0%} while requests waited"
                findings.append(ctx.finding(
                    "slow_first_token", "queueing_compute_bound", "warning",
                    confidence if usage_while_waiting is not None else "low",
                    f"{headline}; the queue is {share_text} while the KV cache was not exhausted ({why}): a bigger "
                    "cache does not shorten this queue.",
                    {**queue_evidence, "max_num_seqs": max_seqs, "max_num_seqs_source": source},
                    NEXT_CHECK["queueing_compute_bound"]))
        elif part == "prefill":
            cached = ctx.value("kvwatch_prompt_tokens_cached_ratio")
            prompt_mean = ctx.value("kvwatch_prompt_tokens_per_request_mean")
            uncached = prompt_mean * (1 - cached) if prompt_mean is not None and cached is not None else None
            findings.append(ctx.finding(
                "slow_first_token", "prefill", "warning", confidence,
                f"{headline}; prefill is {share_text}"
                + (f", about {uncached:.0f} uncached prompt tokens per request." if uncached is not None else "."),
                {**evidence, "prompt_tokens_mean": prompt_mean, "prompt_tokens_cached_ratio": cached,
                 "uncached_prompt_tokens_mean": uncached},
                NEXT_CHECK["prefill"]))
        else:
            findings.append(ctx.finding(
                "slow_first_token", "front_end", "warning", confidence,
                f"{headline}; {share_text} is outside queue and prefill (front end, tokenization, scheduling).",
                evidence, NEXT_CHECK["front_end"]))
    return findings


# --------------------------------------------------------------------------
# Changes that invalidate comparisons
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    time: float
    kind: str  # restart | cache_config | models | lora
    model: str | None
    engine: str | None
    detail: str
    keys: tuple[str, ...] = ()  # cache_config keys that changed
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


def _changes(window: Window, events) -> list[Change]:
    """Changes inside the window: restarts, cache-config and model-set
    changes read from consecutive snapshots (exact keys), plus the monitor's
    events for what a window cannot see (new LoRA adapters, and anything
    recorded without a matching snapshot)."""
    found: list[Change] = []
    entries = list(window.entries)
    for previous, entry in zip(entries, entries[1:]):
        found.extend(changes_between(previous, entry))
    seen = {(c.time, c.kind, c.engine) for c in found}
    for event in events or ():
        if (event.time, event.kind, event.engine) in seen:
            continue
        keys: tuple[str, ...] = ()
        if event.kind == "cache_config":
            keys = tuple(part.split(":", 1)[0].strip() for part in event.detail.split(", ") if ":" in part)
        found.append(Change(event.time, event.kind, event.model, event.engine, event.detail, keys))
    return sorted(found, key=lambda c: c.time)


def changes_between(previous: Entry, entry: Entry) -> list[Change]:
    """What changed from one window entry to the next (restarts, cache
    config, the set of models), read once per entry: an entry keeps its
    predecessor while both stay in the window. The monitor records these as
    events when the entry arrives; the diagnosis reads them for its window."""
    found = entry.derived.get("changes")
    if found is not None:
        return found
    found = []
    now = entry.snapshot
    for (model, engine), step in sorted(entry.steps.items()):
        if step.restarted:
            found.append(Change(now.time, "restart", model, engine,
                                "counters reset or _created moved: the engine restarted"))
    for engine, config in sorted(now.cache_config.items()):
        before = previous.snapshot.cache_config.get(engine)
        if before is not None and before != config:
            keys = tuple(sorted(k for k in set(before) | set(config) if before.get(k) != config.get(k)))
            detail = ", ".join(f"{k}: {before.get(k)} -> {config.get(k)}" for k in keys[:8])
            found.append(Change(now.time, "cache_config", None, engine, detail, keys))
    models_before = tuple(sorted({m for m, _ in previous.snapshot.engines}))
    models_now = tuple(sorted({m for m, _ in now.engines}))
    if models_before != models_now:
        found.append(Change(now.time, "models", None, None,
                            f"served models changed: {list(models_before)} -> {list(models_now)}",
                            before=models_before, after=models_now))
    entry.derived["changes"] = found
    return found


# cache_config keys that change what capacity and hit ratios mean.
DTYPE_KEYS = ("cache_dtype",)


def _change_findings(window: Window, changes: list[Change]) -> list[Finding]:
    latest = window.latest
    now = latest.time if latest else 0.0
    served = sorted({m for m, _ in latest.engines}) if latest else []
    models_of: dict[str, list[str]] = {}
    for model, engine in (latest.engines if latest else {}):
        models_of.setdefault(engine, []).append(model)
    findings = []

    def model_for(change: Change) -> str:
        if change.model:
            return change.model
        candidates = models_of.get(change.engine, served) if change.engine is not None else served
        return candidates[0] if len(candidates) == 1 else "*"

    def add(cause: str, change: Change, summary: str, evidence: dict[str, Any], model: str | None = None) -> None:
        findings.append(Finding("change", cause, "info", "high", model or model_for(change), change.engine, summary,
                                _tidy({"seconds_ago": now - change.time, "detail": change.detail, **evidence}),
                                NEXT_CHECK[cause]))

    for change in changes:
        ago = now - change.time
        if change.kind == "restart":
            add("engine_restarted", change, f"Engine restarted {ago:.0f}s ago: counters restarted, prefix cache cold.", {})
        elif change.kind == "cache_config":
            dtype = [k for k in change.keys if k in DTYPE_KEYS]
            rest = [k for k in change.keys if k not in DTYPE_KEYS]
            if dtype:
                add("cache_dtype_changed", change,
                    f"KV-cache dtype changed {ago:.0f}s ago ({change.detail}): re-evaluate task accuracy; "
                    "comparisons across the change do not hold.", {"changed_keys": ",".join(dtype)})
            if rest or not change.keys:
                add("cache_config_changed", change,
                    f"KV-cache configuration changed {ago:.0f}s ago ({change.detail}): capacity and block "
                    "baselines before it do not compare.", {"changed_keys": ",".join(rest)})
        elif change.kind == "models":
            added = [m for m in change.after if m not in change.before]
            for model in added or ["*"]:
                add("model_changed", change, f"Served models changed {ago:.0f}s ago: {change.detail}.",
                    {"models_before": ",".join(change.before), "models_after": ",".join(change.after)}, model)
        elif change.kind == "lora":
            add("lora_changed", change, f"LoRA adapters changed {ago:.0f}s ago: {change.detail}.", {})
    return findings


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------

_SEVERITY_ORDER = {severity: index for index, severity in enumerate(SEVERITIES)}


def diagnose(window, per_engine, per_model, events, thresholds: dict[str, Any], upstream=None) -> list[Finding]:
    """Findings for the window, most severe first. `per_model` is accepted for
    the interface; the rules judge each engine, whose cache and queue are its
    own. A rule that fails drops only its own findings."""
    resolved = resolve_thresholds(thresholds)
    changes: list[Change] = []
    try:
        changes = _changes(window, events)
    except Exception:  # pragma: no cover - defensive: one rule must not hide the rest
        log.exception("diagnosis: reading changes failed")
    findings: list[Finding] = []
    for row in per_engine:
        if row.engine is None:
            continue
        ctx = EngineContext(window, row, resolved, changes)
        for rule in (
            lambda: _exhaustion_findings(ctx),
            lambda: _low_hit_rate_findings(ctx),
            lambda: _slow_first_token_findings(ctx, upstream),
        ):
            try:
                findings.extend(rule())
            except Exception:
                log.exception("diagnosis rule failed for %s/%s", row.model, row.engine)
    try:
        findings.extend(_change_findings(window, changes))
    except Exception:
        log.exception("diagnosis: change rule failed")
    findings.sort(key=lambda f: (_SEVERITY_ORDER.get(f.severity, 9), f.symptom, f.model, f.engine or "", f.cause))
    return findings


def is_actionable(finding: Finding) -> bool:
    """Warning and critical findings: what makes `kvwatch diagnose` exit 1."""
    return finding.severity in ("critical", "warning")
