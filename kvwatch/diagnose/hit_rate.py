"""Low prefix-cache hit rate, cause by cause: caching off, a cold cache after
a restart, a changed prefix, eviction before reuse, or no reuse at all."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from kvwatch.diagnose.arbitration import alternative
from kvwatch.diagnose.context import EngineContext, HitRateVerdict, quantile_value
from kvwatch.diagnose.causes import SYMPTOMS, CatalogueError
from kvwatch.diagnose.stream import (REFINED, baseline_confidence, cleared_seconds_ago, stated_by_stream,
                                     stream_evidence, stream_residency)
from kvwatch.diagnose.vocabulary import NEXT_CHECK, Finding, severity_of
from kvwatch.signals import reuse_shortfall_blocks
from kvwatch.snapshot import Histogram, config_number, hybrid_cache

# Fewer reuse gaps (or evictions) than this in the judged part and their
# medians are a handful of blocks: too few to say which is longer.
MIN_RESIDENCY_SAMPLES = 10
# At least this many of each and the comparison is as good as the buckets.
SURE_RESIDENCY_SAMPLES = 100


def _histogram_since(ctx: EngineContext, key: str, since: float | None) -> Histogram | None:
    """A histogram's increase over the polls after `since` (the whole window
    when None), from the window's stored steps."""
    if since is None:
        return ctx.histogram(key)
    total = None
    for poll in ctx.counted:
        if poll.time <= since or poll.step is None:
            continue
        part = poll.step.histograms.get(key)
        if part is None:
            continue
        if total is None:
            total = part
        elif total.bounds == part.bounds:
            total = Histogram(total.bounds, tuple(a + b for a, b in zip(total.cumulative, part.cumulative)),
                              total.sum + part.sum, total.count + part.count)
    return total if total is not None and total.count > 0 else None


def _bucket(histogram: Histogram, value: float) -> tuple[float, float]:
    lower = 0.0
    for bound in histogram.bounds:
        if value <= bound:
            return lower, bound
        lower = bound
    return lower, float("inf")


def _residency(ctx: EngineContext, since: float | None = None) -> tuple[bool | None, dict[str, Any], str]:
    """vLLM's --kv-cache-metrics histograms, when exported: blocks evicted
    after sitting idle for less than the usual gap between reuses were
    evicted before their reuse could come. Judged over the polls after
    `since` (the part of the window whose hit ratio is judged: the samples of
    an earlier phase describe that phase's working set, not this one), and
    only as far as the evidence goes: enough samples of both, medians in
    different buckets. Returns (evicts: True/False/None for cannot tell, the
    evidence, the confidence the comparison supports).

    The engine's KV-cache event stream, where kvwatch reads it, decides
    first and with high confidence (diagnose/stream.py): it sees each block
    come back after its eviction, or not."""
    decided = stream_residency(ctx)
    if decided is not None:
        return decided
    present = (ctx.increase.histograms.get("kv_block_idle_before_evict") is not None
               or ctx.increase.histograms.get("kv_block_reuse_gap") is not None)
    idle = _histogram_since(ctx, "kv_block_idle_before_evict", since)
    gap = _histogram_since(ctx, "kv_block_reuse_gap", since)
    idle_p50, _ = quantile_value(idle, 0.5)
    gap_p50, _ = quantile_value(gap, 0.5)
    lifetime_p50, _ = quantile_value(_histogram_since(ctx, "kv_block_lifetime", since), 0.5)
    evidence: dict[str, Any] = {"kv_block_idle_before_evict_p50_seconds": idle_p50,
                                "kv_block_reuse_gap_p50_seconds": gap_p50,
                                "kv_block_lifetime_p50_seconds": lifetime_p50}
    if not present:
        evidence["residency"] = ("vLLM's --kv-cache-metrics histograms are not on the page: with them kvwatch "
                                 "compares how long blocks sit idle before eviction with the gap between reuses "
                                 "and says how many more blocks (and bytes) would keep the reuse")
        return None, evidence, "low"
    idle_count = idle.count if idle is not None else 0
    gap_count = gap.count if gap is not None else 0
    part = "the whole window" if since is None else f"the last {ctx.polls[-1].time - since:.3g}s"
    evidence.update({"kv_block_evictions_sampled": idle_count, "kv_block_reuse_gaps_sampled": gap_count,
                     "residency_judged_over": part})
    if idle_p50 is None or gap_p50 is None or min(idle_count, gap_count) < MIN_RESIDENCY_SAMPLES:
        evidence["residency"] = (
            f"vLLM's residency histograms (--kv-cache-metrics) are on the page, but over {part} they hold {idle_count:g} evicted blocks "
            f"and {gap_count:g} reuse gaps (a block records its gaps only when it is evicted after two uses): too "
            "few to compare, so they cannot tell eviction from a prefix no longer shared yet"
            + ("; with no block reused, a working set evicted before its reuse and prompts that share nothing "
               "read the same even here" if gap_count == 0 and idle_count > 0 else ""))
        return None, evidence, "low"
    idle_bucket, gap_bucket = _bucket(idle, idle_p50), _bucket(gap, gap_p50)  # type: ignore[arg-type]  # a median: a histogram
    if idle_bucket == gap_bucket:
        evidence["residency"] = (
            f"the medians of idle time before eviction and of the gap between reuses lie in the same bucket "
            f"({idle_bucket[0]:g}s, {idle_bucket[1]:g}s]: the histograms cannot order them")
        return None, evidence, "low"
    evidence.update(_shortfall(ctx, idle_p50))
    sure = min(idle_count, gap_count) >= SURE_RESIDENCY_SAMPLES
    return idle_p50 < gap_p50, evidence, "high" if sure else "medium"


