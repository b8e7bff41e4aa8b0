"""The SGLang adapter (`--enable-metrics`; families `sglang:*`, checked against
python/sglang/srt/metrics/collector.py).

Traps this adapter handles:
- `sglang:token_usage` is the most-used of the pools (full, sliding-window,
  mamba): it is read as KV usage because the fullest pool is the one that runs
  out first.
- `sglang:cache_hit_rate` is a gauge averaged over one log interval: it cannot
  be re-windowed nor averaged across replicas, so it is never read. The hit
  ratio comes from the counters `realtime_tokens_total{mode="prefill_cache"}`
  over `prefill_cache + prefill_compute`; builds without that family use
  `cached_tokens_total` over `prompt_tokens_total` (prompt tokens include the
  cached ones).
- `cached_tokens_total` carries `cache_source` (device, host, storage_...) in
  recent builds: the sources are disjoint and summed; a `total` series, which
  SGLang writes only where it has no breakdown, is read alone.
- `num_retracted_requests_total` appears only after the first retraction:
  absent means 0 only once the family has been seen on this target (before,
  the build may simply not have it, so preemptions stay absent).
- The names come as `sglang:` or, once OpenMetrics' escaping=underscores has
  rewritten the sample lines, `sglang_` (HELP and TYPE lines may keep the
  colon): both are read, and the families named (sources, faults, the
  status) are spelled as the samples were (Snapshot.spelling).
- Hybrid models keep several token pools (`kv`, `swa`, `mamba`), each with
  used, available and evictable gauges: they are read per pool, and where
  a build has no token_usage, the fullest pool's used share is the usage.
- HiCache's radix-cache families (load-back time and bytes, backup bytes)
  carry `cache_type` and ranks but no `model_name`: they are the one model
  of the page's scheduler with the same `dp_rank`, and are left unread
  where the page serves several models.
- Tensor/pipeline/expert-parallel ranks (`tp_rank`, `pp_rank`, `moe_ep_rank`,
  `attn_tp_rank`, `attn_cp_rank`) repeat the scheduler's series: one rank is
  read, never the sum. `dp_rank` is the engine (vLLM's `engine`).
"""

from __future__ import annotations

from kvwatch.engines.table import Row, TableAdapter
from kvwatch.exposition import Family
from kvwatch.snapshot import Snapshot

PREFIXES = ("sglang:", "sglang_")

