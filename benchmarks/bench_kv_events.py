"""The kv_events section: the engine's KV-cache event stream, measured by
benchmarks/kv_events.py."""

from __future__ import annotations

import sys

from bench_support import HERE, Report, plain_table, table


def bench_kv_events(report: Report, quick: bool) -> None:
    """The engine's KV-cache event stream (benchmarks/kv_events.py): decoding
    and accounting on one core, the ledger's memory for a million blocks, and
    a flood through the bounded intake."""
    sys.path.insert(0, str(HERE))
    import kv_events

    per_second, blocks, share = kv_events.rate(5_000 if quick else 20_000)
    tracked = 200_000 if quick else 1_000_000
    cached, evicted = kv_events.memory(tracked)
    dropped, queued, queued_bytes = kv_events.flood(50_000 if quick else 200_000)
    report.figure("KV-cache events: decode + account, one core", f"{per_second:,.0f} block hashes/s",
                  f"{blocks:,} hashes, {share:.0%} of stores returns after eviction", ">= 200,000/s",
                  per_second >= 200_000)
    report.figure("KV-cache events: ledger memory for 1 M blocks", f"{cached * 1e6 / 2**20:.0f} MiB cached, "
                  f"{evicted * 1e6 / 2**20:.0f} MiB evicted",
                  f"{cached:.0f} / {evicted:.0f} B per block, measured over {tracked:,}", "-", None)
    report.figure("KV-cache events: flood with no accountant", f"{queued:,} queued ({queued_bytes / 2**20:.1f} MiB), "
                  f"{dropped:,} dropped and counted", "the intake's bound: 4,096 messages, 8 MiB here",
                  "bounded", queued_bytes <= 8 * 1024 * 1024)
    rows = [[f"{per_second:,.0f}", f"{cached:.0f} B", f"{evicted:.0f} B", f"{queued:,}", f"{dropped:,}"]]
    header = ["hashes/s (decode+account)", "per cached block", "per evicted block", "queued in a flood",
              "dropped in a flood"]
    report.sections.append(
        "### KV-cache events\n\n"
        "vLLM's batches (a BlockStored of 16 blocks with their token ids, one BlockRemoved per evicted block, a "
        "rotation of prefixes larger than the cache) decoded and accounted by kvwatch/kvevents on one core; the "
        "ledger's memory measured with tracemalloc for 1,000,000 tracked blocks; 200,000 messages offered to the "
        "intake with nothing draining it.\n\n" + table(header, rows))
    print(plain_table(header, rows), flush=True)