def _shortfall(ctx: EngineContext, idle_p50: float) -> dict[str, Any]:
    """How much more cache would keep the reuse (kvwatch_kv_cache_reuse_
    shortfall_blocks), and what the configured offload tier adds: by the
    same Little's-law reading, a pool larger by the tier's blocks keeps an
    idle block that much longer."""
    view = ctx.view
    blocks = reuse_shortfall_blocks(view)
    found: dict[str, Any] = {"kv_cache_reuse_shortfall_blocks": blocks}
    if blocks is None or view.bytes_per_block is None:
        return found
    found["kv_cache_reuse_shortfall_bytes"] = blocks * view.bytes_per_block
    offload_gib = config_number(ctx.cache_config, "kv_offloading_size")
    pool = (view.usable_blocks or 0.0) * (1.0 - (view.usage_mean or 0.0))
    if offload_gib and pool > 0:
        tier_blocks = offload_gib * 2**30 / view.bytes_per_block
        found["offload_tier_blocks"] = tier_blocks
        found["idle_before_evict_with_offload_tier_seconds"] = idle_p50 * (pool + tier_blocks) / pool
    return found


def block_floor(ctx: EngineContext) -> dict[str, Any]:
    """A shared prefix shorter than one KV block never hits: vLLM caches whole
    blocks, and a prompt of at most one block is never served from cache (the
    last prompt token is always computed). The share of the window's prompts
    no longer than block_size, from the prompt-length histogram, tells
    "prefix shorter than a block" (most prompts that short, so any prefix
    they share is shorter still) from "no shared prefix".

    vLLM's prompt-length buckets (1, 2, 5, 10, 20, 50, 100, ...) rarely fall
    on the block size: 32 lies inside (20, 50]. The share is then known only
    between the cumulative counts at the bounds around it; when those leave
    the majority undecided, the window's mean prompt length (exact, from the
    histogram's sum) decides: prompts averaging at most one block. (A
    uniform spread inside the bucket read 40 % for prompts of 28 tokens, all
    within one block, on the real engine.)"""
    block_size = config_number(ctx.cache_config, "block_size")
    prompts = ctx.histogram("prompt_len")
    if not block_size or prompts is None or prompts.count <= 0:
        return {}
    # A hybrid model in mamba_cache_mode "align" keeps Mamba states only at
    # multiples of mamba_block_size: a hit needs that much shared prefix.
    mamba: dict[str, Any] = hybrid_cache(ctx.cache_config) or {}
    mamba_block = mamba.get("mamba_block_size") if mamba.get("mamba_cache_mode") == "align" else None
    unit = max(block_size, mamba_block or 0.0)
    at_least, at_most = 0.0, float(prompts.count)
    straddled = None
    lower = 0.0
    for bound, cumulative in zip(prompts.bounds, prompts.cumulative):
        if bound <= unit:
            at_least = cumulative
        if bound >= unit:
            at_most = cumulative
            if bound > unit and lower < unit:
                straddled = (lower, bound)
            break
        lower = bound
    if at_most == at_least:
        straddled = None
    least, most = at_least / prompts.count, at_most / prompts.count
    mean = prompts.sum / prompts.count
    prompt_p50, _ = quantile_value(prompts, 0.5)
    if least >= 0.5:
        kind = "prefix_shorter_than_block"
    elif most < 0.5:
        kind = "no_shared_prefix"
    else:
        kind = "prefix_shorter_than_block" if mean <= unit else "no_shared_prefix"
    found: dict[str, Any] = {
        "block_size": block_size, "block_floor_tokens": unit, "prompts_within_one_block_ratio_at_least": least,
        "prompts_within_one_block_ratio_at_most": most, "prompt_tokens_mean": mean, "prompt_tokens_p50": prompt_p50,
        "no_reuse_kind": kind}
    if mamba_block and mamba_block > block_size:
        found["mamba_block_size"] = mamba_block
        found["block_floor_unit"] = (f"mamba_block_size {mamba_block:g} (mamba_cache_mode align: Mamba states are "
                                     f"kept only at its multiples), above the attention block_size {block_size:g}")
    if straddled is not None and least < 0.5 <= most:
        found["prompt_buckets_around_block_size"] = (
            f"vLLM's prompt-length bucket ({straddled[0]:g}, {straddled[1]:g}] holds the block size, so between "
            f"{least:.0%} and {most:.0%} of the prompts fit one block; the mean prompt, {mean:.3g} tokens, decides")
    return found


