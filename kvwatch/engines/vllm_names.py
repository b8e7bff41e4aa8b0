"""vLLM's version knowledge, declared once: the alias tables (for each
canonical key, the vLLM families that have carried it, newest first; the
first one present for an engine wins, so a version that emits both names,
0.9.2 to 0.11 emit `kv_cache_usage_perc` and `gpu_cache_usage_perc`, reads
the current one), the flags that light config-gated families, the versions
that carry each family, and the counters older releases counted otherwise.
The adapter (kvwatch/engines/vllm.py) reads them and re-exports them."""

from __future__ import annotations

from kvwatch.exposition import Family

# Spellings of the namespace on the wire: the native one, the OpenMetrics
# `escaping=underscores` rewrite, and Ray Serve's.
PREFIXES = ("vllm:", "vllm_", "ray_vllm:", "ray_vllm_")

# canonical key -> vLLM families, newest first.
GAUGES: dict[str, tuple[str, ...]] = {
    "kv_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "running": ("num_requests_running",),
    "waiting": ("num_requests_waiting",),
    # V0 only; -1 means "no data yet".
    "v0_prefix_hit_rate": ("gpu_prefix_cache_hit_rate",),
    # OffloadingConnector's CPU tier: the share of its blocks pinned by
    # in-flight transfers (evictable blocks subtracted), so it reads 0 on a
    # full tier at rest. Never call it usage.
    "offload_cpu_pinned": ("kv_offload_cpu_cache_usage_perc",),
}
COUNTERS: dict[str, tuple[str, ...]] = {
    # Tokens since 0.9.0; blocks in V1 0.7.3-0.8.x. Ratios are unaffected.
    "prefix_queries": ("prefix_cache_queries", "gpu_prefix_cache_queries"),
    "prefix_hits": ("prefix_cache_hits", "gpu_prefix_cache_hits"),
    "external_prefix_queries": ("external_prefix_cache_queries",),
    "external_prefix_hits": ("external_prefix_cache_hits",),
    "preemptions": ("num_preemptions",),
    # All prompt tokens, cached ones included.
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "prompt_tokens_cached": ("prompt_tokens_cached",),
    # vLLM 0.16-0.19 only: the one token recomputed when a whole prompt was
    # cached (the model needs one token to compute logits from); not
    # preemption recompute.
    "prompt_tokens_recomputed": ("prompt_tokens_recomputed",),
    # OffloadingConnector (--kv-transfer-config); the deprecated
    # kv_offload_total_* forms are read only where these are absent
    # (COUNTER_FALLBACKS): both count the same bytes.
    "offload_load_bytes": ("kv_offload_load_bytes",),
    "offload_store_bytes": ("kv_offload_store_bytes",),
    "offload_load_seconds": ("kv_offload_load_time",),
    "offload_store_seconds": ("kv_offload_store_time",),
    "offload_allocation_failures": ("kv_offload_allocation_failure",),
    # The CPU spec's stores left out on purpose: a block offered fewer times
    # than its reuse threshold (store_threshold >= 2) is not stored.
    "offload_stores_skipped": ("kv_offload_stores_skipped",),
    # NixlConnector (--kv-transfer-config).
    "nixl_failed_transfers": ("nixl_num_failed_transfers",),
    "nixl_failed_notifications": ("nixl_num_failed_notifications",),
    "nixl_expired_requests": ("nixl_num_kv_expired_reqs",),
    "nixl_notifications_after_expiry": ("nixl_num_notifications_after_expiry",),
}
# canonical key -> (deprecated family, its label, the value that means the
# key): read only when no family of COUNTERS[key] is on the page, so the
# deprecated and the current forms are never added together.
COUNTER_FALLBACKS: dict[str, tuple[str, str, str]] = {
    "offload_load_bytes": ("kv_offload_total_bytes", "transfer_type", "CPU_to_GPU"),
    "offload_store_bytes": ("kv_offload_total_bytes", "transfer_type", "GPU_to_CPU"),
    "offload_load_seconds": ("kv_offload_total_time", "transfer_type", "CPU_to_GPU"),
    "offload_store_seconds": ("kv_offload_total_time", "transfer_type", "GPU_to_CPU"),
}
# Labelled families flattened as "<key>/<label value>".
LABELLED_GAUGES: dict[str, tuple[str, str]] = {
    "waiting_by_reason": ("num_requests_waiting_by_reason", "reason"),
    # awake=1, or weights_offloaded=1 / discard_all=1 for sleep levels 1 and 2.
    "sleep_state": ("engine_sleep_state", "sleep_state"),
    # A KV consumer's waiting requests by async KV load stage:
    # waiting_to_start, in_progress, completed_waiting (0.32+).
    "kv_fetch_by_stage": ("num_requests_kv_fetch_by_stage", "stage"),
}
LABELLED_COUNTERS: dict[str, tuple[str, str]] = {
    "finished": ("request_success", "finished_reason"),
    # local_compute, local_cache_hit, external_kv_transfer: sums to prompt_tokens.
    "prompt_tokens_by_source": ("prompt_tokens_by_source", "source"),
    # device, host, p2p, disk, external_unspecified: sums to local + external hits.
    "prompt_tokens_cached_by_source": ("prompt_tokens_cached_by_source", "source"),
}
# Families that carry only part of an engine's identity. engine_healthy
# (--enable-fault-tolerance) has `engine` and no `model_name`: it applies to
# every model's engine of that index. admission_rejections has `model_name`
# and no `engine` (the front end rejects before any engine sees the request):
# it is booked on the model's lowest engine, so a model's sum is right and no
# engine "0" is invented where the page has none.
ENGINE_ONLY_GAUGES: dict[str, str] = {
    "engine_healthy": "engine_healthy",
}
MODEL_ONLY_COUNTERS: dict[str, tuple[str, str]] = {
    "admission_rejections": ("admission_rejections", "reason"),
}
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("time_to_first_token_seconds",),
    "queue_time": ("request_queue_time_seconds", "time_in_queue_requests"),
    "prefill_time": ("request_prefill_time_seconds",),
    # Observed with prefill_time, at the request's end: the tokens that time computed (kvwatch.signals.worth's fit).
    "prefill_computed": ("request_prefill_kv_computed_tokens",),
    "decode_time": ("request_decode_time_seconds",),
    "inference_time": ("request_inference_time_seconds",),
    "e2e_latency": ("e2e_request_latency_seconds",),
    # Per output event (with speculative decoding one event carries several
    # tokens); `tpot` below is the per-request mean per token.
    "inter_token_latency": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "tpot": ("request_time_per_output_token_seconds",),
    "prompt_len": ("request_prompt_tokens",),
    "generation_len": ("request_generation_tokens",),
    "kv_block_lifetime": ("kv_block_lifetime_seconds",),
    "kv_block_idle_before_evict": ("kv_block_idle_before_evict_seconds",),
    "kv_block_reuse_gap": ("kv_block_reuse_gap_seconds",),
    # Observed for every finished request, 0 included (0 and 1 share the
    # first bucket, le=1).
    "preemptions_per_request": ("request_num_preemptions",),
    # OffloadingConnector: bytes per load / store operation (the deprecated
    # kv_offload_size{transfer_type} is read only where these are absent,
    # HISTOGRAM_FALLBACKS).
    "offload_load_size": ("kv_offload_load_size",),
    "offload_store_size": ("kv_offload_store_size",),
    # OffloadingConnector's scheduler side: the time inside one offload
    # lookup call (it blocks the scheduler's step), and the time from a
    # request's lookup first deferring to the lookup that resolves it (or the
    # request's end): how long the tier kept a request waiting.
    "offload_lookup_sync_delay": ("kv_offload_lookup_sync_delay_seconds",),
    "offload_lookup_async_delay": ("kv_offload_lookup_async_delay_seconds",),
    # NixlConnector: per transfer, its duration, the time to post it, its
    # bytes and its descriptors.
    "nixl_transfer_time": ("nixl_xfer_time_seconds",),
    "nixl_post_time": ("nixl_post_time_seconds",),
    "nixl_transfer_bytes": ("nixl_bytes_transferred",),
    "nixl_descriptors": ("nixl_num_descriptors",),
}
# canonical key -> (deprecated histogram, its label, the value that means the
# key), read as COUNTER_FALLBACKS are: only where HISTOGRAMS[key] is absent.
HISTOGRAM_FALLBACKS: dict[str, tuple[str, str, str]] = {
    "offload_load_size": ("kv_offload_size", "transfer_type", "CPU_to_GPU"),
    "offload_store_size": ("kv_offload_size", "transfer_type", "GPU_to_CPU"),
}
# vLLM family -> the releases that export it ("0.9.2+", "V0 to 0.10"), as
# compared across the release wheels (see docs/metrics.md, generated from
# this table and the ones above).
VERSIONS: dict[str, str] = {
    "kv_cache_usage_perc": "0.9.2+",
    "gpu_cache_usage_perc": "V0; V1 to 0.10 (hidden in 0.11, removed in 0.12)",
    "num_requests_running": "all",
    "num_requests_waiting": "all",
    "gpu_prefix_cache_hit_rate": "V0 only (removed in 0.9.1)",
    "kv_offload_cpu_cache_usage_perc": "0.27+ (OffloadingConnector's CPU tier)",
    "prefix_cache_queries": "0.9.2+",
    "gpu_prefix_cache_queries": "V1 0.7.3 to 0.11 (blocks before 0.9, tokens after)",
    "prefix_cache_hits": "0.9.2+",
    "gpu_prefix_cache_hits": "V1 0.7.3 to 0.11 (blocks before 0.9, tokens after)",
    "external_prefix_cache_queries": "0.11.1+ (always registered; 0 without a KV connector)",
    "external_prefix_cache_hits": "0.11.1+ (always registered; 0 without a KV connector)",
    "num_preemptions": "V1 0.8+",
    "prompt_tokens": "all",
    "generation_tokens": "all",
    "prompt_tokens_cached": "0.16+",
    "prompt_tokens_recomputed": "0.16 to 0.19 only",
    "kv_offload_load_bytes": "0.27+",
    "kv_offload_store_bytes": "0.27+",
    "kv_offload_load_time": "0.27+",
    "kv_offload_store_time": "0.27+",
    "kv_offload_allocation_failure": "0.27+",
    "kv_offload_stores_skipped": "recent releases, 0.32 has it (the OffloadingConnector's CPU tier, only with store_threshold >= 2)",
    "kv_offload_lookup_sync_delay_seconds": "0.27+",
    "kv_offload_lookup_async_delay_seconds": "0.27+",
    "num_requests_kv_fetch_by_stage": "0.32+ (a KV consumer only)",
    "kv_offload_total_bytes": "deprecated CPU-offload form, still emitted beside the load/store split",
    "kv_offload_total_time": "deprecated CPU-offload form, still emitted beside the load/store split",
    "nixl_num_failed_transfers": "with NixlConnector",
    "nixl_num_failed_notifications": "with NixlConnector",
    "nixl_num_kv_expired_reqs": "with NixlConnector",
    "nixl_num_notifications_after_expiry": "with NixlConnector (recent releases; 0.32 has it)",
    "kv_offload_load_size": "0.27+",
    "kv_offload_store_size": "0.27+",
    "kv_offload_size": "deprecated CPU-offload form ({transfer_type}), still emitted beside the load/store split",
    "nixl_xfer_time_seconds": "with NixlConnector",
    "nixl_post_time_seconds": "with NixlConnector",
    "nixl_bytes_transferred": "with NixlConnector",
    "nixl_num_descriptors": "with NixlConnector",
    "num_requests_waiting_by_reason": "0.20+",
    "engine_sleep_state": "0.11.1+",
    "request_success": "all",
    "prompt_tokens_by_source": "0.16+",
    "prompt_tokens_cached_by_source": "0.32+",
    "engine_healthy": "with fault tolerance (recent releases)",
    "admission_rejections": "0.32+",
    "time_to_first_token_seconds": "all",
    "request_queue_time_seconds": "0.6+",
    "time_in_queue_requests": "V0 0.6 to 0.9.0",
    "request_prefill_time_seconds": "0.6+",
    "request_prefill_kv_computed_tokens": "0.13+",
    "request_decode_time_seconds": "0.6+",
    "request_inference_time_seconds": "0.6+",
    "e2e_request_latency_seconds": "all",
    "inter_token_latency_seconds": "0.10.2+",
    "time_per_output_token_seconds": "V0; V1 to 0.11 (hidden 0.12 to 0.14, removed in 0.15)",
    "request_time_per_output_token_seconds": "0.11+",
    "request_prompt_tokens": "all",
    "request_generation_tokens": "all",
    "kv_block_lifetime_seconds": "0.12+",
    "kv_block_idle_before_evict_seconds": "0.12+",
    "kv_block_reuse_gap_seconds": "0.12+",
    "request_num_preemptions": "0.30+",
    "cache_config_info": "all (its labels change with every release; kv_cache_size_tokens and "
                         "kv_cache_max_concurrency 0.24+; kv_cache_memory_bytes already on 0.10.2, as \"None\" there (its CPU "
                         "worker ignores --kv-cache-memory-bytes), a number on 0.20.2 given that flag; mamba_block_size is a number "
                         "only on hybrid models, whose mamba_* labels kvwatch shows in capacity and the exhaustion "
                         "evidence)",
    "lora_requests_info": "with LoRA",
}
# canonical key -> what lights it: the families vLLM registers only when a
# flag asks for them. Where such a family is absent, its signals are absent
# (never 0) and /api/v1/signals names the flag.
GATES: dict[str, str] = {
    "kv_block_lifetime": "--kv-cache-metrics",
    "kv_block_idle_before_evict": "--kv-cache-metrics",
    "kv_block_reuse_gap": "--kv-cache-metrics",
    "offload_cpu_pinned": "--kv-transfer-config with the OffloadingConnector (CPU tier)",
    "offload_load_bytes": "--kv-transfer-config with the OffloadingConnector",
    "offload_store_bytes": "--kv-transfer-config with the OffloadingConnector",
    "offload_load_seconds": "--kv-transfer-config with the OffloadingConnector",
    "offload_store_seconds": "--kv-transfer-config with the OffloadingConnector",
    "offload_allocation_failures": "--kv-transfer-config with the OffloadingConnector",
    "offload_stores_skipped": "--kv-transfer-config with the OffloadingConnector (CPU tier, store_threshold >= 2)",
    "offload_lookup_sync_delay": "--kv-transfer-config with the OffloadingConnector",
    "offload_lookup_async_delay": "--kv-transfer-config with the OffloadingConnector",
    "kv_fetch_by_stage": "--kv-transfer-config with a KV connector in a consumer role (kv_consumer or kv_both)",
    "nixl_failed_transfers": "--kv-transfer-config with the NixlConnector",
    "nixl_failed_notifications": "--kv-transfer-config with the NixlConnector",
    "nixl_expired_requests": "--kv-transfer-config with the NixlConnector",
    "nixl_notifications_after_expiry": "--kv-transfer-config with the NixlConnector",
    "offload_load_size": "--kv-transfer-config with the OffloadingConnector",
    "offload_store_size": "--kv-transfer-config with the OffloadingConnector",
    "nixl_transfer_time": "--kv-transfer-config with the NixlConnector",
    "nixl_post_time": "--kv-transfer-config with the NixlConnector",
    "nixl_transfer_bytes": "--kv-transfer-config with the NixlConnector",
    "nixl_descriptors": "--kv-transfer-config with the NixlConnector",
    "engine_healthy": "--enable-fault-tolerance",
}


