"""The engine's own series that kvwatch re-exports under one stable name per
concept whatever the engine's version spelled (`kvwatch_engine_*`), and the
counters of the second sources re-exported beside them (LMCache's,
the KV-cache event stream's). Counters and histograms pass through unchanged
(resets included), so recording rules aggregate them correctly across sidecars."""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.snapshot import EngineSnapshot, capacity_tokens, config_number


# --------------------------------------------------------------------------
# vLLM series re-exported under stable names
# --------------------------------------------------------------------------


# The identity labels of every per-engine family kvwatch exports.
IDENTITY = ("model_name", "engine")
# cache_config_info keys re-exported on kvwatch_engine_info (a bounded set, not
# the whole open map, so the label set does not change with every vLLM release).
INFO_KEYS = ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "kv_cache_size_tokens")


@dataclass(frozen=True)
class EngineSeries:
    name: str  # exported family name (counters without their `_total`)
    kind: str  # gauge | counter | histogram
    key: str  # canonical snapshot key; "<key>/*" for a labelled family
    unit: str
    help: str
    label: str | None = None  # the dimension of a labelled family
    good: str | None = None  # GOOD_DIRECTIONS

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


ENGINE_SERIES: tuple[EngineSeries, ...] = (
    EngineSeries("kvwatch_engine_kv_cache_usage_ratio", "gauge", "kv_usage", "ratio",
                 "KV-cache usage 0..1 (vllm:kv_cache_usage_perc, formerly vllm:gpu_cache_usage_perc); evictable prefix-cache blocks count as free; "
                 "a reading outside 0..1 is left out (kvwatch_source_fault).", good="low"),
    EngineSeries("kvwatch_engine_kv_cache_capacity_tokens", "gauge", "capacity_tokens", "tokens",
                 "KV-cache capacity in tokens (vllm:cache_config_info kv_cache_size_tokens, else num_gpu_blocks x block_size).", good="high"),
    EngineSeries("kvwatch_engine_kv_cache_memory_bytes", "gauge", "config/kv_cache_memory_bytes", "bytes",
                 "Bytes of the KV cache (vllm:cache_config_info kv_cache_memory_bytes: a number from vLLM 0.24, or "
                 "given --kv-cache-memory-bytes, as 0.20.2 states it); absent where it is \"None\" (0.10.2) or missing."),
    EngineSeries("kvwatch_engine_kv_pool_used_tokens", "gauge", "pool_used_tokens/*", "tokens",
                 "Token slots held by running requests, per pool: kv (full attention), swa (sliding-window layers), "
                 "mamba (state slots) of a hybrid model (sglang:{kv,swa,mamba}_used_tokens; SGLang only). "
                 "used / (used + available + evictable) of the fullest pool is its KV usage.", label="pool"),
    EngineSeries("kvwatch_engine_kv_pool_available_tokens", "gauge", "pool_available_tokens/*", "tokens",
                 "Free token slots, per pool (sglang:{kv,swa,mamba}_available_tokens; SGLang only).", label="pool",
                 good="high"),
    EngineSeries("kvwatch_engine_kv_pool_evictable_tokens", "gauge", "pool_evictable_tokens/*", "tokens",
                 "Radix-cached token slots a new request may reclaim, per pool; counted as free in the usage "
                 "(sglang:{kv,swa,mamba}_evictable_tokens; SGLang only).", label="pool"),
    EngineSeries("kvwatch_engine_requests_running", "gauge", "running", "requests",
                 "Requests in model execution batches (vllm:num_requests_running)."),
    EngineSeries("kvwatch_engine_requests_waiting", "gauge", "waiting", "requests",
                 "Requests waiting to be scheduled (vllm:num_requests_waiting).", good="low"),
    EngineSeries("kvwatch_engine_requests_waiting_by_reason", "gauge", "waiting_by_reason/*", "requests",
                 "Waiting requests by reason: capacity (KV blocks) or deferred (vllm:num_requests_waiting_by_reason, vLLM 0.20+).",
                 label="reason", good="low"),
    # good="high": enough lookups to judge the hit ratio (below min_query_tokens it is not judged).
    EngineSeries("kvwatch_engine_prefix_cache_queries", "counter", "prefix_queries", "tokens",
                 "Prefix-cache queries in tokens (vllm:prefix_cache_queries_total, formerly vllm:gpu_prefix_cache_queries_total; blocks before vLLM 0.9).", good="high"),
    EngineSeries("kvwatch_engine_prefix_cache_hits", "counter", "prefix_hits", "tokens",
                 "Prefix-cache hits in tokens (vllm:prefix_cache_hits_total, formerly vllm:gpu_prefix_cache_hits_total; blocks before vLLM 0.9).", good="high"),
    EngineSeries("kvwatch_engine_external_prefix_cache_queries", "counter", "external_prefix_queries", "tokens",
                 "External (KV connector) prefix-cache queries in tokens (vllm:external_prefix_cache_queries_total)."),
    EngineSeries("kvwatch_engine_external_prefix_cache_hits", "counter", "external_prefix_hits", "tokens",
                 "External (KV connector) prefix-cache hits in tokens (vllm:external_prefix_cache_hits_total).", good="high"),
    EngineSeries("kvwatch_engine_preemptions", "counter", "preemptions", "preemptions",
                 "Preemptions by the scheduler (vllm:num_preemptions_total).", good="low"),
    EngineSeries("kvwatch_engine_retracted_prompt_tokens", "counter", "retracted_prompt_tokens", "tokens",
                 "Prompt tokens of retracted requests, computed again when they are rescheduled "
                 "(sglang:num_retracted_input_tokens_total; SGLang only: vLLM does not count its preemptions' "
                 "recomputed tokens).", good="low"),
    EngineSeries("kvwatch_engine_prompt_tokens", "counter", "prompt_tokens", "tokens",
                 "Prompt tokens processed, cached ones included (vllm:prompt_tokens_total)."),
    EngineSeries("kvwatch_engine_prompt_tokens_cached", "counter", "prompt_tokens_cached", "tokens",
                 "Prompt tokens served from a cache, local or external (vllm:prompt_tokens_cached_total, vLLM 0.16+).", good="high"),
    EngineSeries("kvwatch_engine_generation_tokens", "counter", "generation_tokens", "tokens",
                 "Generated tokens (vllm:generation_tokens_total)."),
    EngineSeries("kvwatch_engine_requests_finished", "counter", "finished/*", "requests",
                 "Finished requests by reason: stop, length, abort, error, repetition (vllm:request_success_total).",
                 label="finished_reason"),
    EngineSeries("kvwatch_engine_time_to_first_token_seconds", "histogram", "ttft", "seconds",
                 "Time to first token, from front-end arrival, so queue and prefill included (vllm:time_to_first_token_seconds).", good="low"),
    EngineSeries("kvwatch_engine_request_queue_time_seconds", "histogram", "queue_time", "seconds",
                 "Time in the WAITING phase, observed when a request finishes (vllm:request_queue_time_seconds, V0 vllm:time_in_queue_requests).", good="low"),
    EngineSeries("kvwatch_engine_request_prefill_time_seconds", "histogram", "prefill_time", "seconds",
                 "Time in the PREFILL phase, observed when a request finishes (vllm:request_prefill_time_seconds).", good="low"),
    EngineSeries("kvwatch_engine_e2e_request_latency_seconds", "histogram", "e2e_latency", "seconds",
                 "End-to-end request latency (vllm:e2e_request_latency_seconds).", good="low"),
    EngineSeries("kvwatch_engine_inter_token_latency_seconds", "histogram", "inter_token_latency", "seconds",
                 "Gap between output events (vllm:inter_token_latency_seconds, formerly vllm:time_per_output_token_seconds).", good="low"),
    EngineSeries("kvwatch_engine_request_prompt_tokens", "histogram", "prompt_len", "tokens",
                 "Prompt length per finished request (vllm:request_prompt_tokens)."),
    EngineSeries("kvwatch_engine_request_generation_tokens", "histogram", "generation_len", "tokens",
                 "Generated length per finished request (vllm:request_generation_tokens)."),
    EngineSeries("kvwatch_engine_kv_cache_blocks", "gauge", "config/num_gpu_blocks", "blocks",
                 "KV blocks of the engine's pool (vllm:cache_config_info num_gpu_blocks); one of them is vLLM's "
                 "null block, never allocated, so usage = used / (blocks - 1).", good="high"),
    EngineSeries("kvwatch_engine_kv_cache_block_size_tokens", "gauge", "config/block_size", "tokens",
                 "Tokens per KV block (vllm:cache_config_info block_size; on hybrid models the minimum over the "
                 "KV groups)."),
    EngineSeries("kvwatch_engine_kv_cache_max_concurrency", "gauge", "config/kv_cache_max_concurrency", "requests",
                 "Requests of max_model_len tokens the cache holds at once (vllm:cache_config_info "
                 "kv_cache_max_concurrency, vLLM 0.24+): capacity / max_model_len, not --max-num-seqs.", good="high"),
    EngineSeries("kvwatch_engine_prompt_tokens_by_source", "counter", "prompt_tokens_by_source/*", "tokens",
                 "Prompt tokens by where they came from: local_compute, local_cache_hit, external_kv_transfer; "
                 "the sources sum to the prompt tokens (vllm:prompt_tokens_by_source_total, vLLM 0.16+).",
                 label="source"),
    EngineSeries("kvwatch_engine_prompt_tokens_cached_by_source", "counter", "prompt_tokens_cached_by_source/*",
                 "tokens",
                 "Cached prompt tokens by the tier that supplied them: device, host, p2p, disk, "
                 "external_unspecified (vllm:prompt_tokens_cached_by_source_total, vLLM 0.32+).", label="source"),
    EngineSeries("kvwatch_engine_prompt_tokens_recomputed", "counter", "prompt_tokens_recomputed", "tokens",
                 "Cached prompt tokens computed again because the whole prompt was cached and the model needs one "
                 "token to produce logits: one per fully cached prompt, not preemption recompute "
                 "(vllm:prompt_tokens_recomputed_total, vLLM 0.16 to 0.19 only)."),
    EngineSeries("kvwatch_engine_request_num_preemptions", "histogram", "preemptions_per_request", "preemptions",
                 "Preemptions per finished request, 0 included (0 and 1 share the first bucket) "
                 "(vllm:request_num_preemptions, vLLM 0.30+).", good="low"),
    EngineSeries("kvwatch_engine_admission_rejections", "counter", "admission_rejections/*", "requests",
                 "Requests the front end rejected at a queue limit, by reason: max_num_queued_reqs, "
                 "max_num_queued_tokens (vllm:admission_rejections_total, vLLM 0.32+; vLLM labels it per model, "
                 "kvwatch books it on the model's lowest engine).", label="reason", good="low"),
    EngineSeries("kvwatch_engine_sleep_state", "gauge", "sleep_state/*", "state",
                 "Engine sleep state: awake=1 when serving, weights_offloaded=1 or discard_all=1 in sleep levels 1 "
                 "and 2; a sleeping engine is not a down engine (vllm:engine_sleep_state, vLLM 0.11.1+).",
                 label="sleep_state"),
    EngineSeries("kvwatch_engine_healthy", "gauge", "engine_healthy", "state",
                 "1 while the engine reports healthy under fault tolerance, else 0 (vllm:engine_healthy; only with "
                 "--enable-fault-tolerance).", good="high"),
    EngineSeries("kvwatch_engine_kv_block_lifetime_seconds", "histogram", "kv_block_lifetime", "seconds",
                 "Sampled KV block lifetimes, allocation to eviction (vllm:kv_block_lifetime_seconds; only with "
                 "--kv-cache-metrics)."),
    EngineSeries("kvwatch_engine_kv_block_idle_before_evict_seconds", "histogram", "kv_block_idle_before_evict",
                 "seconds",
                 "Sampled idle time of KV blocks before eviction (vllm:kv_block_idle_before_evict_seconds; only with "
                 "--kv-cache-metrics)."),
    EngineSeries("kvwatch_engine_kv_block_reuse_gap_seconds", "histogram", "kv_block_reuse_gap", "seconds",
                 "Sampled gaps between consecutive accesses of a KV block (vllm:kv_block_reuse_gap_seconds; only "
                 "with --kv-cache-metrics)."),
    EngineSeries("kvwatch_engine_kv_offload_load_bytes", "counter", "offload_load_bytes", "bytes",
                 "Bytes loaded from the offload tier into GPU KV blocks (vllm:kv_offload_load_bytes_total, else the "
                 "deprecated vllm:kv_offload_total_bytes_total{transfer_type=\"CPU_to_GPU\"}, never both; "
                 "OffloadingConnector only)."),
    EngineSeries("kvwatch_engine_kv_offload_store_bytes", "counter", "offload_store_bytes", "bytes",
                 "Bytes stored from GPU KV blocks to the offload tier (vllm:kv_offload_store_bytes_total, else "
                 "vllm:kv_offload_total_bytes_total{transfer_type=\"GPU_to_CPU\"}; OffloadingConnector only)."),
    EngineSeries("kvwatch_engine_kv_offload_load_seconds", "counter", "offload_load_seconds", "seconds",
                 "Time spent loading from the offload tier (vllm:kv_offload_load_time_total, else "
                 "vllm:kv_offload_total_time_total{transfer_type=\"CPU_to_GPU\"})."),
    EngineSeries("kvwatch_engine_kv_offload_store_seconds", "counter", "offload_store_seconds", "seconds",
                 "Time spent storing to the offload tier (vllm:kv_offload_store_time_total, else "
                 "vllm:kv_offload_total_time_total{transfer_type=\"GPU_to_CPU\"})."),
    EngineSeries("kvwatch_engine_kv_offload_allocation_failures", "counter", "offload_allocation_failures",
                 "failures", "Offload-tier allocations that failed (vllm:kv_offload_allocation_failure_total).", good="low"),
    EngineSeries("kvwatch_engine_kv_offload_stores_skipped", "counter", "offload_stores_skipped", "stores",
                 "Offload-tier stores left out because the block was offered fewer times than the reuse threshold: "
                 "a policy, not a failure (vllm:kv_offload_stores_skipped_total; the CPU tier with "
                 "store_threshold >= 2 only)."),
    EngineSeries("kvwatch_engine_kv_offload_lookup_sync_delay_seconds", "histogram", "offload_lookup_sync_delay",
                 "seconds",
                 "Time inside each offload lookup call, which the scheduler's step waits on "
                 "(vllm:kv_offload_lookup_sync_delay_seconds; OffloadingConnector only).", good="low"),
    EngineSeries("kvwatch_engine_kv_offload_lookup_async_delay_seconds", "histogram", "offload_lookup_async_delay",
                 "seconds",
                 "Time from a request's offload lookup first deferring to the lookup that resolves it, or the "
                 "request's end: how long the tier kept it waiting (vllm:kv_offload_lookup_async_delay_seconds; "
                 "OffloadingConnector only).", good="low"),
    EngineSeries("kvwatch_engine_requests_kv_fetch_by_stage", "gauge", "kv_fetch_by_stage/*", "requests",
                 "Waiting requests by async KV load stage: waiting_to_start, in_progress, completed_waiting "
                 "(vllm:num_requests_kv_fetch_by_stage, vLLM 0.32+; a KV consumer only).", label="stage",
                 good="low"),
    EngineSeries("kvwatch_engine_hicache_load_back_seconds", "histogram", "hicache_load_back_time", "seconds",
                 "Time of each load of KV from SGLang's HiCache host tier (L2) back to the GPU "
                 "(sglang:load_back_duration_seconds).", good="low"),
    EngineSeries("kvwatch_engine_hicache_load_back_bytes", "counter", "hicache_load_back_bytes", "bytes",
                 "Bytes loaded back from SGLang's HiCache host tier (L2) to the GPU, all pools, draft transfers "
                 "included (sglang:load_back_bytes_total)."),
    EngineSeries("kvwatch_engine_hicache_backup_bytes", "counter", "hicache_backup_bytes", "bytes",
                 "Bytes backed up from the GPU to SGLang's HiCache host tier (L2), all pools, draft transfers "
                 "included (sglang:hicache_backup_bytes_total)."),
    EngineSeries("kvwatch_engine_prefill_forward_seconds", "counter", "prefill_forward_seconds", "seconds",
                 "GPU seconds of extend (prefill) forward passes (sglang:forward_execution_seconds_total"
                 "{category=\"forward_extend\"}; SGLANG_ENABLE_METRICS_DEVICE_TIMER=1 only)."),
    EngineSeries("kvwatch_engine_kv_offload_cpu_pinned_ratio", "gauge", "offload_cpu_pinned", "ratio",
                 "Share of the CPU offload tier pinned by in-flight transfers (vllm:kv_offload_cpu_cache_usage_perc): "
                 "evictable blocks do not count, so it reads 0 on a full tier at rest; not the tier's usage."),
    EngineSeries("kvwatch_engine_kv_offload_load_size_bytes", "histogram", "offload_load_size", "bytes",
                 "Bytes per load from the offload tier into GPU KV blocks, one observation per operation "
                 "(vllm:kv_offload_load_size, else the deprecated vllm:kv_offload_size{transfer_type=\"CPU_to_GPU\"}, "
                 "never both; OffloadingConnector only)."),
    EngineSeries("kvwatch_engine_kv_offload_store_size_bytes", "histogram", "offload_store_size", "bytes",
                 "Bytes per store from GPU KV blocks to the offload tier, one observation per operation "
                 "(vllm:kv_offload_store_size, else vllm:kv_offload_size{transfer_type=\"GPU_to_CPU\"}; "
                 "OffloadingConnector only)."),
    EngineSeries("kvwatch_engine_nixl_failed_transfers", "counter", "nixl_failed_transfers", "transfers",
                 "Failed NIXL KV transfers, handshake and notification failures included, so never add "
                 "kvwatch_engine_nixl_failed_notifications to it (vllm:nixl_num_failed_transfers_total; "
                 "NixlConnector only).", good="low"),
    EngineSeries("kvwatch_engine_nixl_failed_notifications", "counter", "nixl_failed_notifications", "notifications",
                 "Failed NIXL notifications, already counted in kvwatch_engine_nixl_failed_transfers "
                 "(vllm:nixl_num_failed_notifications_total; NixlConnector only).", good="low"),
    EngineSeries("kvwatch_engine_nixl_expired_requests", "counter", "nixl_expired_requests", "requests",
                 "Requests whose KV expired before the peer fetched it, counted on the prefill instance; not a "
                 "transport failure (vllm:nixl_num_kv_expired_reqs_total; NixlConnector only).", good="low"),
    EngineSeries("kvwatch_engine_nixl_notifications_after_expiry", "counter", "nixl_notifications_after_expiry",
                 "notifications",
                 "Completion notifications for requests no longer tracked, usually because their KV lease expired "
                 "(the blocks may have been reused before the transfer finished), one per remote rank "
                 "(vllm:nixl_num_notifications_after_expiry_total; NixlConnector only).", good="low"),
    EngineSeries("kvwatch_engine_nixl_transfer_seconds", "histogram", "nixl_transfer_time", "seconds",
                 "Duration of each NIXL KV transfer (vllm:nixl_xfer_time_seconds; NixlConnector only).", good="low"),
    EngineSeries("kvwatch_engine_nixl_post_seconds", "histogram", "nixl_post_time", "seconds",
                 "Time to post each NIXL KV transfer (vllm:nixl_post_time_seconds; NixlConnector only).", good="low"),
    EngineSeries("kvwatch_engine_nixl_transfer_bytes", "histogram", "nixl_transfer_bytes", "bytes",
                 "Bytes per NIXL KV transfer (vllm:nixl_bytes_transferred; NixlConnector only)."),
    EngineSeries("kvwatch_engine_nixl_descriptors", "histogram", "nixl_descriptors", "descriptors",
                 "Descriptors per NIXL KV transfer (vllm:nixl_num_descriptors; NixlConnector only)."),
)


