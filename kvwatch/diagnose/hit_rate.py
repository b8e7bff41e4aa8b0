"""Low prefix-cache hit rate, cause by cause. Each cause has its judge
(registered with @judges), asked in the symptom's ranking (causes.py), the
first verdict standing: caching off; a cold cache after a restart; a reset
of the cache the KV-cache events saw; then the workload's causes, a changed prefix,
eviction before reuse or no reuse at all, told apart by the residency
evidence (diagnose/residency.py) and, where read, the KV-cache event stream.

    Adding a cause: its record and its name in the symptom's ranking
    (causes.py), its judge here; check_judges refuses one without the other."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from kvwatch.diagnose.arbitration import alternative
from kvwatch.diagnose.context import EngineContext, HitRateVerdict
from kvwatch.diagnose.judging import check_judges, in_ranking, registrar
from kvwatch.diagnose.residency import block_floor, residency, within_one_block
from kvwatch.diagnose.stream import (baseline_confidence, cleared_seconds_ago, stated_by_stream, stream_evidence,
                                     stream_residency)
from kvwatch.diagnose.thresholds import Thresholds
from kvwatch.diagnose.vocabulary import NEXT_CHECK, Finding

def _usage_in(ctx: EngineContext, since: float | None = None,
              until: float | None = None) -> tuple[float | None, float | None]:
    return ctx.usage_in(since, until)


PREFIX_COUNTERS = ("prefix_queries", "prefix_hits")
# Where the engine's release counts a request waiting for KV space in the
# lookups again at every scheduling attempt (vLLM before 0.32,
# Snapshot.counting), hits over lookups is no share of prompts: the rule then
# judges the share of prompt tokens served from the prefix cache, where the
# release counts it (vllm:prompt_tokens_by_source, 0.16+), as (whole, part).
SERVED_COUNTERS = ("prompt_tokens", "prompt_tokens_by_source/local_cache_hit")
SERVED_BASIS = ("the share of prompt tokens served from the prefix cache (vllm:prompt_tokens_by_source"
                "{source=\"local_cache_hit\"} over vllm:prompt_tokens_total), not hits over lookups, which this "
                "release inflates or deflates with re-lookups")


def hit_counters(ctx: EngineContext) -> tuple[str, str]:
    """The (whole, part) counters the hit ratio is judged on for this engine."""
    if "prefix_queries" in ctx.view.counting and SERVED_COUNTERS[1] in ctx.increase.counters:
        return SERVED_COUNTERS
    return PREFIX_COUNTERS


def _ratio_of(counters: dict[str, float], keys: tuple[str, str] = PREFIX_COUNTERS) -> tuple[float | None, float]:
    queries = counters.get(keys[0], 0.0)
    hits = counters.get(keys[1], 0.0)
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

    def dropped(self, t: Thresholds) -> bool:
        """The recent ratio fell to (1 - hit_drop_fraction) of a baseline
        that had real reuse, both parts with enough queried tokens."""
        return (self.recent_ratio is not None and self.baseline_ratio is not None
                and self.recent_queries >= t.min_query_tokens and self.baseline_queries >= t.min_query_tokens
                and self.baseline_ratio >= t.hit_ratio_low
                and self.recent_ratio <= self.baseline_ratio * (1 - t.hit_drop_fraction))

    def low_in_both(self, t: Thresholds) -> bool:
        """Low in the baseline and in the recent part, both with enough
        queried tokens: low and stable, not a moment's mix."""
        return (self.recent_ratio is not None and self.baseline_ratio is not None
                and self.recent_queries >= t.min_query_tokens and self.baseline_queries >= t.min_query_tokens
                and self.recent_ratio < t.hit_ratio_low and self.baseline_ratio < t.hit_ratio_low)