# Counters that meant something else in older releases: canonical key -> (the
# test on the page's families that tells an older release, what its counter
# counts there). The tests are read from the families a page carries, since no
# vLLM page states its version; each was seen on a real build (the captures in
# tests/fixtures/vllm-0.10.2-cpu and vllm-0.20.2-cpu). Signals and findings
# read from such a counter say so (Snapshot.counting).
RELOOKUPS = (
    "vLLM before 0.32 (this page has no vllm:prompt_tokens_cached_by_source; seen on 0.10.2 and 0.20.2) counts a "
    "request that waits for KV space in the prefix-cache lookup counters again at every scheduling attempt, so "
    "hits over queries is a ratio of lookups, inflated or deflated by re-lookups, not the share of prompt tokens "
    "served from the cache")
LATE_PREEMPTIONS = (
    "vLLM's V1 engine before 0.11 (this page still carries vllm:gpu_cache_usage_perc; seen on 0.10.2) counts a "
    "preemption when the preempted request next produces output, so the counter trails the event")


def counting_caveats(families: dict[str, Family]) -> dict[str, str]:
    """canonical counter key -> how this page's release counts it, where that
    differs from the current meaning (empty for a current page)."""
    found = {}
    v1_lookups = "prefix_cache_queries" in families or "gpu_prefix_cache_queries" in families
    if v1_lookups and "prompt_tokens_cached_by_source" not in families:
        found["prefix_queries"] = found["prefix_hits"] = RELOOKUPS
    # V1 0.8 to 0.10 still showed gpu_cache_usage_perc (hidden in 0.11); V0,
    # which had it too, had no lookup counters but its hit-rate gauge.
    if "num_preemptions" in families and "gpu_cache_usage_perc" in families and v1_lookups:
        found["preemptions"] = LATE_PREEMPTIONS
    return found


