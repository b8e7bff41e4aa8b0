"""The evidence of the hit-rate judges that reads the engine's cache beyond
its hit counters: vLLM's block residency histograms (--kv-cache-metrics),
or the KV-cache event stream in their place, and the block floor (a shared
prefix shorter than one KV block never hits)."""

from __future__ import annotations

from typing import Any

from kvwatch.diagnose.context import EngineContext, quantile_value
from kvwatch.diagnose.stream import stream_residency
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


def residency(ctx: EngineContext, since: float | None = None) -> tuple[bool | None, dict[str, Any], str]:
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


def within_one_block(floor: dict[str, Any]) -> str:
    """The words of the block floor: how many prompts fit one block."""
    least, most = floor["prompts_within_one_block_ratio_at_least"], floor["prompts_within_one_block_ratio_at_most"]
    block = f"one KV block ({floor['block_floor_tokens']:g} tokens)"
    if least >= 0.5:
        return f"{least:.0%} of the prompts are no longer than {block}" if least == most else (
            f"at least {least:.0%} of the prompts are no longer than {block}")
    return (f"the prompts average {floor['prompt_tokens_mean']:.3g} tokens, within {block}, and {most:.0%} of "
            "them are in the prompt-length buckets up to the one holding the block size")