def _within_one_block(floor: dict[str, Any]) -> str:
    """The words of the block floor: how many prompts fit one block."""
    least, most = floor["prompts_within_one_block_ratio_at_least"], floor["prompts_within_one_block_ratio_at_most"]
    block = f"one KV block ({floor['block_floor_tokens']:g} tokens)"
    if least >= 0.5:
        return f"{least:.0%} of the prompts are no longer than {block}" if least == most else (
            f"at least {least:.0%} of the prompts are no longer than {block}")
    return (f"the prompts average {floor['prompt_tokens_mean']:.3g} tokens, within {block}, and {most:.0%} of "
            "them are in the prompt-length buckets up to the one holding the block size")


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
    asked: list[Judge] = []
    for cause in SYMPTOMS["low_hit_rate"].ranking:
        judge = JUDGES[cause]
        if judge in asked:
            continue  # it named this cause with an earlier one
        asked.append(judge)
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


def judges(*causes: str) -> Callable[[Judge], Judge]:
    """Registers a judge for the low-hit-rate causes it names."""
    def register(judge: Judge) -> Judge:
        for cause in causes:
            JUDGES[cause] = judge
        return judge
    return register


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
    """A restart empties the cache: only the part after the last one is
    judged. A reset the engine's KV-cache events saw (AllBlocksCleared)
    empties it too: what the workload's judge would name is the cold cache."""
    if judging is None:
        return None
    restarts = ctx.restarted_polls()
    if restarts:
        return _judge_since_restart(judging, restarts[-1])
    ago = cleared_seconds_ago(ctx.stream)
    if ago is None:
        return None
    workload = _workload_on_page(ctx, judging)
    if workload is not None:
        workload.findings = [_cold_after_reset(f, ctx.stream, ago) if f.cause in REFINED else f
                             for f in workload.findings]
    return workload


def _cold_after_reset(finding: Finding, report: dict[str, Any] | None, ago: float) -> Finding:
    evidence = {**finding.evidence, **stream_evidence(report or {}), "decided_by": "kv_events",
                "kv_cache_cleared_seconds_ago": ago}
    return replace(finding, cause="cold_cache", severity=severity_of("cold_cache"), confidence="high",
                   summary=(f"The engine cleared its prefix cache {ago:.0f}s ago (AllBlocksCleared in its KV-cache "
                            "events): the cache refills from nothing, so the hit ratio is low for now."),
                   evidence=evidence, next_check=NEXT_CHECK["prefix_cache_cleared"], alternatives=())


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
    low = judging.ratio < t["hit_ratio_low"]
    if not dropped and not low:
        if memory is not None and ctx.exhaustion is None and not (stream_residency(ctx) or (False,))[0]:
            # A stretch the rules judged healthy: not falling, no exhaustion, no stream verdict against it.
            memory.remember(ctx.key, judging.ratio, judging.latest_time)
        return judging.verdict()
    remembered = memory.recall(ctx.key, judging.latest_time, t["hit_baseline_max_age_seconds"]) \
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
    if ratio is None or queries < t["min_query_tokens"]:
        return None
    usage_max, usage_mean = _usage_in(ctx)
    evidence = {"hit_ratio": ratio, "prefix_queries": counters.get("prefix_queries"),
                "prefix_hits": counters.get("prefix_hits"),
                "hit_ratio_low": t["hit_ratio_low"], "kv_usage_max": usage_max, "kv_usage_mean": usage_mean,
                "kv_cache_exhausted": ctx.exhaustion is not None, "window_seconds": ctx.increase.seconds}
    if keys == SERVED_COUNTERS:
        evidence.update({"prompt_tokens": queries, "prompt_tokens_from_prefix_cache": counters.get(keys[1]),
                         "hit_ratio_basis": SERVED_BASIS})
    on_exhaustion = {"prefix_cache_hit_ratio": ratio,
                     **({"hit_ratio_basis": SERVED_BASIS} if keys == SERVED_COUNTERS else {})}
    return _Judging(ctx, ratio, ctx.polls[-1].time if ctx.polls else 0.0, usage_mean, evidence, on_exhaustion)