# --------------------------------------------------------------------------
# LMCache: a KV tier beside the engine, read from its own page
# --------------------------------------------------------------------------

# Its counters describe the same requests as the engine's external-cache
# counters, so they are exported apart (`kvwatch_lmcache_*`, per model, no
# `engine` label: LMCache's ranks repeat one count and kvwatch reads the first
# worker's) and never added to the engine's. kvwatch/pipeline/lmcache.py reads
# them; present only while `lmcache_target` is set and its latest poll succeeded.
TIER_IDENTITY = ("model_name",)


@dataclass(frozen=True)
class TierSeries:
    name: str  # exported family name, a counter without `_total`
    key: str  # canonical key in the tier's window
    family: str  # LMCache's counter, without `lmcache:` and `_total`
    unit: str
    help: str
    kind: str = "counter"
    good: str | None = None

    @property
    def sample_name(self) -> str:
        return self.name + "_total"


TIER_SERIES: tuple[TierSeries, ...] = (
    TierSeries("kvwatch_lmcache_retrieve_requests", "retrieve_requests", "num_retrieve_requests", "requests",
               "Retrievals the engine asked of LMCache (lmcache:num_retrieve_requests, first worker)."),
    TierSeries("kvwatch_lmcache_requested_tokens", "requested_tokens", "num_requested_tokens", "tokens",
               "Tokens the engine asked LMCache to load: what its lookup found, less what vLLM had "
               "(lmcache:num_requested_tokens, first worker)."),
    TierSeries("kvwatch_lmcache_hit_tokens", "hit_tokens", "num_hit_tokens", "tokens",
               "Tokens LMCache delivered to the engine (lmcache:num_hit_tokens, first worker).", good="high"),
    TierSeries("kvwatch_lmcache_prompt_tokens", "prompt_tokens", "num_prompt_tokens", "tokens",
               "Prompt tokens of the requests LMCache's connector scheduled, counted by the worker as they are "
               "loaded (lmcache:num_prompt_tokens, first worker; absent in builds before it)."),
    TierSeries("kvwatch_lmcache_stored_tokens", "stored_tokens", "num_stored_tokens", "tokens",
               "Tokens stored into LMCache, evicted ones included (lmcache:num_stored_tokens, first worker)."),
    # The multiprocess server (LMCache 0.5: `lmcache server`, LMCacheMPConnector)
    # counts through OpenTelemetry: `lmcache_mp.lookup_requested` with unit
    # tokens is `lmcache_mp_lookup_requested_tokens_total` on its Prometheus
    # page. One server process, no worker ranks; `cache_salt` (a tenant)
    # splits the counts, so its series are summed per model.
    TierSeries("kvwatch_lmcache_lookup_requested_tokens", "lookup_requested_tokens", "mp_lookup_requested_tokens",
               "tokens",
               "Tokens the multiprocess server was asked to look up, chunk-aligned part only "
               "(lmcache_mp_lookup_requested_tokens_total, summed over cache_salt; LMCache 0.5 multiprocess mode)."),
    TierSeries("kvwatch_lmcache_lookup_hit_tokens", "lookup_hit_tokens", "mp_lookup_hit_tokens", "tokens",
               "Tokens its lookups found in L1 (CPU memory) or L2 (storage), the contiguous prefix only "
               "(lmcache_mp_lookup_hit_tokens_total, summed over cache_salt).", good="high"),
    TierSeries("kvwatch_lmcache_lookup_hit_l1_tokens", "lookup_hit_l1_tokens", "mp_lookup_hit_l1_tokens", "tokens",
               "Of the lookup hits, tokens L1 already held (lmcache_mp_lookup_hit_l1_tokens_total; l1 + l2 = hit).",
               good="high"),
    TierSeries("kvwatch_lmcache_lookup_hit_l2_tokens", "lookup_hit_l2_tokens", "mp_lookup_hit_l2_tokens", "tokens",
               "Of the lookup hits, tokens L2 added beyond what L1 held: each must be loaded into L1 first "
               "(lmcache_mp_lookup_hit_l2_tokens_total)."),
)