def _step_drop(ctx: EngineContext, last_time: float) -> StepDrop:
    """The polls up to `last_time` split into a baseline and a recent part of
    at most `hit_recent_seconds` (and at most half, so both have data)."""
    first_time = ctx.polls[0].time if ctx.polls else last_time
    span = min(ctx.t.hit_recent_seconds, (last_time - first_time) / 2)
    split = last_time - span
    keys = hit_counters(ctx)
    recent_ratio, recent_queries = _ratio_of(ctx.counters_since(split, keys, until=last_time), keys)
    baseline_ratio, baseline_queries = _ratio_of(ctx.counters_since(first_time, keys, until=split), keys)
    return StepDrop(baseline_ratio, baseline_queries, recent_ratio, recent_queries, span, split)


# vLLM counts cached blocks no running request holds as free in
# kv_cache_usage_perc, so a working set of prefixes larger than the cache is
# evicted while usage stays low (about 0.27 in the real 0.32 capture: 2
# requests in flight over 12 prefixes that need 192 of 128 blocks). Without
# the residency histograms the prefix counters of an evicted working set read
# exactly like prompts that stopped sharing a prefix (a drop) or share none
# (low and stable): kvwatch then names the cause the counters show, at low
# confidence, and says which other cause reads the same and what tells them
# apart.
TELLS_EVICTION_APART = (
    "vLLM's --kv-cache-metrics (kv_block_idle_before_evict_seconds against kv_block_reuse_gap_seconds: blocks "
    "evicted after less idle time than the gap between reuses are evicted before their reuse) tells them apart; "
    "KV usage does not, since idle cached blocks count as free")


def _undecided(evidence: dict[str, Any], named: str) -> dict[str, Any]:
    on_page = "kv_block_evictions_sampled" in evidence
    return {**evidence, "cannot_tell_apart": f"{named}, eviction_before_reuse",
            "tells_them_apart": ("--kv-cache-metrics: reuse gaps of blocks evicted after the change (none yet)"
                                 if on_page else "--kv-cache-metrics")}