def _judge_since_restart(judging: _Judging, restart: int) -> HitRateVerdict:
    """A cold cache when the part since the restart is low, or well below the part before it."""
    ctx, t = judging.ctx, judging.ctx.t
    min_tokens = t["min_query_tokens"]
    keys = hit_counters(ctx)
    counters = ctx.increase.counters
    after = ctx.counters_since(ctx.polls[restart - 1].time, keys)
    after_ratio, after_queries = _ratio_of(after, keys)
    earlier = {k: v - after.get(k, 0.0) for k, v in counters.items()}
    earlier_ratio, earlier_queries = _ratio_of(earlier, keys)
    if after_ratio is not None and after_queries >= min_tokens and (
        after_ratio < t["hit_ratio_low"]
        or (earlier_ratio is not None and earlier_queries >= min_tokens
            and after_ratio <= earlier_ratio * (1 - t["hit_drop_fraction"]))
    ):
        return judging.verdict(ctx.finding(
            "low_hit_rate", "cold_cache", "high",
            f"The engine restarted {judging.latest_time - ctx.polls[restart].time:.0f}s ago and its prefix cache "
            f"is cold: hit ratio {after_ratio:.0%} since the restart.",
            {**judging.evidence, "hit_ratio_since_restart": after_ratio, "hit_ratio_before_restart": earlier_ratio,
             "prefix_queries_since_restart": after_queries},
            NEXT_CHECK["cold_cache"]))
    return judging.verdict()


def _add_residency(judging: _Judging, drop: StepDrop, dropped: bool) -> None:
    """The residency histograms' word, and the drop's figures, in the evidence.

    After a drop, residency is judged over the later half of the recent
    part: a block records its reuse gaps when it is evicted, so the blocks
    evicted just after the drop report the gaps of the working set before
    it (in the real capture, 4 prefixes reused every 0.2-0.5 s, evicted
    in a burst when 12 replaced them), not the gaps the new one needs.
    """
    ctx = judging.ctx
    evicts, residency_evidence, residency_confidence = _residency(
        ctx, since=drop.split + drop.span / 2 if dropped else None)
    recent_usage_max, _ = _usage_in(ctx, since=drop.split)
    evidence = {**judging.evidence, **residency_evidence, "eviction_usage_ratio": ctx.t["eviction_usage_ratio"]}
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
    if evicts is None and usage_max is not None and usage_max >= t["eviction_usage_ratio"]:
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
    if evicts is None and usage_mean is not None and usage_mean >= t["eviction_usage_ratio"]:
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
            f"Hit ratio {ratio:.0%} and stable: {_within_one_block(floor)}, so any prefix they share is shorter "
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
                       t: dict[str, Any]) -> list[Finding]:
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
        if finding.cause == "no_reuse" and share >= t["hit_ratio_low"]:
            continue
        kept.append(replace(finding, evidence={
            **finding.evidence, "external_tier": "lmcache", "lmcache_hit_tokens": delivered,
            "lmcache_share_of_prompt_tokens": share,
            "lmcache_hit_ratio": row.get("signals", {}).get("kvwatch_lmcache_hit_ratio")}))
    return kept


def check_judges(ranking: tuple[str, ...], judged: dict[str, Judge]) -> None:
    """Each cause the symptom ranks has its judge, and each judge names a
    ranked cause, or kvwatch does not import (a cause nobody judges would
    never be named, and the rule would fail at its turn)."""
    if set(ranking) != set(judged):
        raise CatalogueError(f"low_hit_rate: no judge for {sorted(set(ranking) - set(judged))} or no ranked cause "
                             f"for the judges of {sorted(set(judged) - set(ranking))} (hit_rate.py's @judges)")


check_judges(SYMPTOMS["low_hit_rate"].ranking, JUDGES)
