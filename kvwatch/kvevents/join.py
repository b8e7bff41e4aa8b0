"""The stream's report joined with the page's numbers it cannot know: the
engine's cache in blocks and bytes per block (cache_config), and the prefix
cache's hits and queries over the window, so the sizing curve reads in bytes
and as the hit ratio the engine would then count."""

from __future__ import annotations

from typing import Any

from kvwatch.kvevents.source import sizing_curve
from kvwatch.stream_report import KVEventsHits, KVEventsPageEngine, KVEventsReport, KVEventsWindow


def with_page(report: KVEventsReport, per_engine) -> KVEventsReport:
    """`per_engine`: the poll's Evaluated rows. The stream is one engine's
    (vLLM's data-parallel ranks publish on ports of their own): with one
    engine on the page its numbers are joined; with several, the first's
    (named in `page_engine`)."""
    row = per_engine[0] if per_engine else None
    view = getattr(row, "view", None)
    block_size = report.get("block_size")
    cache_blocks = report.get("cached_blocks_peak") or 0.0
    bytes_per_block = hits = queries = None
    if view is not None:
        bytes_per_block = view.bytes_per_block
        if view.usable_blocks:
            cache_blocks = view.usable_blocks
        if not block_size and view.block_size:
            block_size = int(view.block_size)
        counters = view.increase.counters
        hits, queries = counters.get("prefix_hits"), counters.get("prefix_queries")
    report = report.copy()
    report["sizing"] = sizing_curve(report["window"], cache_blocks, block_size, bytes_per_block, hits, queries)
    report["hits"] = hits_beside(report["window"], block_size, hits, queries)
    report["page_engine"] = None if row is None else KVEventsPageEngine(model_name=row.model, engine=row.engine)
    return report


def hits_beside(window: KVEventsWindow, block_size: int | None, hits: float | None,
                queries: float | None) -> KVEventsHits:
    """The hits the stream announced over the window (full report mode's
    reused blocks, in tokens at the block size) beside the page's prefix
    hits: their share is that of the hit tokens whose requests asked for
    full reports (0 in incremental mode, 1 when every request does)."""
    reused = window.get("reused") or 0.0
    tokens = reused * block_size if block_size else None
    return KVEventsHits(stream_blocks=reused, stream_tokens=tokens, page_tokens=hits, page_queries=queries,
                        stream_share_of_page=(min(1.0, tokens / hits) if tokens is not None and hits else None))


# vLLM's default block size: the bound below when neither the page nor the
# stream says the engine's.
DEFAULT_BLOCK_SIZE = 16


def silence(report: KVEventsReport, per_engine, window, silence_seconds: float) -> dict[str, Any]:
    """How long the stream has been quiet and the blocks the engine must have
    stored meanwhile, by its page: a lower bound, its prompt tokens not
    served from the prefix cache, less a partial block for each request that
    could have been prefilled (finished since, or running now), in whole
    blocks. An engine whose prompts all hit the cache, or are shorter than a
    block, stores nothing and sends no event: a quiet stream then is no
    stop. `blocks` counts only once the stream has been quiet for
    `silence_seconds` (0 before); the diagnosis (events_stopped) and the
    exported kvwatch_kv_events_silent_blocks read this one number."""
    age = report.get("last_message_age_seconds")
    quiet = age if age is not None else (report.get("configured_seconds") or 0.0)
    out: dict[str, Any] = {"quiet_seconds": quiet, "silence_seconds": silence_seconds, "blocks": 0.0,
                           "prompt_tokens": 0.0, "cached_tokens": 0.0, "requests": 0.0, "block_size": None}
    row = per_engine[0] if per_engine else None
    now = report.get("time")
    if row is None or row.engine is None or window is None or now is None or window.latest is None:
        return out
    view = getattr(row, "view", None)
    block_size = int((view.block_size if view is not None else None) or report.get("block_size")
                     or DEFAULT_BLOCK_SIZE)
    counters = window.increase((row.model, row.engine), since=now - quiet).counters
    prompt = counters.get("prompt_tokens", 0.0)
    cached = min(prompt, counters.get("prefix_hits", 0.0))
    running = (view.gauge("running") if view is not None else None) or 0.0
    requests = sum(v for k, v in counters.items() if k.startswith("finished/")) + running
    blocks = max(0.0, (prompt - cached - requests * (block_size - 1)) // block_size)
    out.update(prompt_tokens=prompt, cached_tokens=cached, requests=requests, block_size=block_size,
               blocks=blocks if quiet >= silence_seconds else 0.0)
    return out
