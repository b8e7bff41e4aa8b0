"""Paged KV blocks and the prefix cache of one simulated engine.

The pool follows vLLM's V1 block pool: block 0 is a reserved null block that is
never handed out; every other block is either referenced by running requests or
sits in one free queue ordered least-recently-used first. A block whose tokens are
complete may carry a content hash and stay in the hash table after its last user
frees it, so a later request with the same prefix can reuse it; such a block is
still free (evictable) and is evicted when an allocation pops it from the front of
the free queue. Usage therefore counts only referenced blocks:
usage = 1 - free_blocks / (num_blocks - 1), the formula behind
`vllm:kv_cache_usage_perc`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence


class BlockPool:
    __slots__ = ("num_blocks", "ref_count", "block_hash", "free_queue", "cached", "evictions", "on_evict", "events")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (one is the reserved null block)")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[Hashable | None] = [None] * num_blocks
        # Front = evicted first. Never-used blocks start there, in id order.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[Hashable, int] = {}
        self.evictions = 0
        # Called with the content hashes one allocation evicted (the LMCache tier keeps them).
        self.on_evict: Callable[[list[Hashable]], None] | None = None
        # An EventRecorder (kvwatch/sim/kvevents.py) while the simulator publishes KV-cache events.
        self.events = None

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.usable_blocks

    def longest_cached_prefix(self, hashes: Sequence[Hashable], max_blocks: int) -> list[int]:
        """Blocks holding the longest run of `hashes[:max_blocks]` present in the cache."""
        found: list[int] = []
        cached = self.cached
        for index in range(min(max_blocks, len(hashes))):
            block = cached.get(hashes[index])
            if block is None:
                break
            found.append(block)
        return found

    def count_evictable(self, blocks: Sequence[int]) -> int:
        ref_count = self.ref_count
        return sum(1 for block in blocks if ref_count[block] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks a new request reuses."""
        ref_count = self.ref_count
        free_queue = self.free_queue
        for block in blocks:
            if ref_count[block] == 0:
                del free_queue[block]
            ref_count[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks from the front of the free queue, evicting their cached
        content; None (and no change) when fewer are free."""
        free_queue = self.free_queue
        if count > len(free_queue):
            return None
        ref_count = self.ref_count
        block_hash = self.block_hash
        taken: list[int] = []
        evicted: list[Hashable] = []
        for _ in range(count):
            block, _ = free_queue.popitem(last=False)
            old_hash = block_hash[block]
            if old_hash is not None:
                del self.cached[old_hash]
                block_hash[block] = None
                self.evictions += 1
                evicted.append(old_hash)
            ref_count[block] = 1
            taken.append(block)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        if evicted and self.events is not None:
            self.events.removed(evicted)
        return taken

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block. vLLM frees a request's blocks tail
        first, so a request's last blocks are evicted before its first ones."""
        ref_count = self.ref_count
        free_queue = self.free_queue
        for block in reversed(blocks):
            ref_count[block] -= 1
            if ref_count[block] == 0:
                free_queue[block] = None

    def cache(self, block: int, content_hash: Hashable, lora: str | None = None) -> None:
        """Publish a full block under its content hash. If an identical block is
        already published (two requests computed the same prefix at once), the
        first one stays the cached copy and this one remains private."""
        if content_hash in self.cached or self.block_hash[block] is not None:
            return
        self.cached[content_hash] = block
        self.block_hash[block] = content_hash
        if self.events is not None:
            self.events.stored(content_hash, lora)

    def accounting(self) -> dict[str, int]:
        """Block counts by state; used + free_cached + free_uncached == usable."""
        used = sum(1 for block in range(1, self.num_blocks) if self.ref_count[block] > 0)
        free_cached = sum(1 for block in self.free_queue if self.block_hash[block] is not None)
        return {
            "usable": self.usable_blocks,
            "used": used,
            "free_cached": free_cached,
            "free_uncached": len(self.free_queue) - free_cached,
            "cached": len(self.cached),
        }
