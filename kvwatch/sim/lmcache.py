"""A simulated LMCache tier beside the simulated engines (`kvwatch sim --lmcache`).

Simulated, and simple: a bounded store of KV chunks (one chunk = one engine
block, keyed by the block's chained prefix hash), least recently used evicted
first. It keeps what the simulated GPU cache evicts (a CPU offload of evicted
prefixes; real LMCache also stores every prefill as it is computed), and at
admission the engine asks it for the blocks past its own cached prefix: what it
finds is loaded instead of computed (no load time is modelled). One tier is
shared by all the simulated engines, as LMCache's multiprocess registry sums the
data-parallel engines' series with equal labels.

Its page follows LMCache's PrometheusLogger (lmcache/observability.py), as
written down in tests/fixtures/handwritten/lmcache-a.txt: every family carries
`model_name`, `worker_id`, `role` and `served_model_name`; each worker (a
tensor-parallel rank) repeats the same counts, and the scheduler's series stay 0.
The semantics are those of docs/engines.md: `num_requested_tokens` counts only
what the lookup promised (found in the tier, less what the engine's own cache
held), `num_hit_tokens` what was delivered, `num_prompt_tokens` the prompt
tokens of every request looked up. The same page carries the multiprocess
server's lookup counters (`lmcache_mp_lookup_*`, LMCache 0.5.3's names, as
tests/fixtures/handwritten/lmcache-mp-a.txt writes them): asked for the
chunks past the engine's own, found what it loads; the simulated tier has
one level, so L1 holds every hit and L2's counter stays 0.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvwatch.sim.render import escape_label_value

# family (without `lmcache:` and `_total`) -> counter attribute, in the page's order.
COUNTERS = (
    ("num_retrieve_requests", "retrieve_requests"),
    ("num_store_requests", "store_requests"),
    ("num_lookup_requests", "lookup_requests"),
    ("num_requested_tokens", "requested_tokens"),
    ("num_hit_tokens", "hit_tokens"),
    ("num_stored_tokens", "stored_tokens"),
    ("num_lookup_tokens", "lookup_tokens"),
    ("num_lookup_hits", "lookup_hits"),
    ("num_prompt_tokens", "prompt_tokens"),
)
GAUGES = ("retrieve_hit_rate", "lookup_hit_rate", "local_cache_usage")
# The multiprocess server's lookup counters (LMCache 0.5.3's OpenTelemetry
# names on its Prometheus page, as tests/fixtures/handwritten/lmcache-mp-a.txt
# writes them): family -> (counter attribute, HELP).
MP_COUNTERS = (
    ("lmcache_mp_lookup_requested_tokens_total", "mp_lookup_requested_tokens",
     "Total tokens submitted for lookup (denominator of the L1+L2 token-level hit rate). Only chunk-aligned tokens "
     "are counted."),
    ("lmcache_mp_lookup_hit_tokens_total", "mp_lookup_hit_tokens",
     "Total tokens found in L1+L2 during lookup (numerator of the L1+L2 token-level hit rate). Counts the "
     "contiguous prefix hit only."),
    ("lmcache_mp_lookup_hit_l1_tokens_total", "mp_lookup_hit_l1_tokens",
     "Of lookup_hit: tokens served from objects L1 already held (from the storage manager's per-tier hit counts)."),
    ("lmcache_mp_lookup_hit_l2_tokens_total", "mp_lookup_hit_l2_tokens",
     "Of lookup_hit: tokens L2 added beyond the L1-servable prefix. lookup_hit_l1 + lookup_hit_l2 == lookup_hit."),
    ("lmcache_mp_lookups_requests_total", "mp_lookups", "Completed lookups (denominator for lookup_early_exit)."),
)
HELP = "Multiprocess metric"
DEFAULT_WORKERS = 2
# The tier's default size, in multiples of one engine's GPU cache.
DEFAULT_SIZE_FACTOR = 4


class LMCacheTier:
    # The counters COUNTERS and MP_COUNTERS name, set to 0 in __init__.
    retrieve_requests: int
    store_requests: int
    lookup_requests: int
    requested_tokens: int
    hit_tokens: int
    stored_tokens: int
    lookup_tokens: int
    lookup_hits: int
    prompt_tokens: int
    mp_lookup_requested_tokens: int
    mp_lookup_hit_tokens: int
    mp_lookup_hit_l1_tokens: int
    mp_lookup_hit_l2_tokens: int
    mp_lookups: int

    def __init__(self, capacity_chunks: int, chunk_tokens: int, kv_bytes_per_token: int = 1024,
                 workers: int = DEFAULT_WORKERS) -> None:
        if capacity_chunks < 1 or chunk_tokens < 1 or workers < 1:
            raise ValueError("an LMCache tier needs a positive size, chunk size and worker count")
        self.capacity_chunks = capacity_chunks
        self.chunk_tokens = chunk_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self.workers = workers
        self.chunks: OrderedDict[Hashable, None] = OrderedDict()  # front = evicted first
        self.evictions = 0
        for _, attribute in COUNTERS:
            setattr(self, attribute, 0)
        for _, attribute, _help in MP_COUNTERS:
            setattr(self, attribute, 0)
        # Since the last page, for the "since last log" gauges.
        self._logged = (0, 0, 0, 0)

    def store(self, hashes: Sequence[Hashable]) -> None:
        """Keep chunks the engine evicted (one store request)."""
        if not hashes:
            return
        chunks = self.chunks
        for key in hashes:
            if key in chunks:
                chunks.move_to_end(key)
                continue
            chunks[key] = None
            if len(chunks) > self.capacity_chunks:
                chunks.popitem(last=False)
                self.evictions += 1
        self.store_requests += 1
        self.stored_tokens += len(hashes) * self.chunk_tokens

    def find(self, hashes: Sequence[Hashable], engine_blocks: int) -> int:
        """How many blocks after the engine's own `engine_blocks` the tier
        holds, in a run (`hashes`: the prompt's blocks that may be reused).
        Counts nothing: the engine may not admit the request this step."""
        chunks = self.chunks
        found = engine_blocks
        while found < len(hashes) and hashes[found] in chunks:
            found += 1
        return found - engine_blocks

    def retrieve(self, hashes: Sequence[Hashable], engine_blocks: int, loaded: int, prompt_len: int) -> None:
        """Count an admitted request's lookup and the `loaded` blocks delivered
        after the engine's own `engine_blocks`."""
        self.lookup_requests += 1
        self.lookup_tokens += prompt_len
        self.prompt_tokens += prompt_len
        self.lookup_hits += (engine_blocks + loaded) * self.chunk_tokens
        # As the multiprocess server counts it: asked for the chunks past the
        # engine's own, found the run it holds; one level here, so every hit
        # is L1's and L2 adds none.
        self.mp_lookups += 1
        self.mp_lookup_requested_tokens += (len(hashes) - engine_blocks) * self.chunk_tokens
        self.mp_lookup_hit_tokens += loaded * self.chunk_tokens
        self.mp_lookup_hit_l1_tokens += loaded * self.chunk_tokens
        if loaded > 0:
            for key in hashes[engine_blocks:engine_blocks + loaded]:
                if key in self.chunks:
                    self.chunks.move_to_end(key)
            self.retrieve_requests += 1
            self.requested_tokens += loaded * self.chunk_tokens
            self.hit_tokens += loaded * self.chunk_tokens

    def render(self, model_name: str) -> str:
        """The tier's page, in LMCache's names, types and labels."""
        name = escape_label_value(model_name)
        rows = [("0", "scheduler")] + [(str(worker), "worker") for worker in range(self.workers)]

        def labels(worker: str, role: str) -> str:
            return (f'{{model_name="{name}",worker_id="{worker}",role="{role}",'
                    f'served_model_name="{name}"}}')

        out: list[str] = []
        for family, attribute in COUNTERS:
            value = float(getattr(self, attribute))
            out.append(f"# HELP lmcache:{family}_total {HELP}")
            out.append(f"# TYPE lmcache:{family}_total counter")
            for worker, role in rows:
                out.append(f"lmcache:{family}_total{labels(worker, role)} {value if role == 'worker' else 0.0}")
        # "Since last log": the ratios of the counts since the previous page,
        # 1 (retrieve) and 0 (lookup) when there were none.
        hit, requested, lookup_hits, lookup_tokens = self._logged
        requested_delta = self.requested_tokens - requested
        lookup_delta = self.lookup_tokens - lookup_tokens
        gauges = {
            "retrieve_hit_rate": (self.hit_tokens - hit) / requested_delta if requested_delta else 1.0,
            "lookup_hit_rate": (self.lookup_hits - lookup_hits) / lookup_delta if lookup_delta else 0.0,
            "local_cache_usage": float(len(self.chunks) * self.chunk_tokens * self.kv_bytes_per_token),
        }
        self._logged = (self.hit_tokens, self.requested_tokens, self.lookup_hits, self.lookup_tokens)
        for family in GAUGES:
            out.append(f"# HELP lmcache:{family} {HELP}")
            out.append(f"# TYPE lmcache:{family} gauge")
            for worker, role in rows:
                out.append(f"lmcache:{family}{labels(worker, role)} {gauges[family]}")
        # The multiprocess server's counters on the same page: one process,
        # no ranks, one tenant (an empty cache_salt).
        mp = f'{{cache_salt="",model_name="{name}",otel_scope_name="lmcache.lookup",otel_scope_version=""}}'
        for family, attribute, help_text in MP_COUNTERS:
            out += [f"# HELP {family} {help_text}", f"# TYPE {family} counter",
                    f"{family}{mp} {float(getattr(self, attribute))}"]
        return "\n".join(out) + "\n"


__all__ = ["COUNTERS", "DEFAULT_SIZE_FACTOR", "DEFAULT_WORKERS", "GAUGES", "LMCacheTier", "MP_COUNTERS"]