def eviction_alternative(evidence: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The alternative an undecided low-hit-rate finding carries as data:
    eviction before reuse, decided by the residency histograms where they are
    not on the page yet, and by the KV-cache event stream (which names each
    evicted block's prefix) either way."""
    on_page = "kv_block_evictions_sampled" in evidence
    return (alternative("eviction_before_reuse", ("kv_events",) if on_page else ("kv_cache_metrics", "kv_events"),
                        _what_tells(evidence)),)


def _what_tells(evidence: dict[str, Any]) -> str:
    if "kv_block_evictions_sampled" in evidence:  # the histograms are on the page but could not tell
        return evidence["residency"]
    return TELLS_EVICTION_APART


# The first step of an undecided finding: its first sentence is the status page's "Next:"
# (it read "Either cause reads the same on this page.", which tells nobody what to do).
_FIRST_LOOK = {
    "prefix_changed": "Look first for a prompt template or system prompt deployed at that time",
    "no_reuse": "Look first at whether these prompts share a prefix at all",
}


def _next_check_both(named: str) -> str:
    return (f"{_FIRST_LOOK[named]}, then for idle prefixes evicted before reuse (the page cannot tell the two "
            f"apart). If {named.replace('_', ' ')}: {NEXT_CHECK[named]} "
            f"If eviction before reuse: {NEXT_CHECK['eviction_before_reuse']}")


NO_REUSE_UNDER_EXHAUSTION = ("With the cache exhausted, a low hit rate from a workload without shared prefixes is "
                             "not a separate problem.")


def verdict(ctx: EngineContext) -> HitRateVerdict:
    """The hit-rate rule's verdict, judged once per engine context: the
    low_hit_rate rule reports its finding, the exhaustion rule its notes."""
    if ctx.hit_rate is None:
        ctx.hit_rate = _judge_hit_rate(ctx)
    return ctx.hit_rate


def low_hit_rate_findings(ctx: EngineContext) -> list[Finding]:
    return verdict(ctx).findings


def _judge_hit_rate(ctx: EngineContext) -> HitRateVerdict:
    """Low hit rate, cause by cause: each cause's judge is asked in the
    symptom's ranking (causes.py), and the first verdict stands. While the
    cache is exhausted (the one detector), a low ratio is named only on
    evidence the exhaustion does not explain: caching off, a restart or a
    reset, a configuration/model/adapter change at a drop, a drop that
    showed before the cache was exhausted, or vLLM's residency histograms
    showing blocks evicted before their reuse. A workload without shared
    prefixes is then no separate problem (the exhaustion finding says so),
    and a drop that came with the exhaustion is either evicted prefixes or
    changed ones: kvwatch does not guess which."""
    judging = _start_judging(ctx)
    for judge in in_ranking("low_hit_rate", JUDGES):
        decided = judge(ctx, judging)
        if decided is not None:
            return decided
    return HitRateVerdict()


@dataclass
class _Judging:
    """What each judge of the hit rate reads: the window's ratio, the
    evidence gathered so far, and what the residency histograms say."""
    ctx: EngineContext
    ratio: float
    latest_time: float
    usage_mean: float | None
    evidence: dict[str, Any]
    on_exhaustion: dict[str, Any]
    evicts: bool | None = None
    residency_confidence: str = "low"

    def verdict(self, finding: Finding | None = None, note: str | None = None) -> HitRateVerdict:
        return HitRateVerdict([finding] if finding else [], {**self.on_exhaustion, "hit_ratio_note": note})


# A cause's judge: the engine's context and the window's hit ratio with its
# base evidence (None: too few prompt tokens looked up to judge) in; its
# verdict out, or None where its cause does not apply (the next is asked).
# One judge may name causes one comparison tells apart (the workload's: a
# changed prefix, eviction before reuse, no reuse); it is asked once.
Judge = Callable[[EngineContext, "_Judging | None"], "HitRateVerdict | None"]
JUDGES: dict[str, Judge] = {}
judges = registrar(JUDGES)


@judges("caching_disabled")
def _caching_disabled(ctx: EngineContext, judging: _Judging | None) -> HitRateVerdict | None:
    enabled = ctx.cache_config.get("enable_prefix_caching")
    if enabled is None or enabled.strip().lower() != "false":
        return None
    counters = ctx.increase.counters
    prompt_tokens = counters.get("prompt_tokens", 0.0)
    if prompt_tokens <= 0:
        return HitRateVerdict()
    return HitRateVerdict([ctx.finding(
        "low_hit_rate", "caching_disabled", "high",
        "Prefix caching is disabled (cache_config enable_prefix_caching=False): no prompt reuses earlier KV.",
        {"enable_prefix_caching": enabled, "prompt_tokens": prompt_tokens,
         "prefix_queries": counters.get("prefix_queries"), "window_seconds": ctx.increase.seconds},
        NEXT_CHECK["caching_disabled"])])


@judges("cold_cache")
def _cold_cache(ctx: EngineContext, judging: _Judging | None) -> HitRateVerdict | None:
    """A restart empties the cache: only the part after the last one is judged."""
    restarts = ctx.restarted_polls() if judging is not None else []
    if judging is None or not restarts:
        return None
    cold = _cold_since(judging, ctx.polls[restarts[-1] - 1].time)
    if cold is None:
        return judging.verdict()
    after_ratio, earlier_ratio, after_queries = cold
    return judging.verdict(ctx.finding(
        "low_hit_rate", "cold_cache", "high",
        f"The engine restarted {judging.latest_time - ctx.polls[restarts[-1]].time:.0f}s ago and its prefix cache "
        f"is cold: hit ratio {after_ratio:.0%} since the restart.",
        {**judging.evidence, "hit_ratio_since_restart": after_ratio, "hit_ratio_before_restart": earlier_ratio,
         "prefix_queries_since_restart": after_queries},
        NEXT_CHECK["cold_cache"]))


@judges("cache_reset")
def _cache_reset(ctx: EngineContext, judging: _Judging | None) -> HitRateVerdict | None:
    """The engine's KV-cache events saw its whole prefix cache cleared
    (AllBlocksCleared: vLLM's /reset_prefix_cache, or its own reset after new
    weights or adapters), and the part of the window since is low or well
    below the part before: the cache refills from nothing. The page alone
    cannot show a reset (vLLM counts idle cached blocks as free, so its KV
    usage reads the same before and after), so only the stream decides it."""
    ago = cleared_seconds_ago(ctx.stream)
    if judging is None or ago is None:
        return None
    reset = judging.latest_time - ago
    before = [p.time for p in ctx.polls if p.time <= reset]
    cold = _cold_since(judging, before[-1] if before else ctx.polls[0].time)
    if cold is None:
        return None  # refilled already: the workload's judge reads the window
    after_ratio, earlier_ratio, after_queries = cold
    return judging.verdict(ctx.finding(
        "low_hit_rate", "cache_reset", "high",
        f"The engine cleared its prefix cache {ago:.0f}s ago (AllBlocksCleared in its KV-cache events): the cache "
        f"refills from nothing, so the hit ratio is low for now ({after_ratio:.0%} since the reset).",
        {**judging.evidence, **(stream_evidence(ctx.stream) if ctx.stream else {}), "decided_by": "kv_events",
         "kv_cache_cleared_seconds_ago": ago, "hit_ratio_since_reset": after_ratio,
         "hit_ratio_before_reset": earlier_ratio, "prefix_queries_since_reset": after_queries},
        NEXT_CHECK["cache_reset"]))


@judges("prefix_changed", "eviction_before_reuse", "no_reuse")
def _judge_workload(ctx: EngineContext, judging: _Judging | None) -> HitRateVerdict | None:
    """A drop of the recent part against the earlier baseline, or a ratio low
    and stable: a changed prefix, prefixes evicted before their reuse, or
    prompts that share none, told apart by the residency evidence; where the
    engine's KV-cache event stream is read, in its words where it decided
    (diagnose/stream.py)."""
    decided = _workload_on_page(ctx, judging)
    if decided is not None:
        decided.findings = [stated_by_stream(f, ctx.stream, ctx.t) for f in decided.findings]
    return decided


def _workload_on_page(ctx: EngineContext, judging: _Judging | None) -> HitRateVerdict | None:
    if judging is None:
        return None
    t, memory = ctx.t, ctx.hit_memory
    drop = _step_drop(ctx, judging.latest_time)
    dropped = drop.dropped(t)
    low = judging.ratio < t.hit_ratio_low
    if not dropped and not low:
        if memory is not None and ctx.exhaustion is None and not (stream_residency(ctx) or (False,))[0]:
            # A stretch the rules judged healthy: not falling, no exhaustion, no stream verdict against it.
            memory.remember(ctx.key, judging.ratio, judging.latest_time)
        return judging.verdict()
    remembered = memory.recall(ctx.key, judging.latest_time, t.hit_baseline_max_age_seconds) \
        if memory is not None else None
    _add_residency(judging, drop, dropped)
    if dropped:
        return _judge_drop(judging, drop)
    return _judge_low_without_drop(judging, drop, remembered)


def _start_judging(ctx: EngineContext) -> _Judging | None:
    """The window's hit ratio and its base evidence, or None with too few queries to judge."""
    t = ctx.t
    counters = ctx.increase.counters
    keys = hit_counters(ctx)
    ratio, queries = _ratio_of(counters, keys)
    if ratio is None or queries < t.min_query_tokens:
        return None
    usage_max, usage_mean = _usage_in(ctx)
    evidence: dict[str, Any] = {"hit_ratio": ratio, "prefix_queries": counters.get("prefix_queries"),
                "prefix_hits": counters.get("prefix_hits"),
                "hit_ratio_low": t.hit_ratio_low, "kv_usage_max": usage_max, "kv_usage_mean": usage_mean,
                "kv_cache_exhausted": ctx.exhaustion is not None, "window_seconds": ctx.increase.seconds}
    if keys == SERVED_COUNTERS:
        evidence.update({"prompt_tokens": queries, "prompt_tokens_from_prefix_cache": counters.get(keys[1]),
                         "hit_ratio_basis": SERVED_BASIS})
    on_exhaustion = {"prefix_cache_hit_ratio": ratio,
                     **({"hit_ratio_basis": SERVED_BASIS} if keys == SERVED_COUNTERS else {})}
    return _Judging(ctx, ratio, ctx.polls[-1].time if ctx.polls else 0.0, usage_mean, evidence, on_exhaustion)


def _cold_since(judging: _Judging, since: float) -> tuple[float, float | None, float] | None:
    """(the hit ratio after `since`, the ratio before it, the tokens looked up
    after it) where the part after is low, or well below the part before,
    each part with enough tokens looked up; None otherwise."""
    ctx, t = judging.ctx, judging.ctx.t
    min_tokens = t.min_query_tokens
    keys = hit_counters(ctx)
    after = ctx.counters_since(since, keys)
    after_ratio, after_queries = _ratio_of(after, keys)
    earlier = {k: v - after.get(k, 0.0) for k, v in ctx.increase.counters.items()}
    earlier_ratio, earlier_queries = _ratio_of(earlier, keys)
    if after_ratio is not None and after_queries >= min_tokens and (
        after_ratio < t.hit_ratio_low
        or (earlier_ratio is not None and earlier_queries >= min_tokens
            and after_ratio <= earlier_ratio * (1 - t.hit_drop_fraction))
    ):
        return after_ratio, earlier_ratio, after_queries
    return None


def _add_residency(judging: _Judging, drop: StepDrop, dropped: bool) -> None:
    """The residency histograms' word, and the drop's figures, in the evidence.

    After a drop, residency is judged over the later half of the recent
    part: a block records its reuse gaps when it is evicted, so the blocks
    evicted just after the drop report the gaps of the working set before
    it (in the real capture, 4 prefixes reused every 0.2-0.5 s, evicted
    in a burst when 12 replaced them), not the gaps the new one needs.
    """
    ctx = judging.ctx
    evicts, residency_evidence, residency_confidence = residency(
        ctx, since=drop.split + drop.span / 2 if dropped else None)
    recent_usage_max, _ = _usage_in(ctx, since=drop.split)
    evidence = {**judging.evidence, **residency_evidence, "eviction_usage_ratio": ctx.t.eviction_usage_ratio}
    if dropped:
        evidence.update({"hit_ratio_baseline": drop.baseline_ratio, "hit_ratio_recent": drop.recent_ratio,
                         "recent_seconds": drop.span, "kv_usage_recent_max": recent_usage_max})
    judging.evidence, judging.evicts, judging.residency_confidence = evidence, evicts, residency_confidence


def _judge_drop(judging: _Judging, drop: StepDrop) -> HitRateVerdict:
    ctx, evidence = judging.ctx, judging.evidence
    # A change of configuration, model or adapters at the drop explains it.
    interval = (judging.latest_time - ctx.polls[0].time) / max(1, len(ctx.polls) - 1)
    at_drop = [c for c in ctx.changes if c.time > drop.split - interval
               and c.kind in ("cache_config", "models", "lora") and c.engine in (None, ctx.engine)]
    drop_text = (f"Hit ratio fell from {drop.baseline_ratio:.0%} to {drop.recent_ratio:.0%} in the last "
                 f"{drop.span:.3g}s")
    if at_drop:
        evidence["changes_at_drop"] = "; ".join(f"{c.kind}: {c.detail}" for c in at_drop)
        return judging.verdict(ctx.finding("low_hit_rate", "prefix_changed", "high",
                                           drop_text + f", when {at_drop[0].kind.replace('_', ' ')} changed.",
                                           evidence, NEXT_CHECK["prefix_changed"]))
    if judging.evicts:
        return judging.verdict(ctx.finding(
            "low_hit_rate", "eviction_before_reuse", judging.residency_confidence,
            f"{drop_text}; blocks are evicted after less idle time than the usual gap between reuses.",
            evidence, NEXT_CHECK["eviction_before_reuse"]))
    if ctx.exhaustion is None:
        return judging.verdict(_judged_without_exhaustion(judging, drop, judging.latest_time, drop_text, {}))
    return _judge_drop_while_exhausted(judging, drop, drop_text)


def _judge_drop_while_exhausted(judging: _Judging, drop: StepDrop, drop_text: str) -> HitRateVerdict:
    """The drop says something apart from the exhaustion when it showed before
    the cache was exhausted (judged as if the window ended there), or when
    residency rules eviction out; otherwise no cause, only a note."""
    ctx, exhausted, latest_time = judging.ctx, judging.ctx.exhaustion, judging.latest_time
    if exhausted is None:  # judged only while the window was exhausted
        raise ValueError("no exhaustion to judge the drop against")
    before = [p for p in ctx.polls if p.time < exhausted.started]
    early = _step_drop(ctx, before[-1].time) if before else None
    if early is not None and early.dropped(ctx.t):
        return judging.verdict(_judged_without_exhaustion(
            judging, early, before[-1].time,
            f"Hit ratio fell from {early.baseline_ratio:.0%} to {early.recent_ratio:.0%} before the KV cache "
            f"was exhausted ({latest_time - exhausted.started:.0f}s ago)",
            {"hit_ratio_baseline_before_exhaustion": early.baseline_ratio,
             "hit_ratio_recent_before_exhaustion": early.recent_ratio,
             "exhausted_seconds_ago": latest_time - exhausted.started}))
    if judging.evicts is False:
        return judging.verdict(ctx.finding(
            "low_hit_rate", "prefix_changed", "medium",
            f"{drop_text}, while the KV cache was exhausted, but blocks stay cached longer than the usual gap "
            "between reuses: not eviction; the requests stopped sharing the prefix they shared before.",
            judging.evidence, NEXT_CHECK["prefix_changed"]))
    return judging.verdict(note=(
        f"The hit ratio fell from {drop.baseline_ratio:.0%} to {drop.recent_ratio:.0%} as the cache was "
        "exhausted: idle prefixes evicted by the load, or a changed prefix; vLLM's --kv-cache-metrics "
        "histograms tell them apart, so no low-hit-rate cause is named."))


def _judged_without_exhaustion(judging: _Judging, part: StepDrop, until: float, text: str,
                               extra: dict[str, Any]) -> Finding:
    """A drop while the cache had room: crowded out when usage was high
    (and no residency histogram says otherwise), else a changed prefix."""
    ctx, t, evicts = judging.ctx, judging.ctx.t, judging.evicts
    usage_max, _ = _usage_in(ctx, since=part.split, until=until)
    extra = {**judging.evidence, **extra}
    if evicts is None and usage_max is not None and usage_max >= t.eviction_usage_ratio:
        return ctx.finding(
            "low_hit_rate", "eviction_before_reuse", "medium",
            f"{text} while KV usage reached {usage_max:.0%} without exhausting the cache: running "
            "requests leave idle prefixes little room.", extra, NEXT_CHECK["eviction_before_reuse"])
    if evicts is False:
        return ctx.finding(
            "low_hit_rate", "prefix_changed", judging.residency_confidence,
            f"{text} with blocks cached longer than the usual gap between reuses: the requests stopped "
            "sharing the prefix they shared before.", extra, NEXT_CHECK["prefix_changed"])
    return ctx.finding(
        "low_hit_rate", "prefix_changed", "low",
        f"{text} with KV usage at most {usage_max or 0:.0%}: the requests stopped sharing the prefix they "
        "shared before, or their prefixes outgrew the cache and are evicted before reuse (idle cached "
        f"blocks count as free, so eviction shows at any usage). The page cannot tell them apart: "
        f"{_what_tells(extra)}.",
        _undecided(extra, "prefix_changed"), _next_check_both("prefix_changed"),
        alternatives=eviction_alternative(extra))


def _judge_low_without_drop(judging: _Judging, drop: StepDrop,
                            remembered: tuple[float, float] | None) -> HitRateVerdict:
    ctx, evidence = judging.ctx, judging.evidence
    if judging.evicts:
        return judging.verdict(ctx.finding(
            "low_hit_rate", "eviction_before_reuse", "medium",
            f"Hit ratio {judging.ratio:.0%}; blocks are evicted after less idle time than the usual gap between "
            "reuses.", evidence, NEXT_CHECK["eviction_before_reuse"]))
    if ctx.exhaustion is not None:
        return judging.verdict(note=NO_REUSE_UNDER_EXHAUSTION)
    if remembered is not None:
        return judging.verdict(_low_since_last_healthy(judging, remembered))
    if not drop.low_in_both(ctx.t):
        return judging.verdict()  # low for a moment only: not yet a workload's character
    evidence.update({"hit_ratio_baseline": drop.baseline_ratio, "hit_ratio_recent": drop.recent_ratio})
    return judging.verdict(_stable_low(judging))


def _low_since_last_healthy(judging: _Judging, remembered: tuple[float, float]) -> Finding:
    """Healthy before this window: the drop left the window, the regression did not."""
    ctx, t, evidence, evicts, latest_time = judging.ctx, judging.ctx.t, judging.evidence, judging.evicts, \
        judging.latest_time
    healthy_ratio, seen = remembered
    evidence.update({"hit_ratio_last_healthy": healthy_ratio,
                     "hit_ratio_last_healthy_seconds_ago": latest_time - seen})
    # Remembered at a poll before the window's first, or inside the window
    # (then too early in it for the two parts of the step-drop test to show it).
    window_start = ctx.polls[0].time if ctx.polls else latest_time
    where = "before the window" if seen < window_start else (
        f"within the {latest_time - window_start:.0f}s window, too early in it for the window's own "
        "comparison of its halves to show the drop")
    text = (f"Hit ratio {judging.ratio:.0%} over the window, down from {healthy_ratio:.0%} when last healthy "
            f"{latest_time - seen:.0f}s ago ({where})")
    usage_mean = judging.usage_mean
    if evicts is None and usage_mean is not None and usage_mean >= t.eviction_usage_ratio:
        return ctx.finding(
            "low_hit_rate", "eviction_before_reuse", baseline_confidence("medium", evidence, t),
            f"{text}, with KV usage averaging {usage_mean:.0%} without exhausting the cache: running requests "
            "leave idle prefixes little room.", evidence, NEXT_CHECK["eviction_before_reuse"])
    if evicts is False:
        return ctx.finding(
            "low_hit_rate", "prefix_changed", baseline_confidence(judging.residency_confidence, evidence, t),
            f"{text}: the requests stopped sharing the prefix they shared before, and reuse has not come back.",
            evidence, NEXT_CHECK["prefix_changed"])
    return ctx.finding(
        "low_hit_rate", "prefix_changed", "low",
        f"{text}: the requests stopped sharing the prefix they shared before, or their prefixes outgrew the "
        "cache and are evicted before reuse (idle cached blocks count as free, so eviction shows at any "
        f"usage), and reuse has not come back. The page cannot tell them apart: {_what_tells(evidence)}.",
        _undecided(evidence, "prefix_changed"), _next_check_both("prefix_changed"),
        alternatives=eviction_alternative(evidence))


def _stable_low(judging: _Judging) -> Finding:
    """Low in both halves of the window with the cache not exhausted: no reuse, as far as the page can tell."""
    ctx, evidence, ratio, usage_mean = judging.ctx, judging.evidence, judging.ratio, judging.usage_mean
    floor = block_floor(ctx)
    evidence.update(floor)
    if floor.get("no_reuse_kind") == "prefix_shorter_than_block":
        return ctx.finding(
            "low_hit_rate", "no_reuse", "medium",
            f"Hit ratio {ratio:.0%} and stable: {within_one_block(floor)}, so any prefix they share is shorter "
            "than a block, and vLLM caches only whole blocks: such a prefix never hits, whatever the workload "
            "shares.",
            evidence, NEXT_CHECK["no_reuse"])
    if judging.evicts is False:
        return ctx.finding(
            "low_hit_rate", "no_reuse", judging.residency_confidence,
            f"Hit ratio {ratio:.0%} and stable, the cache not exhausted, and blocks stay cached longer than the usual "
            "gap between reuses: the requests share little prefix.", evidence, NEXT_CHECK["no_reuse"])
    return ctx.finding(
        "low_hit_rate", "no_reuse", "low",
        f"Hit ratio {ratio:.0%} and stable, the cache not exhausted (KV usage mean "
        f"{usage_mean if usage_mean is not None else 0:.0%}): the requests share little prefix, or they share "
        "prefixes that outgrow the cache and are evicted before their reuse comes (a round robin over more prefixes "
        f"than fit). The page cannot tell them apart: {_what_tells(evidence)}.",
        _undecided(evidence, "no_reuse"), _next_check_both("no_reuse"),
        alternatives=eviction_alternative(evidence))


def tier_row(lmcache: dict[str, Any] | None, model: str, engine_models: set[str]) -> dict[str, Any] | None:
    """The LMCache report's row for an engine's model: by name (LMCache labels
    the served model name where its build has the label), else the only row
    when the engine serves one model."""
    if not lmcache or not lmcache.get("up"):
        return None
    rows = lmcache.get("models") or []
    for row in rows:
        if row.get("model_name") == model:
            return row
    return rows[0] if len(rows) == 1 and len(engine_models) == 1 else None


def with_external_tier(findings: list[Finding], lmcache: dict[str, Any] | None, prompt_tokens: dict[str, float],
                       t: Thresholds) -> list[Finding]:
    """A low engine hit ratio while LMCache delivers prefixes: the requests do
    share prefixes (the engine's own cache misses them, the tier serves them),
    so `no_reuse` is not the cause once the tier supplied at least
    `hit_ratio_low` of the model's prompt tokens in the window; every other
    low-hit-rate finding names the tier in its evidence. LMCache's tokens are
    never added to the engine's hit ratio (vLLM's external counters already
    count them)."""
    if not lmcache or not lmcache.get("up"):
        return findings
    engine_models = set(prompt_tokens)
    kept = []
    for finding in findings:
        row = tier_row(lmcache, finding.model, engine_models) if finding.symptom == "low_hit_rate" else None
        delivered = (row or {}).get("increase", {}).get("hit_tokens")
        prompt = prompt_tokens.get(finding.model)
        if row is None or delivered is None or not prompt:
            kept.append(finding)
            continue
        share = delivered / prompt
        if finding.cause == "no_reuse" and share >= t.hit_ratio_low:
            continue
        kept.append(replace(finding, evidence={
            **finding.evidence, "external_tier": "lmcache", "lmcache_hit_tokens": delivered,
            "lmcache_share_of_prompt_tokens": share,
            "lmcache_hit_ratio": row.get("signals", {}).get("kvwatch_lmcache_hit_ratio")}))
    return kept


check_judges("low_hit_rate", JUDGES)