ROWS: tuple[Row, ...] = (
    Row("kv_usage", "token_usage", "gauge", "ratio",
        "most-used of the full, sliding-window and mamba pools"),
    Row("running", "num_running_reqs", "gauge", "requests"),
    Row("waiting", "num_queue_reqs", "gauge", "requests",
        "the scheduler's waiting queue (grammar and disaggregation queues are apart)"),
    Row("prefix_hits", "realtime_tokens", "counter", "tokens",
        "prefill tokens served from the radix cache; updated each log interval",
        where=(("mode", "prefill_cache"),)),
    Row("prefix_queries", "realtime_tokens", "counter", "tokens",
        "prefill_cache + prefill_compute", where=(("mode", "prefill_cache"),), adds=True),
    Row("prefix_queries", "realtime_tokens", "counter", "tokens",
        "prefill_cache + prefill_compute", where=(("mode", "prefill_compute"),), adds=True),
    Row("decode_tokens", "realtime_tokens", "counter", "tokens",
        "tokens decoded, counted each log interval (progress while requests run; prompt and generated tokens "
        "are counted when a request finishes)", where=(("mode", "decode"),)),
    Row("prompt_tokens", "prompt_tokens", "counter", "tokens", "cached tokens included"),
    Row("generation_tokens", "generation_tokens", "counter", "tokens"),
    Row("preemptions", "num_retracted_requests", "counter", "requests",
        "retractions; the family appears after the first one"),
    Row("retracted_prompt_tokens", "num_retracted_input_tokens", "counter", "tokens",
        "prompt tokens of retracted requests, computed again when they are rescheduled"),
    Row("retracted_generation_tokens", "num_retracted_output_tokens", "counter", "tokens",
        "generated tokens of retracted requests, whose KV is computed again (as prompt) when they resume"),
    Row("prefill_forward_seconds", "forward_execution_seconds", "counter", "seconds",
        "GPU time of extend (prefill) forward passes; SGLANG_ENABLE_METRICS_DEVICE_TIMER=1 only; mixed "
        "prefill+decode passes (forward_mixed) are left out", where=(("category", "forward_extend"),)),
    Row("ttft", "time_to_first_token_seconds", "histogram", "seconds"),
    Row("queue_time", "queue_time_seconds", "histogram", "seconds"),
    Row("e2e_latency", "e2e_request_latency_seconds", "histogram", "seconds"),
    Row("inter_token_latency", "inter_token_latency_seconds", "histogram", "seconds"),
    Row("tpot", "request_time_per_output_token_seconds", "histogram", "seconds"),
    Row("prompt_len", "prompt_tokens_histogram", "histogram", "tokens"),
    Row("generation_len", "generation_tokens_histogram", "histogram", "tokens"),
)
# Read in `finish` (the table lists them with their notes in TABLE_NOTES).
CACHED_TOKENS = "cached_tokens"
# The per-tier prefill counter: mode device_hit, host_hit, storage_hit (cached
# tokens by the HiCache tier that served them) and input (computed), each
# pre-seeded at 0, re-counts of retracted requests excluded. vLLM's words:
# prompt_tokens_cached_by_source/<tier> and prompt_tokens_by_source/<source>.
EFFECTIVE_TOKENS = "prefill_effective_tokens"
EFFECTIVE_TIERS = {"device_hit": "device", "host_hit": "host", "storage_hit": "storage"}
CAPACITY = "max_total_num_tokens"
PAGE_SIZE = "page_size"
RETRACTIONS = "num_retracted_requests"
# The token pools' gauges: `kv` (full attention), `swa` (sliding-window
# layers) and `mamba` (state slots) of hybrid models, each split into tokens
# held by running requests (used), radix-cached and reclaimable (evictable)
# and free (available). SGLang's token_usage is the most-used pool's
# used / size, evictable counted as free: the same reading, per pool.
POOLS = ("kv", "swa", "mamba")
POOL_STATES = ("used", "available", "evictable")
POOL_FAMILIES = tuple(f"{pool}_{state}_tokens" for pool in POOLS for state in POOL_STATES)

# HiCache's host tier (L2) from the radix cache's collector
# (RadixCacheMetricsCollector): the time and bytes of loads back to the GPU
# and the bytes backed up into host memory. Their labels are the cache's
# (`cache_type`, ranks), without model_name (_radix_cache reads them).
RADIX_COUNTERS = {"hicache_load_back_bytes": "load_back_bytes", "hicache_backup_bytes": "hicache_backup_bytes"}
RADIX_HISTOGRAMS = {"hicache_load_back_time": "load_back_duration_seconds"}

TABLE_NOTES: tuple[Row, ...] = (
    Row("prompt_tokens_cached", "cached_tokens", "counter", "tokens",
        "summed over cache_source (device, host, storage_*); a `total` series is read alone"),
    Row("capacity_tokens", "max_total_num_tokens", "gauge", "tokens",
        "KV pool size in tokens; page_size is the block size"),
    Row("pool_used_tokens/*", "{kv,swa,mamba}_used_tokens", "gauge", "tokens",
        "per pool (kv, swa, mamba): token slots held by running requests"),
    Row("pool_available_tokens/*", "{kv,swa,mamba}_available_tokens", "gauge", "tokens",
        "per pool: free token slots"),
    Row("pool_evictable_tokens/*", "{kv,swa,mamba}_evictable_tokens", "gauge", "tokens",
        "per pool: radix-cached token slots, reclaimable (free for usage)"),
    Row("kv_usage", "{kv,swa,mamba}_used_tokens", "gauge", "ratio",
        "where token_usage is absent: the most-used pool's used / (used + available + evictable)"),
    Row("prompt_tokens_cached_by_source/*", "prefill_effective_tokens", "counter", "tokens",
        "mode device_hit, host_hit, storage_hit as tiers device, host, storage (HiCache); retracted re-counts "
        "excluded"),
    Row("prompt_tokens_by_source/*", "prefill_effective_tokens", "counter", "tokens",
        "local_compute = mode input; local_cache_hit = the three hit modes (HiCache's tiers are the engine's own)"),
    Row("hicache_load_back_time", "load_back_duration_seconds", "histogram", "seconds",
        "HiCache: each load of KV from host memory (L2) back to the GPU; no model_name (the page's one model)"),
    Row("hicache_load_back_bytes", "load_back_bytes", "counter", "bytes",
        "HiCache: bytes loaded back from host memory (L2) to the GPU, all pools, draft transfers included"),
    Row("hicache_backup_bytes", "hicache_backup_bytes", "counter", "bytes",
        "HiCache: bytes backed up from the GPU to host memory (L2), all pools, draft transfers included"),
)