def key_families() -> dict[str, str]:
    """canonical key -> the newest vLLM family that carries it."""
    keys: dict[str, str] = {}
    for table in (GAUGES, COUNTERS, HISTOGRAMS):
        keys.update({key: aliases[0] for key, aliases in table.items()})
    for labelled in (LABELLED_GAUGES, LABELLED_COUNTERS, MODEL_ONLY_COUNTERS):
        keys.update({key: family for key, (family, _label) in labelled.items()})
    keys.update(ENGINE_ONLY_GAUGES)
    return keys


KEY_FAMILIES = key_families()


CACHE_CONFIG = "cache_config_info"
LORA = "lora_requests_info"
# The counter whose `_created` series marks the engine's start.
RESTART_MARKER = "prompt_tokens"

# Labels that identify an engine, and the per-family dimensions we keep.
IDENTITY_LABELS = ("model_name", "engine")


def all_families() -> list[str]:
    names: list[str] = []
    for table in (GAUGES, COUNTERS, HISTOGRAMS):
        for aliases in table.values():
            names.extend(aliases)
    names.extend(family for family, _ in LABELLED_GAUGES.values())
    names.extend(family for family, _ in LABELLED_COUNTERS.values())
    names.extend(family for family, _, _ in COUNTER_FALLBACKS.values())
    names.extend(family for family, _, _ in HISTOGRAM_FALLBACKS.values())
    names.extend(ENGINE_ONLY_GAUGES.values())
    names.extend(family for family, _ in MODEL_ONLY_COUNTERS.values())
    names.extend((CACHE_CONFIG, LORA))
    return names
