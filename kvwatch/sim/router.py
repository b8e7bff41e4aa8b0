"""A simulated router in front of the simulated engines, with a policy, and its
metrics page in the names of llm-d's endpoint picker (EPP).

Policies:
- `round_robin`: the next engine in turn; the prefix producer still scores
  every engine (as llm-d's producer runs beside any picker), so the page shows
  what the chosen engine held against what the best one held.
- `prefix`: the engine whose cache holds the longest run of the prompt's
  blocks (ties: least loaded); its index is the engines' caches themselves,
  as a precise index fed by every KV event without lag.
- `prefix_stale`: the same choice over an index the router keeps from its own
  decisions (the chosen engine is assumed to hold the prompt from then on)
  and never told of an eviction: llm-d's approximate producer when the
  engines evict faster than its LRU forgets.

Per request the router records, as the EPP's shared prefix producer metrics do
(llm-d-router pkg/epp/.../prefixmetrics: one observation of each histogram per
request): the tokens it predicted the chosen engine holds, the best prediction
among the engines it picked from and among every candidate (no filter here, so
the two are equal), and the prompt tokens measured against.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvwatch.sim.engine import Engine
from kvwatch.sim.render import _head, _histogram_lines, _labels
from kvwatch.sim.stats import Histogram

POLICIES = ("round_robin", "prefix", "prefix_stale")
# Our own token bounds (llm-d's TokenCountBuckets are not restated): the
# attribution reads only _sum and _count.
TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PLUGIN = "approx-prefix-cache-producer"
PREFIX = "llm_d_epp_prefix_"
# The stale index's bound on block hashes it remembers (its own LRU).
INDEX_CAPACITY = 100_000


class SimRouter:
    """Picks an engine per request and counts what it predicted."""

    def __init__(self, engines: Sequence[Engine], policy: str = "prefix",
                 index_capacity: int = INDEX_CAPACITY) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r} (expected one of {', '.join(POLICIES)})")
        self.engines = list(engines)
        self.policy = policy
        self.index_capacity = index_capacity
        self._turn = 0
        # block hash -> engine indexes, for prefix_stale: only ever added to.
        self._index: OrderedDict[Hashable, set[int]] = OrderedDict()
        self.predicted = Histogram(TOKEN_BUCKETS)
        self.best_predicted = Histogram(TOKEN_BUCKETS)
        self.best_available = Histogram(TOKEN_BUCKETS)
        self.prompt = Histogram(TOKEN_BUCKETS)
        self.requests = 0

    def _held(self, engine: Engine, hashes: Sequence[Hashable], max_blocks: int) -> int:
        """Blocks of the prompt's leading run the router believes `engine` holds."""
        if self.policy != "prefix_stale":
            return len(engine.pool.longest_cached_prefix(hashes, max_blocks))
        count = 0
        for block in hashes[:max_blocks]:
            holders = self._index.get(block)
            if holders is None or engine.index not in holders:
                break
            count += 1
        return count

    def _remember(self, engine: Engine, hashes: Sequence[Hashable]) -> None:
        index = self._index
        for block in hashes:
            holders = index.get(block)
            if holders is None:
                index[block] = holders = set()
            else:
                index.move_to_end(block)
            holders.add(engine.index)
        while len(index) > self.index_capacity:
            index.popitem(last=False)

    def pick(self, hashes: Sequence[Hashable], prompt_len: int) -> Engine:
        """The engine for a prompt of `prompt_len` tokens whose full blocks hash to `hashes`."""
        engines = self.engines
        block_size = engines[0].config.block_size
        # vLLM never serves a prompt's last token from the cache: the most it can hit.
        max_blocks = max(0, (prompt_len - 1) // block_size)
        held = [self._held(engine, hashes, max_blocks) for engine in engines]
        if self.policy == "round_robin":
            chosen = self._turn % len(engines)
            self._turn += 1
        else:
            chosen = max(range(len(engines)), key=lambda i: (held[i], -engines[i].load(), -i))
        engine = engines[chosen]
        if self.policy == "prefix_stale":
            self._remember(engine, hashes)
        best = max(held) * block_size
        self.predicted.observe(held[chosen] * block_size)
        self.best_predicted.observe(best)
        self.best_available.observe(best)
        self.prompt.observe(prompt_len)
        self.requests += 1
        return engine

    def render(self, model_name: str) -> str:
        """The router's page in llm-d EPP's current names (docs/metrics.md of llm-d-router)."""
        out: list[str] = []
        base = {"plugin_name": PLUGIN, "plugin_type": PLUGIN, "endpoint_role": "decode"}
        families = (
            ("predicted_cached_tokens", self.predicted, base,
             "Prompt tokens the producer predicted the scheduler's chosen endpoint holds in its prefix cache, "
             "per request."),
            ("best_predicted_cached_tokens", self.best_predicted, {**base, "modality": "none"},
             "Highest prefix-cache prediction among the endpoints the scheduler selected from, per request."),
            ("best_available_cached_tokens", self.best_available, {**base, "modality": "none"},
             "Highest prefix-cache prediction among the request's candidate endpoints before filtering, "
             "per request."),
            ("prompt_tokens", self.prompt, base, "Prompt tokens the producer measured its prediction against, "
                                                 "per request."),
        )
        for name, histogram, labels, help_text in families:
            _head(out, PREFIX + name, help_text, "histogram")
            _histogram_lines(out, PREFIX + name, labels, histogram)
        _head(out, "llm_d_epp_request_total", "Total requests.", "counter")
        labels = {"model_name": model_name, "target_model_name": model_name, "fairness_id": "", "priority": "0"}
        out.append(f"llm_d_epp_request_total{_labels(labels)} {self.requests}")
        _head(out, "llm_d_epp_prefix_indexer_size", "Entries in the approximate prefix index.", "gauge")
        out.append(f"llm_d_epp_prefix_indexer_size{_labels({'plugin_name': PLUGIN, 'plugin_type': PLUGIN})} "
                   f"{len(self._index)}")
        return "\n".join(out) + "\n"
