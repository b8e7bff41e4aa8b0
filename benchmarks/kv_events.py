"""KV-cache event stream: decoding and accounting rate, the memory of one
million tracked blocks, and a flood through the bounded intake.

    .venv/bin/python benchmarks/kv_events.py

Prints its figures (one line each); target: >= 200,000 block
hashes per second decoded and accounted on one core.

The load is vLLM's shape (kvwatch/kvevents/wire.py): one step's batch holds a
BlockStored of 16 new blocks (16 tokens each, their token ids included, as
vLLM sends them) and one BlockRemoved per evicted block (vLLM emits one per
block), in a rotation of prefixes larger than the cache so that most stores
are returns after eviction (the costly path: distance and time).
"""

from __future__ import annotations

import gc
import os
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvwatch.kvevents import wire  # noqa: E402
from kvwatch.kvevents.ledger import Ledger  # noqa: E402
from kvwatch.kvevents.source import KVEventSource  # noqa: E402

BLOCKS_PER_STEP = 16
BLOCK_SIZE = 16
CACHE_BLOCKS = 4096
PREFIXES = 400  # x 16 blocks = 6,400 blocks in rotation: more than the cache


def payloads(steps: int) -> list[bytes]:
    out = []
    cached: list[int] = []
    seen: set[int] = set()
    for step in range(steps):
        prefix = step % PREFIXES
        hashes = [(prefix * 1_000_003 + i) * 0x9E3779B97F4A7C15 % (1 << 63) for i in range(BLOCKS_PER_STEP)]
        events = []
        evict = max(0, len(cached) + len(hashes) - CACHE_BLOCKS)
        for h in cached[:evict]:
            events.append(wire.removed([h]))
            seen.discard(h)
        del cached[:evict]
        events.append(wire.stored(hashes, BLOCK_SIZE, token_ids=list(range(BLOCK_SIZE * len(hashes)))))
        cached.extend(hashes)
        out.append(wire.encode_batch(1000.0 + step * 0.01, events))
    return out


def rate(steps: int = 20_000) -> tuple[float, int, float]:
    data = payloads(steps)
    source = KVEventSource("tcp://127.0.0.1:0", window_seconds=300)
    blocks = 0
    gc.collect()
    started = time.process_time()
    for seq, payload in enumerate(data):
        source.feed(seq, payload, now=1000.0 + seq * 0.01)
    cpu = time.process_time() - started
    totals = source.ledger.totals
    blocks = totals.stored + totals.evicted
    return blocks / cpu, blocks, totals.again / max(1, totals.stored)


def memory(blocks: int = 1_000_000) -> tuple[float, float]:
    gc.collect()
    tracemalloc.start()
    ledger = Ledger(max_bytes=1 << 40)  # no cap: every block tracked
    base = tracemalloc.get_traced_memory()[0]
    step = 10_000
    for start in range(0, blocks, step):
        ledger.stored([(i * 0x9E3779B97F4A7C15) % (1 << 64) for i in range(start, start + step)], 1000.0)
    cached = tracemalloc.get_traced_memory()[0] - base
    for i in range(blocks):  # one event per block, as vLLM sends them: each its own eviction mark
        ledger.removed([(i * 0x9E3779B97F4A7C15) % (1 << 64)], 1001.0 + i * 0.001)
    evicted = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert ledger.entries() == blocks
    return cached / blocks, evicted / blocks


def flood(messages: int = 200_000) -> tuple[int, int, int]:
    """Messages offered to the intake faster than anything accounts them
    (no accountant thread runs): the queue fills to its bound, the rest is
    dropped and counted."""
    source = KVEventSource("tcp://127.0.0.1:0", queue_bytes=8 * 1024 * 1024)
    payload = wire.encode_batch(1.0, [wire.stored(list(range(64)), 16, token_ids=list(range(1024)))])
    for seq in range(messages):
        source.intake([b"kv", seq.to_bytes(8, "big"), payload], 1.0)
    return source.dropped, len(source._queue), source._queued_bytes


def main() -> int:
    per_second, blocks, share = rate()
    print(f"kv events: decode+account {per_second:,.0f} block hashes/s on one core "
          f"({blocks:,} hashes, {share:.0%} of stores were returns after eviction; target >= 200,000)")
    cached, evicted = memory()
    print(f"kv events: ledger memory {cached:.0f} B per cached block, {evicted:.0f} B per evicted block "
          f"(1,000,000 blocks: {cached * 1e6 / 2**20:.0f} MiB cached, {evicted * 1e6 / 2**20:.0f} MiB evicted)")
    dropped, queued, queued_bytes = flood()
    print(f"kv events: flood of 200,000 messages with no accountant: {queued:,} queued "
          f"({queued_bytes / 2**20:.1f} MiB, the bound), {dropped:,} dropped and counted")
    return 0 if per_second >= 200_000 else 1


if __name__ == "__main__":
    sys.exit(main())