# --------------------------------------------------------------------------
# The engine's KV-cache event stream (kvwatch/kvevents), read beside its page
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamSeries:
    name: str  # exported family name (a counter without `_total`)
    key: str  # the report's totals key
    labels: tuple[str, ...]
    help: str
    kind: str = "counter"

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


STREAM_SERIES: tuple[StreamSeries, ...] = (
    StreamSeries("kvwatch_kv_events_blocks_stored", "stored", ("medium", "lora_name"),
                 "Blocks the engine stored in its prefix cache (BlockStored events' block_hashes), new work only: "
                 "a block announced while cached (full report mode's hits) is reused, not stored; by medium (GPU, "
                 "CPU offload) and LoRA adapter (empty without one)."),
    StreamSeries("kvwatch_kv_events_blocks_reused", "reused", ("medium", "lora_name"),
                 "Blocks announced as stored while cached: the hits of requests in vLLM's full report mode "
                 "(origin REUSED where the events say it, else told by the ledger); 0 in incremental mode, where "
                 "hits leave no event and the page's prefix-cache counters hold them."),
    StreamSeries("kvwatch_kv_events_blocks_stored_again", "stored_again", ("medium", "lora_name"),
                 "Blocks stored again after their eviction (a BlockStored of a hash whose BlockRemoved kvwatch "
                 "saw): recomputation a larger cache would have saved. Scaled from the ledger's sample."),
    StreamSeries("kvwatch_kv_events_blocks_evicted", "evicted", ("medium",),
                 "Blocks the engine evicted from its prefix cache (BlockRemoved events' block_hashes), by medium."),
    StreamSeries("kvwatch_kv_events_tier_blocks", "tiers", ("medium", "locality", "event"),
                 "Blocks per cache tier (medium: GPU, CPU, STORAGE, ...; locality LOCAL or REMOTE where the events "
                 "say it, else empty) by event: stored, evicted, returned. A lower tier's returned are the GPU "
                 "blocks back after their eviction that it held (its hits, not recomputation); the GPU's, every "
                 "block back after its eviction, however served."),
    StreamSeries("kvwatch_kv_events_cache_cleared", "cleared", (),
                 "AllBlocksCleared events: the engine reset its prefix cache (each also a change on the timeline)."),
    StreamSeries("kvwatch_kv_events_eviction_return_seconds", "return_buckets", (),
                 "Time from a block's eviction to its return (stored again), a histogram; scaled from the sample.",
                 kind="histogram"),
)


def engine_series_value(series: EngineSeries, engine: EngineSnapshot, cache_config: dict[str, str]):
    """The current value of a re-exported series for one engine: a float, a
    {label: float} dict, a Histogram, or None."""
    if series.key == "capacity_tokens":
        return capacity_tokens(cache_config)
    if series.key.startswith("config/"):
        return config_number(cache_config, series.key[len("config/"):])
    source = engine.histograms if series.kind == "histogram" else (
        engine.counters if series.kind == "counter" else engine.gauges)
    if series.key.endswith("/*"):
        prefix = series.key[:-1]
        found = {k[len(prefix):]: v for k, v in source.items() if k.startswith(prefix)}
        return found or None
    return source.get(series.key)