MISSING: dict[str, str] = {
    "prefill_time": "no per-request prefill histogram (per_stage_req_latency_seconds times scheduler stages, "
                    "not vLLM's PREFILL phase)",
    "finished/*": "no finished-reason counter (num_requests_total and num_aborted_requests_total are not split "
                  "by reason)",
    "waiting_by_reason/*": "no waiting-reason gauge",
    "external_prefix_queries": "HiCache tiers are counted in cached_tokens_total{cache_source}, not as "
                               "queries and hits",
    "external_prefix_hits": "as external_prefix_queries",
    "hicache_storage_time": "no time for HiCache's storage tier (L3): prefetch_bandwidth and backup_bandwidth are "
                            "GB/s per batch, prefetch_pgs and backup_pgs pages, with no seconds or bytes beside "
                            "them, so the storage tier's cost and bytes moved stay unweighed",
}


class SglangAdapter(TableAdapter):
    name = "sglang"
    title = "SGLang"
    prefixes = PREFIXES
    ROWS = ROWS
    MISSING = MISSING
    engine_label = "dp_rank"
    rank_labels = ("tp_rank", "pp_rank", "moe_ep_rank", "attn_tp_rank", "attn_cp_rank")
    EXTRA_FAMILIES = ((CACHED_TOKENS, CAPACITY, PAGE_SIZE, EFFECTIVE_TOKENS) + POOL_FAMILIES
                      + tuple(RADIX_COUNTERS.values()) + tuple(RADIX_HISTOGRAMS.values()))
    TABLE_NOTES = TABLE_NOTES

    def __init__(self, max_series: int = 10_000):
        super().__init__(max_series)
        # Whether num_retracted_requests_total has been on this target's page.
        self.retractions_seen = False

    def finish(self, snapshot: Snapshot, families: dict[str, Family]) -> None:
        cached = self._cached_tokens(families.get(CACHED_TOKENS))
        if cached:
            snapshot.sources["prompt_tokens_cached"] = f"{self.prefix}cached_tokens_total"
        for (model, engine_name), value in cached.items():
            engine = snapshot.engines.get((model, engine_name))
            if engine is not None:
                engine.counters["prompt_tokens_cached"] = value

        # Without realtime_tokens_total: cached over prompt tokens.
        if "prefix_queries" not in snapshot.sources and cached:
            snapshot.sources["prefix_hits"] = f"{self.prefix}cached_tokens_total"
            snapshot.sources["prefix_queries"] = f"{self.prefix}prompt_tokens_total"
            for engine in snapshot.engines.values():
                if "prompt_tokens_cached" in engine.counters and "prompt_tokens" in engine.counters:
                    engine.counters["prefix_hits"] = engine.counters["prompt_tokens_cached"]
                    engine.counters["prefix_queries"] = engine.counters["prompt_tokens"]

        self._effective_tokens(snapshot, families.get(EFFECTIVE_TOKENS))
        self._pools(snapshot, families)
        self._radix_cache(snapshot, families)

        if RETRACTIONS in families and families[RETRACTIONS].samples:
            self.retractions_seen = True
        elif self.retractions_seen:
            # Seen before on this target: no series now means none since a restart.
            snapshot.sources["preemptions"] = f"{self.prefix}num_retracted_requests_total"
            snapshot.sources["retracted_prompt_tokens"] = f"{self.prefix}num_retracted_input_tokens_total"
            for engine in snapshot.engines.values():
                engine.counters.setdefault("preemptions", 0.0)
                engine.counters.setdefault("retracted_prompt_tokens", 0.0)

        capacity = self.fold(families.get(CAPACITY), "gauge")
        page_size = self.fold(families.get(PAGE_SIZE), "gauge")
        for (model, engine_name, _), tokens in capacity.items():
            config = snapshot.cache_config.setdefault(engine_name, {"engine": engine_name})
            config["kv_cache_size_tokens"] = _integer_text(tokens)
            size = page_size.get((model, engine_name, None))
            if size:
                config["block_size"] = _integer_text(size)

    def _pools(self, snapshot: Snapshot, families: dict[str, Family]) -> None:
        """The pools' token gauges per pool; KV usage from them where the page
        has no token_usage (the fullest pool runs out first, as token_usage
        reads it)."""
        read = False
        for pool in POOLS:
            for state in POOL_STATES:
                for (model, engine_name, _), value in self.fold(families.get(f"{pool}_{state}_tokens"),
                                                                 "gauge").items():
                    engine = snapshot.engines.get((model, engine_name))
                    if engine is not None:
                        engine.gauges[f"pool_{state}_tokens/{pool}"] = value
                        read = True
        if not read:
            return
        for state in POOL_STATES:
            snapshot.sources[f"pool_{state}_tokens"] = f"{self.prefix}{{kv,swa,mamba}}_{state}_tokens"
        if "kv_usage" in snapshot.sources:
            return
        wrote = False
        for engine in snapshot.engines.values():
            usages = []
            for pool in POOLS:
                found = [engine.gauges.get(f"pool_{state}_tokens/{pool}") for state in POOL_STATES]
                parts = [part for part in found if part is not None]
                if len(parts) == len(found) and sum(parts) > 0:
                    usages.append(parts[0] / sum(parts))
            if usages:
                engine.gauges["kv_usage"] = max(usages)
                wrote = True
        if wrote:
            snapshot.sources["kv_usage"] = (f"{self.prefix}{{kv,swa,mamba}}_used_tokens / "
                                            "(used + available + evictable), the most-used pool")

    def _radix_cache(self, snapshot: Snapshot, families: dict[str, Family]) -> None:
        """HiCache's load-back and backup families, written to the engine of
        the same dp_rank where the page's scheduler serves one model (the
        radix cache labels its series with no model_name)."""
        def target(identity: tuple[str, str]):
            engine = snapshot.engines.get(identity)
            if engine is not None:
                return engine
            found = [e for e in snapshot.engines.values() if e.engine == identity[1]]
            return found[0] if len({e.model for e in snapshot.engines.values()}) == 1 and len(found) == 1 else None

        for key, family in RADIX_COUNTERS.items():
            for (model, engine_name, _), value in self.fold(families.get(family), "counter").items():
                engine = target((model, engine_name))
                if engine is not None:
                    engine.counters[key] = value
                    snapshot.sources[key] = f"{self.prefix}{family}_total"
        for key, family in RADIX_HISTOGRAMS.items():
            for identity, histogram in self.histograms(families.get(family), snapshot.parse_errors).items():
                engine = target(identity)
                if engine is not None:
                    engine.histograms[key] = histogram
                    snapshot.sources[key] = f"{self.prefix}{family}"

    def _effective_tokens(self, snapshot: Snapshot, family: Family | None) -> None:
        """prefill_effective_tokens{mode} as the tiers' cached tokens and the
        computed ones (the families vLLM 0.32 names by source)."""
        if family is None or not family.samples:
            return
        folded = self.fold(family, "counter", label="mode")
        name = self.prefix + EFFECTIVE_TOKENS + "_total"
        wrote = False
        for (model, engine_name, mode), value in folded.items():
            engine = snapshot.engines.get((model, engine_name))
            if engine is None:
                continue
            counters = engine.counters
            if mode == "input":
                counters["prompt_tokens_by_source/local_compute"] = value
            elif mode in EFFECTIVE_TIERS:
                counters[f"prompt_tokens_cached_by_source/{EFFECTIVE_TIERS[mode]}"] = value
                counters["prompt_tokens_by_source/local_cache_hit"] = (
                    counters.get("prompt_tokens_by_source/local_cache_hit", 0.0) + value)
            else:
                continue
            wrote = True
        if wrote:
            snapshot.sources["prompt_tokens_cached_by_source"] = name
            snapshot.sources["prompt_tokens_by_source"] = name

    def _cached_tokens(self, family: Family | None) -> dict[tuple[str, str], float]:
        if family is None:
            return {}
        folded = self.fold(family, "counter", label="cache_source")
        totals = {(m, e): v for (m, e, source), v in folded.items() if source == "total"}
        summed: dict[tuple[str, str], float] = {}
        for (model, engine_name, source), value in folded.items():
            if (model, engine_name) not in totals:
                summed[(model, engine_name)] = summed.get((model, engine_name), 0.0) + value
        return {**summed, **totals}


def _integer_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
