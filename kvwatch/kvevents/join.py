"""The stream's report joined with the page's numbers it cannot know: the
engine's cache in blocks and bytes per block (cache_config), and the prefix
cache's hits and queries over the window, so the sizing curve reads in bytes
and as the hit ratio the engine would then count."""

from __future__ import annotations

from typing import Any

from kvwatch.kvevents.source import sizing_curve


def with_page(report: dict[str, Any], per_engine) -> dict[str, Any]:
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
    report = dict(report)
    report["sizing"] = sizing_curve(report["window"], cache_blocks, block_size, bytes_per_block, hits, queries)
    report["page_engine"] = None if row is None else {"model_name": row.model, "engine": row.engine}
    return report
