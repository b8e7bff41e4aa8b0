"""The catalogue: every signal kvwatch derives, declared once.

Each entry names the exported metric, its unit, a help text naming its vLLM
sources, how it is derived in-process from a window, its PromQL twin over the
series kvwatch re-exports (for recording rules and dashboards), and the
dashboard group it belongs to. The exporter, the JSON API, the rules, the
dashboards and the README's metrics table are all generated from this file.

Two kinds of entries:
- ENGINE_SERIES: vLLM's own series, re-exported under one stable name per
  concept whatever the vLLM version spelled (`kvwatch_engine_*`). Counters and
  histograms pass through unchanged (resets included; Prometheus' rate()
  handles them), so recording rules can aggregate them correctly across many
  sidecars: ratios of summed rates, `sum by (le)` before quantiles.
- SIGNALS: windowed values computed in-process (`kvwatch_*` per model and
  engine, `kvwatch_model_*` per model), for the status page, the CLI, the
  diagnosis, and for anyone without recording rules.

PromQL templates use `{sel}` for the label selector (without braces), `{w}`
for the range and `{by}` for the aggregation labels.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Callable

from kvwatch import units
from kvwatch.snapshot import EngineSnapshot, Histogram, capacity_tokens, config_number
from kvwatch.window import Increase, Window

QUANTILES = (0.5, 0.95, 0.99)

# The span the exhaustion trend is fitted over: long enough to smooth single
# requests, short enough to follow a ramp. One declaration: the PromQL twin's
# deriv() and avg_over_time() range, and the sidecar's fit in seconds.
TREND_RANGE = "5m"
TREND_SECONDS = units.parse_duration(TREND_RANGE)

# A catalogue unit -> how each surface shows it: Grafana's unit, and the word
# a person reads beside a bare number on the status page and in the CLI ("" where
# the formatted value already says it: 12.5%, 340 ms, 3.1/s).
@dataclass(frozen=True)
class Unit:
    grafana: str
    label: str


UNITS: dict[str, Unit] = {
    "ratio": Unit("percentunit", ""),
    "seconds": Unit("s", ""),
    "tokens": Unit("short", "tokens"),
    "requests": Unit("short", "requests"),
    "per_second": Unit("ops", ""),
    "bytes": Unit("bytes", "bytes"),
    "blocks": Unit("short", "blocks"),
    "state": Unit("short", ""),
    "preemptions": Unit("short", "preemptions"),
    "failures": Unit("short", "failures"),
    "notifications": Unit("short", "notifications"),
    "transfers": Unit("short", "transfers"),
    "descriptors": Unit("short", "descriptors"),
}


# Which side of a threshold a person wants a value on: "high" (hit ratio,
# headroom, up), "low" (usage, latency, errors, findings) or None (neither:
# throughput, running requests). Declared once per entry below; the
# dashboards colour every threshold and value mapping from it, so a panel
# cannot turn red on the good side.
GOOD_DIRECTIONS = ("high", "low", None)


# --------------------------------------------------------------------------
# vLLM series re-exported under stable names
# --------------------------------------------------------------------------


# The identity labels of every per-engine family kvwatch exports.
IDENTITY = ("model_name", "engine")
# cache_config_info keys re-exported on kvwatch_engine_info (a bounded set, not
# the whole open map, so the label set does not change with every vLLM release).
INFO_KEYS = ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "kv_cache_size_tokens")


@dataclass(frozen=True)
class HealthFamily:
    """One of kvwatch's own families: the poll's health, its identity, the
    engine's configuration and the active findings."""

    name: str  # as the client library names it (a counter without _total)
    kind: str  # gauge | counter | untyped
    labels: tuple[str, ...]
    help: str
    good: str | None = None  # GOOD_DIRECTIONS

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_up", "gauge", (), "1 if the latest poll of the engine's /metrics succeeded, else 0.", good="high"),
    HealthFamily("kvwatch_stats_disabled", "gauge", (),
                 "1 while the engine answers its /metrics without engine series (vLLM with --disable-log-stats, "
                 "or another program at the target): not unreachable, but blind; else 0.", good="low"),
    HealthFamily("kvwatch_build_info", "gauge", ("version",), "kvwatch's version; always 1."),
    HealthFamily("kvwatch_polls", "counter", (), "Polls of the engine's /metrics."),
    HealthFamily("kvwatch_poll_errors", "counter", ("reason",),
                 "Failed polls by reason (refused, dns, timeout, tls, http_3xx/4xx/5xx, content_type, too_large, "
                 "truncated, decode, no_engine_metrics, ...).", good="low"),
    HealthFamily("kvwatch_parse_errors", "counter", (),
                 "Malformed lines in the engine's pages (skipped; the rest of the page counts).", good="low"),
    HealthFamily("kvwatch_dropped_series", "counter", (), "(model, engine) pairs dropped by the max_series cap.", good="low"),
    HealthFamily("kvwatch_poll_duration_seconds", "gauge", (), "Wall time of the latest poll.", good="low"),
    HealthFamily("kvwatch_page_late_seconds", "gauge", (),
                 "How long the engine took to answer the latest page kvwatch read (a busy vLLM answers /metrics "
                 "seconds late under load; the page is kept and stamped at the time it was answered).", good="low"),
    HealthFamily("kvwatch_poll_cpu_seconds", "gauge", (),
                 "CPU time of the latest poll (fetch, parse, signals, diagnosis).", good="low"),
    HealthFamily("kvwatch_last_success_timestamp_seconds", "gauge", (), "Unix time of the latest successful poll."),
    HealthFamily("kvwatch_window_seconds", "gauge", (), "Span the windowed signals cover now."),
    HealthFamily("kvwatch_engine_info", "gauge", IDENTITY + INFO_KEYS,
                 "The engine's KV-cache configuration (from vllm:cache_config_info); changes() on it marks a "
                 "configuration change."),
    HealthFamily("kvwatch_source_present", "gauge", ("family",),
                 "1 if the engine's latest page carried this family (vLLM's newest name for it), 0 if not: unknown "
                 "is not zero, so a signal whose families are 0 here is absent, never 0 (/api/v1/signals "
                 "dark_signals names the flag that lights a config-gated one)."),
    HealthFamily("kvwatch_finding", "gauge", ("symptom", "cause", "severity") + IDENTITY,
                 "1 for each active diagnosis finding (absent when not active); a finding stays active until its "
                 "condition has been clear for the hold (diagnosis: finding_hold_seconds); see "
                 "/api/v1/diagnosis for its evidence and clearing_since. One cause per symptom per engine: the "
                 "primary (other causes found at once are kvwatch_finding_contributor).", good="low"),
    HealthFamily("kvwatch_finding_contributor", "gauge", ("symptom", "cause", "contributor") + IDENTITY,
                 "1 for each contributing factor of an active finding: another cause of the same symptom on the "
                 "same engine that the diagnosis also found, weaker than the primary `cause` (absent when none).",
                 good="low"),
    HealthFamily("kvwatch_finding_alternative", "gauge", ("symptom", "cause", "alternative", "decided_by") + IDENTITY,
                 "1 for each cause an active finding cannot be told apart from, once per source that would decide "
                 "(`decided_by`: kv_cache_metrics, kv_events, request_lengths); absent when the finding is decided.",
                 good=None),
    # Untyped: Prometheus' lint refuses a `quantile` label on a gauge, and the
    # label names the quantile it marks (Prometheus stores it as a gauge).
    HealthFamily("kvwatch_quantile_pinned", "untyped", ("signal", "quantile", "bound") + IDENTITY,
                 "1 for each windowed quantile pinned at a bucket edge, where its value is a bound and not an "
                 "estimate: bound=\"upper\" (pinned in the first bucket; the value is that bucket's bound and the "
                 "quantile is at most it), bound=\"lower\" (pinned at the last finite bucket; the quantile is at "
                 "least it). `signal` is the exported family (kvwatch_model_* with engine=\"\" per model); absent "
                 "when no quantile is pinned.", good=None),
)
HEALTH_BY_NAME = {family.name: family for family in HEALTH}

# Prometheus' own series about kvwatch's targets, which the dashboards and
# alerts read beside kvwatch's (not exported by kvwatch).
SCRAPE: tuple[HealthFamily, ...] = (
    HealthFamily("up", "gauge", (), "1 while Prometheus scraped the target (kvwatch) successfully, else 0.",
                 good="high"),
)


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
                 "KV-cache usage 0..1 (vllm:kv_cache_usage_perc, formerly vllm:gpu_cache_usage_perc); evictable prefix-cache blocks count as free.", good="low"),
    EngineSeries("kvwatch_engine_kv_cache_capacity_tokens", "gauge", "capacity_tokens", "tokens",
                 "KV-cache capacity in tokens (vllm:cache_config_info kv_cache_size_tokens, else num_gpu_blocks x block_size).", good="high"),
    EngineSeries("kvwatch_engine_kv_cache_memory_bytes", "gauge", "config/kv_cache_memory_bytes", "bytes",
                 "Bytes of the KV cache (vllm:cache_config_info kv_cache_memory_bytes, vLLM 0.24+); absent before."),
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
# Windowed signals
# --------------------------------------------------------------------------


@dataclass
class View:
    """What a derivation reads: the latest values and the window's increase,
    for one engine or one model (engines merged)."""

    latest: EngineSnapshot
    increase: Increase
    usage_max: float | None
    running_max: float | None
    capacity_tokens: float | None
    block_size: float | None
    # KV bytes held, summed over the view's engines (usage x kv_cache_memory_bytes
    # each); None unless every engine states its cache's bytes.
    kv_used_bytes: float | None = None
    # Whole-block arithmetic, summed over the view's engines; None unless
    # every engine states num_gpu_blocks and block_size and its blocks hold
    # capacity_tokens (not so on hybrid models, where block_size is the
    # minimum over KV groups).
    usable_blocks: float | None = None  # num_gpu_blocks - 1 (vLLM's null block is never allocated)
    used_blocks: float | None = None  # usage x usable blocks, whole
    block_tokens: float | None = None  # used blocks x block_size
    bytes_per_block: float | None = None
    usage_mean: float | None = None
    # Seconds until usage reaches 1 at the window's least-squares trend, the
    # soonest engine of the view; None when usage is not rising.
    exhaustion_eta: float | None = None
    notes: list[str] = field(default_factory=list)
    # The quantiles the derivation running now found pinned at a bucket edge,
    # {quantile: "<" | ">"}; evaluate() files them under the signal's name.
    pinned: dict[str, str] = field(default_factory=dict)

    def gauge(self, key: str) -> float | None:
        return self.latest.gauges.get(key)


@dataclass(frozen=True)
class Signal:
    name: str
    unit: str
    help: str
    derive: Callable[[View], float | None | dict[str, float]]
    group: str  # exhaustion | prefix | first_token | throughput
    promql: str  # fleet twin over kvwatch_engine_* series
    label: str | None = None  # the dimension a dict-valued derivation returns
    # A dashboard key ("overview", "exhaustion", ...): the signal gets a panel
    # of its own there, titled `title`, after the board's hand-laid panels.
    panel: str | None = None
    title: str = ""
    # Its recording rule's name parts, `level:metric:operations`: the metric
    # part and the operations ({w} is the rate window).
    record: tuple[str, str] = ("", "")
    # Canonical snapshot keys the signal cannot do without: where one was not
    # on the page the signal is absent, and /api/v1/signals says so (and
    # names the flag, for a config-gated family).
    needs: tuple[str, ...] = ()
    # What a person reads: the status page and `kvwatch diagnose` label the
    # signal with this (the unit is shown beside it, from `unit`).
    display: str = ""
    # GOOD_DIRECTIONS: the side of a threshold a person wants it on.
    good: str | None = None


def _clamp01(value: float | None) -> float | None:
    # vllm-ascend reported negative usage on hybrid models; usage is 0..1.
    if value is None:
        return None
    # min(1.0, max(0.0, value)) spelled out, without two builtin calls (NaN
    # and -0.0 give 0.0 as there; tests compare the two).
    return (value if value < 1.0 else 1.0) if value > 0.0 else 0.0


def _usage(view: View) -> float | None:
    return _clamp01(view.gauge("kv_usage"))


def _free_tokens(view: View) -> float | None:
    usage = _usage(view)
    if usage is None or view.capacity_tokens is None:
        return None
    # Rounded down to a whole token: headroom never promises a token the
    # cache does not have (usage is block-granular, tokens are whole).
    return float(math.floor(view.capacity_tokens * (1.0 - usage)))


def _used_bytes(view: View) -> float | None:
    return None if view.kv_used_bytes is None else float(round(view.kv_used_bytes))


def _prefix_hit_ratio(view: View) -> float | None:
    ratio = view.increase.ratio("prefix_hits", "prefix_queries")
    if ratio is not None:
        return ratio
    # V0 only had a gauge; -1 means it has no data yet.
    legacy = view.gauge("v0_prefix_hit_rate")
    if legacy is not None and legacy >= 0:
        view.notes.append("prefix hit ratio from the V0 gauge vllm:gpu_prefix_cache_hit_rate (not windowed)")
        return legacy
    return None


def _cached_share(view: View) -> float | None:
    ratio = view.increase.ratio("prompt_tokens_cached", "prompt_tokens")
    if ratio is not None:
        return ratio
    # Before vLLM 0.16 there is no cached-token counter; local plus external
    # hits in tokens (vLLM 0.9+) say the same.
    prompt = view.increase.counters.get("prompt_tokens")
    hits = view.increase.counters.get("prefix_hits")
    if prompt and hits is not None:
        cached = hits + view.increase.counters.get("external_prefix_hits", 0.0)
        # More cached tokens than prompt tokens: the counters disagree (see Increase.ratio).
        return cached / prompt if cached <= prompt else None
    return None


# Each quantile with its name in the values (str(q), written once).
_QUANTILE_NAMES = tuple((q, str(q)) for q in QUANTILES)


def _quantiles(key: str, label: str) -> Callable[[View], dict[str, float] | None]:
    def derive(view: View) -> dict[str, float] | None:
        histogram = view.increase.histograms.get(key)
        if histogram is None or histogram.count <= 0:
            return None
        values = {}
        for q, name in _QUANTILE_NAMES:
            quantile = histogram.reported_quantile(q)
            if quantile is None:
                continue
            values[name] = quantile.value
            bound = quantile.bound
            if bound is not None:
                # Structured for every surface (evaluate() files it under the signal's name).
                view.pinned[name] = bound
                side = "at most" if bound == "<" else "at least"
                where = "in the first bucket" if bound == "<" else "at the last finite bucket"
                view.notes.append(f"{label} p{q * 100:g} is {side} {quantile.value:g}: pinned {where}")
        return values or None

    return derive


def _histogram_mean(view: View, key: str) -> float | None:
    histogram = view.increase.histograms.get(key)
    return histogram.mean() if histogram is not None else None


def _mean(key: str) -> Callable[[View], float | None]:
    def derive(view: View) -> float | None:
        return _histogram_mean(view, key)

    return derive


@dataclass(frozen=True)
class TtftDecomposition:
    """Mean time to first token split into queue, prefill and the rest: the
    one decomposition the signal, the finding, the status page and the rules
    (Fragments.queue_mean/prefill_mean/front_end_mean) read. Shares sum to at
    most 1: queue first, prefill within what is left, the rest clamped at 0."""

    ttft_mean: float
    queue_mean: float | None
    prefill_mean: float | None
    shares: dict[str, float]
    # (queue + prefill) / TTFT when above 1: the engine's histograms disagree
    # (queue and prefill are observed when a request finishes, TTFT at its
    # first token, so over a window of changing load the parts lag).
    parts_over_ttft: float | None = None

    @property
    def other_mean(self) -> float | None:
        if self.queue_mean is None or self.prefill_mean is None:
            return None
        return max(0.0, self.ttft_mean - self.queue_mean - self.prefill_mean)

    @property
    def note(self) -> str | None:
        if self.parts_over_ttft is None:
            return None
        return (f"queue + prefill means are {self.parts_over_ttft:.0%} of the TTFT mean: vLLM observes them when a "
                "request finishes and TTFT at its first token, so under changing load the histograms disagree; "
                "shares are clamped to sum to 100 %")


def ttft_decomposition(view: View) -> TtftDecomposition | None:
    ttft = _histogram_mean(view, "ttft")
    if not ttft:
        return None
    queue = _histogram_mean(view, "queue_time")
    prefill = _histogram_mean(view, "prefill_time")
    queue_share = min(1.0, (queue or 0.0) / ttft)
    prefill_share = min(1.0 - queue_share, (prefill or 0.0) / ttft)
    shares = {"queue": queue_share, "prefill": prefill_share, "other": max(0.0, 1.0 - queue_share - prefill_share)}
    over = ((queue or 0.0) + (prefill or 0.0)) / ttft
    return TtftDecomposition(ttft, queue, prefill, shares, over if over > 1.0 + 1e-9 else None)


def ttft_parts(view: View) -> dict[str, float] | None:
    """The shares of the one decomposition (see TtftDecomposition)."""
    parts = ttft_decomposition(view)
    if parts is None:
        return None
    if parts.note:
        view.notes.append(parts.note)
    return parts.shares


def _rate(key: str) -> Callable[[View], float | None]:
    return lambda view: view.increase.rate(key)


def _labelled_rates(prefix: str) -> Callable[[View], dict[str, float] | None]:
    head = prefix + "/"

    def derive(view: View) -> dict[str, float] | None:
        seconds = view.increase.seconds
        if seconds <= 0:
            return None
        found = {
            key.split("/", 1)[1]: value / seconds
            for key, value in view.increase.counters.items()
            if key.startswith(head)
        }
        return found or None

    return derive


def _failed_rate(view: View) -> float | None:
    if view.increase.seconds <= 0 or not any(k.startswith("finished/") for k in view.increase.counters):
        return None
    failed = sum(view.increase.counters.get(f"finished/{reason}", 0.0) for reason in ("abort", "error"))
    return failed / view.increase.seconds


def _waiting_by_reason(view: View) -> dict[str, float] | None:
    found = {
        key.split("/", 1)[1]: value for key, value in view.latest.gauges.items() if key.startswith("waiting_by_reason/")
    }
    return found or None


def mean_tokens(view: View, histogram_key: str, counter_key: str) -> float | None:
    """Mean tokens per finished request: from the length histogram, else the
    token counter over finished requests."""
    histogram = view.increase.histograms.get(histogram_key)
    if histogram is not None and histogram.count > 0:
        return histogram.mean()
    finished = sum(v for k, v in view.increase.counters.items() if k.startswith("finished/"))
    tokens = view.increase.counters.get(counter_key)
    if finished > 0 and tokens is not None:
        return tokens / finished
    return None


def _capacity_requests(view: View) -> float | None:
    """How many requests of the window's mean prompt+generation length the KV
    capacity holds at once, after rounding each request up to whole blocks.
    A bound, not a promise: prefix sharing raises it; unequal lengths,
    reserves and fragmentation lower it."""
    prompt = mean_tokens(view, "prompt_len", "prompt_tokens")
    generated = mean_tokens(view, "generation_len", "generation_tokens")
    if view.capacity_tokens is None or prompt is None or generated is None or prompt + generated <= 0:
        return None
    per_request = prompt + generated
    if view.block_size:
        blocks = view.capacity_tokens // view.block_size
        return float(blocks // math.ceil(per_request / view.block_size))
    return float(view.capacity_tokens // per_request)


def _used_blocks(view: View) -> float | None:
    return view.used_blocks


def _free_blocks(view: View) -> float | None:
    if view.usable_blocks is None or view.used_blocks is None:
        return None
    return view.usable_blocks - view.used_blocks


def requests_fit_now(view: View) -> float | None:
    """Requests of the running ones' current mean footprint (used blocks /
    running) the usable blocks hold, rounded down: the capacity ceiling at
    current lengths. It falls as running requests decode and grow, before
    the cache is full; kvwatch_kv_cache_capacity_requests reads finished
    requests' lengths and does not move until they finish."""
    running = view.gauge("running")
    if view.usable_blocks is None or not view.used_blocks or not running:
        return None
    return float(math.floor(view.usable_blocks * running / view.used_blocks))


def token_usage_estimate(view: View) -> float | None:
    """Tokens held over the tokens the usable blocks hold. Usage counts whole
    blocks; each running request's last block is partly filled, on average
    by half, so the tokens held are about used blocks x block_size less
    (block_size - 1) / 2 per running request. Prefix sharing does not change
    it (shared blocks are full)."""
    running = view.gauge("running")
    if view.block_tokens is None or view.usable_blocks is None or not view.block_size or running is None:
        return None
    held = max(0.0, view.block_tokens - running * (view.block_size - 1) / 2)
    return held / (view.usable_blocks * view.block_size)


def _exhaustion_eta(view: View) -> float | None:
    return view.exhaustion_eta


def _from_cache(view: View) -> dict[str, float] | None:
    counters = view.increase.counters
    total = sum(v for k, v in counters.items() if k.startswith("prompt_tokens_by_source/"))
    if total <= 0:
        return None
    return {tier: counters.get(f"prompt_tokens_by_source/{source}", 0.0) / total
            for tier, source in (("local", "local_cache_hit"), ("external", "external_kv_transfer"))}


def _first_bucket_at_one(histogram: Histogram) -> float | None:
    for bound, cumulative in zip(histogram.bounds, histogram.cumulative):
        if bound == 1.0:
            return cumulative
    return None


def preemption_repeat_share(view: View) -> float | None:
    """At least this share of the window's preemptions (of requests that
    finished in it) fell on requests preempted two or more times: each such
    request counts at least 2. Near 1: a few requests thrash; near 0: many
    requests were each preempted once (broad pressure)."""
    histogram = view.increase.histograms.get("preemptions_per_request")
    if histogram is None or histogram.sum <= 0:
        return None
    at_most_once = _first_bucket_at_one(histogram)
    if at_most_once is None:
        view.notes.append("vllm:request_num_preemptions has no le=1 bucket: the repeat share is not computed")
        return None
    return min(1.0, 2 * max(0.0, histogram.count - at_most_once) / histogram.sum)


def _quantile_of(view: View, key: str, q: float) -> float | None:
    histogram = view.increase.histograms.get(key)
    if histogram is None or histogram.count <= 0:
        return None
    quantile = histogram.quantile(q)
    return None if quantile is None else quantile.value


def reuse_shortfall_blocks(view: View) -> float | None:
    """Blocks the cache lacks to keep idle prefixes until their typical reuse.
    Evictable blocks count as free, so the free pool is where idle prefixes
    wait; by Little's law, at the same eviction rate a pool holds a block
    about (pool / eviction rate) seconds. Blocks now leave after the median
    idle time I while the median reuse gap is G: keeping them G seconds takes
    a pool G / I times larger, i.e. pool x (G / I - 1) more blocks. 0 when
    blocks outlive the reuse gap; absent without --kv-cache-metrics."""
    idle = _quantile_of(view, "kv_block_idle_before_evict", 0.5)
    gap = _quantile_of(view, "kv_block_reuse_gap", 0.5)
    if idle is None or gap is None or view.usable_blocks is None or view.usage_mean is None:
        return None
    if gap <= idle:
        return 0.0
    pool = view.usable_blocks * (1.0 - view.usage_mean)
    return float(math.ceil(pool * (gap / max(idle, 1e-3) - 1.0)))


def _reuse_shortfall_bytes(view: View) -> float | None:
    blocks = reuse_shortfall_blocks(view)
    if blocks is None or view.bytes_per_block is None:
        return None
    return float(round(blocks * view.bytes_per_block))


def _sleeping(view: View) -> float | None:
    awake = view.gauge("sleep_state/awake")
    return None if awake is None else (0.0 if awake >= 1 else 1.0)


def _offload_rates(view: View) -> dict[str, float] | None:
    if view.increase.seconds <= 0:
        return None
    counters = view.increase.counters
    found = {direction: counters[key] / view.increase.seconds for direction, key in _OFFLOAD_BYTES if key in counters}
    return found or None


_OFFLOAD_BYTES = tuple((direction, f"offload_{direction}_bytes") for direction in ("load", "store"))


def _sel(metric: str) -> str:
    # The result is spliced into a template that is .format()ted later, so the
    # selector's braces must stay escaped: `metric{{{sel}}}` -> `metric{<sel>}`.
    return metric + "{{{sel}}}"


def _ratio_of_rates(numerator: str, denominator: str) -> str:
    return (
        f"sum by ({{by}}) (rate({_sel(numerator)}[{{w}}]))\n/\n"
        f"sum by ({{by}}) (rate({_sel(denominator)}[{{w}}]))"
    )


def _quantile_promql(histogram: str) -> str:
    return f"histogram_quantile({{q}}, sum by ({{by}}, le) (rate({_sel(histogram + '_bucket')}[{{w}}])))"


def _mean_promql(histogram: str) -> str:
    return _ratio_of_rates(histogram + "_sum", histogram + "_count")


SIGNALS: tuple[Signal, ...] = (
    # --- cache exhaustion ---
    Signal("kvwatch_kv_cache_usage_ratio", "ratio",
           "KV-cache usage now, 0..1, clamped (vllm:kv_cache_usage_perc / vllm:gpu_cache_usage_perc).",
           _usage, "exhaustion", "max by ({by}) (kvwatch_engine_kv_cache_usage_ratio{{{sel}}})",
           display="KV cache usage", record=("kvwatch_kv_cache_usage_ratio", "max"), good="low"),
    Signal("kvwatch_kv_cache_usage_max_ratio", "ratio",
           "Highest KV-cache usage seen in the window (vllm:kv_cache_usage_perc).",
           lambda v: _clamp01(v.usage_max), "exhaustion",
           "max by ({by}) (max_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[{w}]))",
           display="KV cache usage, window peak", record=("kvwatch_kv_cache_usage_ratio", "max_over_time{w}"), good="low"),
    Signal("kvwatch_kv_cache_capacity_tokens", "tokens",
           "KV-cache capacity in tokens (vllm:cache_config_info).",
           lambda v: v.capacity_tokens, "exhaustion",
           "sum by ({by}) (kvwatch_engine_kv_cache_capacity_tokens{{{sel}}})",
           display="KV cache capacity", record=("kvwatch_kv_cache_capacity_tokens", "sum"), good="high"),
    Signal("kvwatch_kv_cache_free_tokens", "tokens",
           "KV-cache headroom in tokens: capacity x (1 - usage), rounded down to a whole token "
           "(vllm:cache_config_info, vllm:kv_cache_usage_perc).",
           _free_tokens, "exhaustion",
           "sum by ({by}) (floor(kvwatch_engine_kv_cache_capacity_tokens{{{sel}}} * (1 - kvwatch_engine_kv_cache_usage_ratio{{{sel}}})))",
           display="KV cache headroom", record=("kvwatch_kv_cache_free_tokens", "sum"), good="high"),
    Signal("kvwatch_kv_cache_used_bytes", "bytes",
           "KV-cache bytes held now: usage x the cache's bytes, rounded to a whole byte "
           "(vllm:kv_cache_usage_perc, vllm:cache_config_info kv_cache_memory_bytes; absent before vLLM 0.24).",
           _used_bytes, "exhaustion",
           "sum by ({by}) (clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * kvwatch_engine_kv_cache_memory_bytes{{{sel}}})",
           panel="overview", title="KV bytes in use",
           display="KV cache in use", record=("kvwatch_kv_cache_used_bytes", "sum"), good="low"),
    Signal("kvwatch_kv_cache_capacity_requests", "requests",
           "Concurrent requests the KV capacity holds at the window's mean prompt+generation length, block-rounded and rounded down to a whole request; a bound, not a promise "
           "(vllm:cache_config_info, vllm:request_prompt_tokens, vllm:request_generation_tokens).",
           _capacity_requests, "exhaustion",
           "floor(\nsum by ({by}) (kvwatch_engine_kv_cache_capacity_tokens{{{sel}}})\n/ on ({by}) (\n"
           + _mean_promql("kvwatch_engine_request_prompt_tokens") + "\n+ on ({by})\n"
           + _mean_promql("kvwatch_engine_request_generation_tokens") + "\n)\n)",
           display="Requests the cache holds", record=("kvwatch_kv_cache_capacity_requests", "ratio_rate{w}"), good="high"),
    Signal("kvwatch_preemptions_per_second", "per_second",
           "Preemptions per second over the window (vllm:num_preemptions_total).",
           _rate("preemptions"), "exhaustion",
           "sum by ({by}) (rate(kvwatch_engine_preemptions_total{{{sel}}}[{w}]))",
           display="Preemptions", record=("kvwatch_preemptions", "rate{w}"), good="low"),
    Signal("kvwatch_requests_running", "requests",
           "Requests running now (vllm:num_requests_running).",
           lambda v: v.gauge("running"), "exhaustion",
           "sum by ({by}) (kvwatch_engine_requests_running{{{sel}}})",
           display="Running", record=("kvwatch_requests_running", "sum")),
    Signal("kvwatch_requests_running_max", "requests",
           "Most requests running at once in the window: the concurrency actually reached (vllm:num_requests_running).",
           lambda v: v.running_max, "exhaustion",
           "sum by ({by}) (max_over_time(kvwatch_engine_requests_running{{{sel}}}[{w}]))",
           display="Running, window peak", record=("kvwatch_requests_running", "max_over_time{w}")),
    Signal("kvwatch_requests_waiting", "requests",
           "Requests waiting now (vllm:num_requests_waiting).",
           lambda v: v.gauge("waiting"), "exhaustion",
           "sum by ({by}) (kvwatch_engine_requests_waiting{{{sel}}})",
           display="Waiting", record=("kvwatch_requests_waiting", "sum"), good="low"),
    Signal("kvwatch_requests_waiting_by_reason", "requests",
           "Requests waiting now by reason: capacity (no KV blocks) or deferred (vllm:num_requests_waiting_by_reason, vLLM 0.20+).",
           _waiting_by_reason, "exhaustion",
           "sum by ({by}, reason) (kvwatch_engine_requests_waiting_by_reason{{{sel}}})", label="reason",
           record=("kvwatch_requests_waiting", "sum"), display="Waiting by reason", good="low"),
    # --- KV blocks, occupancy and trend ---
    Signal("kvwatch_kv_cache_used_blocks", "blocks",
           "KV blocks held now, whole: usage x (num_gpu_blocks - 1), since vLLM keeps one null block aside "
           "(vllm:kv_cache_usage_perc, vllm:cache_config_info; absent on hybrid models, whose blocks differ by group).",
           _used_blocks, "exhaustion",
           "sum by ({by}) (round(clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1)))",
           record=("kvwatch_kv_cache_used_blocks", "sum"), display="KV blocks in use", good="low"),
    Signal("kvwatch_kv_cache_free_blocks", "blocks",
           "KV blocks free now, whole (evictable prefix-cache blocks count as free): the capacity ceiling left, "
           "(num_gpu_blocks - 1) - used (vllm:kv_cache_usage_perc, vllm:cache_config_info).",
           _free_blocks, "exhaustion",
           "sum by ({by}) ((kvwatch_engine_kv_cache_blocks{{{sel}}} - 1) - round(clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1)))",
           panel="exhaustion", title="Free KV blocks (the ceiling left)",
           record=("kvwatch_kv_cache_free_blocks", "sum"), display="KV blocks free", good="high"),
    Signal("kvwatch_kv_cache_requests_fit_now", "requests",
           "Requests of the running ones' current mean footprint the cache holds, rounded down: usable blocks x "
           "running / used blocks. It falls as decodes grow, before the cache is full; "
           "kvwatch_kv_cache_capacity_requests reads finished requests' lengths instead "
           "(vllm:kv_cache_usage_perc, vllm:num_requests_running, vllm:cache_config_info; absent with nothing "
           "running and on hybrid models).",
           requests_fit_now, "exhaustion",
           "floor(\nsum by ({by}) (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1)\n* sum by ({by}) (kvwatch_engine_requests_running{{{sel}}})\n"
           "/ (sum by ({by}) (round(clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1))) > 0)\n)",
           record=("kvwatch_kv_cache_requests_fit_now", "ratio"), display="Requests that fit at current lengths",
           good="high"),
    Signal("kvwatch_kv_cache_token_usage_estimate_ratio", "ratio",
           "Estimated share of the cache's token slots holding tokens: usage counts whole blocks and each running "
           "request's last block is on average half filled, so this is (used blocks x block_size - running x "
           "(block_size - 1) / 2) / (usable blocks x block_size); '95 % full' in blocks is fewer tokens "
           "(vllm:kv_cache_usage_perc, vllm:num_requests_running, vllm:cache_config_info).",
           token_usage_estimate, "exhaustion",
           "sum by ({by}) (clamp_min(round(clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1)) * kvwatch_engine_kv_cache_block_size_tokens{{{sel}}} - kvwatch_engine_requests_running{{{sel}}} * (kvwatch_engine_kv_cache_block_size_tokens{{{sel}}} - 1) / 2, 0))\n/\n"
           "sum by ({by}) ((kvwatch_engine_kv_cache_blocks{{{sel}}} - 1) * kvwatch_engine_kv_cache_block_size_tokens{{{sel}}})",
           record=("kvwatch_kv_cache_token_usage_estimate", "ratio"), display="KV token slots filled (estimate)", good="low"),
    Signal("kvwatch_kv_cache_exhaustion_eta_seconds", "seconds",
           "Seconds until KV usage reaches 1 at its least-squares trend over the last 5 minutes (PromQL deriv()), the "
           "soonest engine; absent unless usage rises and is now at least its 5-minute mean (vllm:kv_cache_usage_perc).",
           _exhaustion_eta, "exhaustion",
           "min by ({by}) (\n  (1 - clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1))\n  / (deriv(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[" + TREND_RANGE + "]) > 0)\n"
           "  and kvwatch_engine_kv_cache_usage_ratio{{{sel}}} >= avg_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[" + TREND_RANGE + "])\n)",
           panel="exhaustion", title="Time until the KV cache is full at this trend",
           record=("kvwatch_kv_cache_exhaustion_eta_seconds", "deriv" + TREND_RANGE), display="Time until KV cache full", good="high"),
    Signal("kvwatch_preemptions_on_repeat_requests_ratio", "ratio",
           "At least this share of the preemptions of requests finished in the window fell on requests preempted "
           "two or more times: near 1 a few requests thrash, near 0 many were each preempted once (broad pressure) "
           "(vllm:request_num_preemptions, vLLM 0.30+).",
           preemption_repeat_share, "exhaustion",
           "clamp_max(2 * clamp_min(sum by ({by}) (rate(kvwatch_engine_request_num_preemptions_count{{{sel}}}[{w}])) "
           "- sum by ({by}) (rate(kvwatch_engine_request_num_preemptions_bucket{{{sel},le=\"1.0\"}}[{w}])), 0)\n/\n"
           "(sum by ({by}) (rate(kvwatch_engine_request_num_preemptions_sum{{{sel}}}[{w}])) > 0), 1)",
           record=("kvwatch_preemptions_on_repeat_requests", "ratio_rate{w}"), needs=("preemptions_per_request",), display="Preemptions on repeat requests", good="low"),
    Signal("kvwatch_admission_rejections_per_second", "per_second",
           "Requests rejected at a queue limit per second, by reason: a cause apart from the KV cache, the queue "
           "was full (vllm:admission_rejections_total, vLLM 0.32+).",
           _labelled_rates("admission_rejections"), "exhaustion",
           "sum by ({by}, reason) (rate(kvwatch_engine_admission_rejections_total{{{sel}}}[{w}]))", label="reason",
           record=("kvwatch_admission_rejections", "rate{w}"), needs=("admission_rejections",), display="Admission rejections", good="low"),
    Signal("kvwatch_engine_sleeping", "state",
           "1 while the engine sleeps (sleep level 1 or 2), 0 while awake: a sleeping engine is not a down one "
           "(vllm:engine_sleep_state, vLLM 0.11.1+).",
           _sleeping, "exhaustion",
           "max by ({by}) (1 - kvwatch_engine_sleep_state{{{sel},sleep_state=\"awake\"}})",
           record=("kvwatch_engine_sleeping", "max"), needs=("sleep_state",), display="Engine sleeping"),
    # --- prefix cache ---
    Signal("kvwatch_prefix_cache_hit_ratio", "ratio",
           "Lookup hit ratio: prefix-cache hits over queries in the window, from token counters, not lifetime totals; "
           "re-lookups after preemption and scheduling retries count again, so it is not the share of prompt tokens "
           "served from a cache (kvwatch_prompt_tokens_from_cache_ratio) "
           "(vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total, formerly gpu_prefix_cache_*; V0: vllm:gpu_prefix_cache_hit_rate).",
           _prefix_hit_ratio, "prefix",
           _ratio_of_rates("kvwatch_engine_prefix_cache_hits_total", "kvwatch_engine_prefix_cache_queries_total"),
           display="Prefix cache hit ratio", record=("kvwatch_prefix_cache_hit", "ratio_rate{w}"), good="high"),
    Signal("kvwatch_external_prefix_cache_hit_ratio", "ratio",
           "External (KV connector) prefix-cache hits over queries in the window (vllm:external_prefix_cache_{hits,queries}_total).",
           lambda v: v.increase.ratio("external_prefix_hits", "external_prefix_queries"), "prefix",
           _ratio_of_rates("kvwatch_engine_external_prefix_cache_hits_total", "kvwatch_engine_external_prefix_cache_queries_total"),
           display="External prefix cache hit ratio", record=("kvwatch_external_prefix_cache_hit", "ratio_rate{w}"), good="high"),
    Signal("kvwatch_prompt_tokens_cached_ratio", "ratio",
           "Share of prompt tokens served from a cache in the window (vllm:prompt_tokens_cached_total / vllm:prompt_tokens_total; "
           "before 0.16 prefix hits / prompt tokens).",
           _cached_share, "prefix",
           _ratio_of_rates("kvwatch_engine_prompt_tokens_cached_total", "kvwatch_engine_prompt_tokens_total"),
           record=("kvwatch_prompt_tokens_cached", "ratio_rate{w}"), display="Prompt tokens served from a cache, all tiers", good="high"),
    Signal("kvwatch_prompt_tokens_from_cache_ratio", "ratio",
           "Share of prompt tokens served from a cache, by tier: local (this engine's prefix cache) and external "
           "(a KV connector); the rest was computed. Not the lookup hit ratio, which re-lookups inflate "
           "(vllm:prompt_tokens_by_source_total, vLLM 0.16+).",
           _from_cache, "prefix",
           "(\n  label_replace(sum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"local_cache_hit\"}}[{w}])), \"tier\", \"local\", \"\", \"\")\n"
           "  or\n  label_replace(sum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"external_kv_transfer\"}}[{w}])), \"tier\", \"external\", \"\", \"\")\n)\n"
           "/ ignoring (tier) group_left\nsum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel}}}[{w}]))",
           label="tier", panel="prefix_cache", title="Prompt tokens served from a cache, by tier",
           record=("kvwatch_prompt_tokens_from_cache", "ratio_rate{w}"), needs=("prompt_tokens_by_source",), display="Prompt tokens served from a cache, by tier", good="high"),
    Signal("kvwatch_kv_cache_reuse_shortfall_blocks", "blocks",
           "KV blocks the cache lacks to keep idle prefixes until their typical reuse: free pool x (median reuse "
           "gap / median idle time before eviction - 1), 0 when blocks outlive the reuse gap "
           "(vllm:kv_block_reuse_gap_seconds, vllm:kv_block_idle_before_evict_seconds: --kv-cache-metrics).",
           reuse_shortfall_blocks, "prefix",
           "ceil(sum by ({by}) ((kvwatch_engine_kv_cache_blocks{{{sel}}} - 1) * (1 - avg_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[{w}])))\n* clamp_min(\n"
           "  histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_engine_kv_block_reuse_gap_seconds_bucket{{{sel}}}[{w}])))\n"
           "  / clamp_min(histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_engine_kv_block_idle_before_evict_seconds_bucket{{{sel}}}[{w}]))), 0.001)\n  - 1, 0))",
           record=("kvwatch_kv_cache_reuse_shortfall_blocks", "ratio_rate{w}"),
           needs=("kv_block_reuse_gap", "kv_block_idle_before_evict"), display="KV blocks short of keeping reuse", good="low"),
    Signal("kvwatch_kv_cache_reuse_shortfall_bytes", "bytes",
           "The reuse shortfall in bytes: blocks x kv_cache_memory_bytes / num_gpu_blocks (--kv-cache-metrics, "
           "vLLM 0.24+ for the bytes).",
           _reuse_shortfall_bytes, "prefix",
           "ceil(sum by ({by}) ((kvwatch_engine_kv_cache_blocks{{{sel}}} - 1) * (1 - avg_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[{w}])) * kvwatch_engine_kv_cache_memory_bytes{{{sel}}} / kvwatch_engine_kv_cache_blocks{{{sel}}})\n* clamp_min(\n"
           "  histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_engine_kv_block_reuse_gap_seconds_bucket{{{sel}}}[{w}])))\n"
           "  / clamp_min(histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_engine_kv_block_idle_before_evict_seconds_bucket{{{sel}}}[{w}]))), 0.001)\n  - 1, 0))",
           record=("kvwatch_kv_cache_reuse_shortfall_bytes", "ratio_rate{w}"),
           needs=("kv_block_reuse_gap", "kv_block_idle_before_evict"), display="KV bytes short of keeping reuse", good="low"),
    Signal("kvwatch_kv_offload_bytes_per_second", "per_second",
           "Bytes per second moved to (store) and from (load) the KV offload tier (vllm:kv_offload_{load,store}_bytes_total, "
           "else the deprecated vllm:kv_offload_total_bytes_total{transfer_type}, never both; OffloadingConnector only).",
           _offload_rates, "prefix",
           "(\n  label_replace(sum by ({by}) (rate(kvwatch_engine_kv_offload_load_bytes_total{{{sel}}}[{w}])), \"direction\", \"load\", \"\", \"\")\n"
           "  or\n  label_replace(sum by ({by}) (rate(kvwatch_engine_kv_offload_store_bytes_total{{{sel}}}[{w}])), \"direction\", \"store\", \"\", \"\")\n)",
           label="direction", record=("kvwatch_kv_offload_bytes", "rate{w}"),
           needs=("offload_load_bytes", "offload_store_bytes"), display="KV offload transfer rate"),
    # --- first token ---
    Signal("kvwatch_time_to_first_token_seconds", "seconds",
           "Time to first token quantiles over the window, from bucket increases with the scraped bounds (vllm:time_to_first_token_seconds).",
           _quantiles("ttft", "TTFT"), "first_token",
           _quantile_promql("kvwatch_engine_time_to_first_token_seconds"), label="quantile",
           display="Time to first token", record=("kvwatch_time_to_first_token_seconds", "histogram_quantile_rate{w}"), good="low"),
    Signal("kvwatch_time_to_first_token_mean_seconds", "seconds",
           "Mean time to first token over the window (vllm:time_to_first_token_seconds _sum/_count).",
           _mean("ttft"), "first_token", _mean_promql("kvwatch_engine_time_to_first_token_seconds"),
           display="Time to first token, mean", record=("kvwatch_time_to_first_token_seconds", "mean_rate{w}"), good="low"),
    Signal("kvwatch_queue_time_seconds", "seconds",
           "Queue (WAITING) time quantiles over the window (vllm:request_queue_time_seconds).",
           _quantiles("queue_time", "queue time"), "first_token",
           _quantile_promql("kvwatch_engine_request_queue_time_seconds"), label="quantile",
           display="Queue time", record=("kvwatch_queue_time_seconds", "histogram_quantile_rate{w}"), good="low"),
    Signal("kvwatch_queue_time_mean_seconds", "seconds",
           "Mean queue time over the window (vllm:request_queue_time_seconds _sum/_count).",
           _mean("queue_time"), "first_token", _mean_promql("kvwatch_engine_request_queue_time_seconds"),
           display="Queue time, mean", record=("kvwatch_queue_time_seconds", "mean_rate{w}"), good="low"),
    Signal("kvwatch_prefill_time_seconds", "seconds",
           "Prefill time quantiles over the window (vllm:request_prefill_time_seconds).",
           _quantiles("prefill_time", "prefill time"), "first_token",
           _quantile_promql("kvwatch_engine_request_prefill_time_seconds"), label="quantile",
           display="Prefill time", record=("kvwatch_prefill_time_seconds", "histogram_quantile_rate{w}"), good="low"),
    Signal("kvwatch_prefill_time_mean_seconds", "seconds",
           "Mean prefill time over the window (vllm:request_prefill_time_seconds _sum/_count).",
           _mean("prefill_time"), "first_token", _mean_promql("kvwatch_engine_request_prefill_time_seconds"),
           display="Prefill time, mean", record=("kvwatch_prefill_time_seconds", "mean_rate{w}"), good="low"),
    Signal("kvwatch_time_to_first_token_share_ratio", "ratio",
           "Share of mean TTFT spent in queue, in prefill, and elsewhere (front end, tokenization, scheduling); the PromQL twin is the queue part "
           "(vllm:time_to_first_token_seconds, vllm:request_queue_time_seconds, vllm:request_prefill_time_seconds).",
           ttft_parts, "first_token",
           _mean_promql("kvwatch_engine_request_queue_time_seconds") + "\n/ on ({by})\n"
           + _mean_promql("kvwatch_engine_time_to_first_token_seconds"), label="part",
           display="Time to first token split", record=("kvwatch_time_to_first_token_share", "ratio_rate{w}"), good="low"),
    # --- throughput and failures ---
    Signal("kvwatch_requests_finished_per_second", "per_second",
           "Finished requests per second by reason (vllm:request_success_total).",
           _labelled_rates("finished"), "throughput",
           "sum by ({by}, finished_reason) (rate(kvwatch_engine_requests_finished_total{{{sel}}}[{w}]))",
           label="finished_reason",
           display="Finished requests", record=("kvwatch_requests_finished", "rate{w}")),
    Signal("kvwatch_requests_failed_per_second", "per_second",
           "Requests ending in abort or error per second (vllm:request_success_total{finished_reason=~\"abort|error\"}).",
           _failed_rate, "throughput",
           "sum by ({by}) (rate(kvwatch_engine_requests_finished_total{{{sel},finished_reason=~\"abort|error\"}}[{w}]))",
           display="Failed requests", record=("kvwatch_requests_failed", "rate{w}"), good="low"),
    Signal("kvwatch_prompt_tokens_per_second", "per_second",
           "Prompt tokens per second, cached included (vllm:prompt_tokens_total).",
           _rate("prompt_tokens"), "throughput",
           "sum by ({by}) (rate(kvwatch_engine_prompt_tokens_total{{{sel}}}[{w}]))",
           display="Prompt tokens", record=("kvwatch_prompt_tokens", "rate{w}")),
    Signal("kvwatch_generation_tokens_per_second", "per_second",
           "Generated tokens per second (vllm:generation_tokens_total).",
           _rate("generation_tokens"), "throughput",
           "sum by ({by}) (rate(kvwatch_engine_generation_tokens_total{{{sel}}}[{w}]))",
           display="Generated tokens", record=("kvwatch_generation_tokens", "rate{w}")),
    Signal("kvwatch_prompt_tokens_per_request_mean", "tokens",
           "Mean prompt tokens per finished request in the window (vllm:request_prompt_tokens).",
           lambda v: mean_tokens(v, "prompt_len", "prompt_tokens"), "throughput",
           _mean_promql("kvwatch_engine_request_prompt_tokens"),
           display="Prompt length, mean", record=("kvwatch_prompt_tokens_per_request", "mean_rate{w}")),
    Signal("kvwatch_generation_tokens_per_request_mean", "tokens",
           "Mean generated tokens per finished request in the window (vllm:request_generation_tokens).",
           lambda v: mean_tokens(v, "generation_len", "generation_tokens"), "throughput",
           _mean_promql("kvwatch_engine_request_generation_tokens"),
           display="Generated length, mean", record=("kvwatch_generation_tokens_per_request", "mean_rate{w}")),
)

SIGNALS_BY_NAME = {signal.name: signal for signal in SIGNALS}


def good_direction(name: str) -> str | None:
    """The declared good side ("high", "low" or None) of a catalogue entry:
    a signal, a re-exported engine series or a health family, by its
    exported name (a counter with or without `_total`)."""
    if name in SIGNALS_BY_NAME:
        return SIGNALS_BY_NAME[name].good
    if name in TIER_SIGNALS_BY_NAME:
        return TIER_SIGNALS_BY_NAME[name].good
    for stream in STREAM_SIGNALS + STREAM_SIZING:
        if name == stream.name:
            return stream.good
    for entry in ENGINE_SERIES + HEALTH + SCRAPE + TIER_HEALTH + TIER_SERIES + CENTRAL_HEALTH + STREAM_HEALTH:
        if name in (entry.name, entry.sample_name):
            return entry.good
    raise KeyError(f"{name} is not in the catalogue")


# --------------------------------------------------------------------------
# Evaluation over a window
# --------------------------------------------------------------------------


@dataclass
class Evaluated:
    """Signal values of one engine (engine set) or one model (engine None)."""

    model: str
    engine: str | None
    values: dict[str, float | dict[str, float] | None]
    notes: list[str]
    view: View
    # Signal name -> {quantile: "<" | ">"}: a quantile pinned in the first
    # bucket is an upper bound (its value is that bucket's bound), one pinned
    # at the last finite bucket a lower bound.
    pinned: dict[str, dict[str, str]] = field(default_factory=dict)


def _view(window: Window, keys: list[tuple[str, str]]) -> View | None:
    latest = window.latest
    if latest is None:
        return None
    present = [key for key in keys if key in latest.engines]
    if not present:
        return None
    merged = EngineSnapshot(present[0][0], present[0][1] if len(present) == 1 else "*")
    increase = None
    span = 0.0
    capacity = None
    block_size = None
    usage_max = None
    running_max = None
    used_bytes: float | None = 0.0
    blocks: BlockSums | None = BlockSums()
    eta = None
    for key in present:
        engine = latest.engines[key]
        config = _engine_config(latest.cache_config.get(key[1], {}))
        series = window.gauge_series(key, "kv_usage")
        engine_eta = _eta(series)
        if engine_eta is not None:
            eta = engine_eta if eta is None else min(eta, engine_eta)
        engine_usage = engine.gauges.get("kv_usage")
        if blocks is not None:
            blocks = blocks.add(config, engine_usage, series)
        engine_bytes = config.memory
        if used_bytes is not None and engine_bytes is not None and engine_usage is not None:
            used_bytes += _clamp01(engine_usage) * engine_bytes
        else:
            used_bytes = None
        engine_increase = window.increase(key)
        if increase is None:
            merged.gauges = _first_gauges(engine.gauges)
            increase = _first_increase(engine_increase)
        else:
            _merge_gauges(merged.gauges, engine.gauges)
            increase.add(engine_increase)
        span = max(span, engine_increase.seconds)
        engine_capacity = config.capacity
        if engine_capacity is not None:
            capacity = (capacity or 0.0) + engine_capacity
        block_size = block_size or config.block_size
        # The window keeps these maxima as snapshots come and go.
        usage_peak = window.gauge_max(key, "kv_usage")
        if usage_peak is not None:
            usage_max = usage_peak if usage_max is None else max(usage_max, usage_peak)
        running_peak = window.gauge_max(key, "running")
        if running_peak is not None:
            running_max = (running_max or 0.0) + running_peak
    # Engines of one model run side by side over the same span.
    increase.seconds = span
    view = View(merged, increase, usage_max, running_max, capacity, block_size, used_bytes)
    if blocks is not None:
        view.usable_blocks, view.used_blocks, view.block_tokens = blocks.usable, blocks.used, blocks.tokens
        view.bytes_per_block = blocks.bytes_per_block
        view.usage_mean = blocks.usage_weighted / blocks.usable if blocks.usable else None
    view.exhaustion_eta = eta
    return view


# Gauges merged over engines by their maximum (a ratio); the others are summed.
_MAX_GAUGES = ("kv_usage", "v0_prefix_hit_rate")
_ZEROS = itertools.repeat(0.0)


def _merge_gauges(merged: dict[str, float], gauges: dict[str, float]) -> None:
    for gauge, value in gauges.items():
        if gauge in _MAX_GAUGES:
            previous = merged.get(gauge)
            merged[gauge] = value if previous is None else max(previous, value)
        else:
            merged[gauge] = merged.get(gauge, 0.0) + value


def _first_gauges(gauges: dict[str, float]) -> dict[str, float]:
    """What _merge_gauges({}, gauges) makes (0.0 + each value, the maxima as
    they are), with the additions in C: most views are of one engine."""
    merged = dict(zip(gauges, map(operator.add, _ZEROS, gauges.values())))
    for gauge in _MAX_GAUGES:
        if gauge in gauges:
            merged[gauge] = gauges[gauge]
    return merged


def _first_increase(increase: Increase) -> Increase:
    """What Increase().add(increase) makes (0.0 + each counter), with the
    additions in C; `increase` is left as it is (it is the window's answer)."""
    counters = increase.counters
    return Increase(0.0, dict(zip(counters, map(operator.add, _ZEROS, counters.values()))), dict(increase.histograms),
                    0 + increase.restarts, 0 + increase.steps)


@dataclass(frozen=True, slots=True)
class _EngineConfig:
    """What _view reads from one engine's cache_config_info, parsed once."""

    count: float | None  # num_gpu_blocks
    block_size: float | None
    memory: float | None  # kv_cache_memory_bytes
    capacity: float | None  # capacity_tokens()
    blocks_hold: bool  # blocks_hold_capacity()


def _engine_config(cache_config: dict[str, str]) -> _EngineConfig:
    # Labels change only when an engine is reconfigured: parsed once per set.
    return _parsed_config(tuple(cache_config.items()))


@functools.lru_cache(maxsize=64)
def _parsed_config(labels: tuple[tuple[str, str], ...]) -> _EngineConfig:
    cache_config = dict(labels)
    return _EngineConfig(config_number(cache_config, "num_gpu_blocks"), config_number(cache_config, "block_size"),
                         config_number(cache_config, "kv_cache_memory_bytes"), capacity_tokens(cache_config),
                         blocks_hold_capacity(cache_config))


# Signals of whole-block arithmetic (BlockSums): absent on hybrid models,
# whose KV groups' blocks differ (/api/v1/signals lists them dark there).
WHOLE_BLOCK_SIGNALS = ("kvwatch_kv_cache_used_blocks", "kvwatch_kv_cache_free_blocks", "kvwatch_kv_cache_requests_fit_now",
                       "kvwatch_kv_cache_token_usage_estimate_ratio", "kvwatch_kv_cache_reuse_shortfall_blocks",
                       "kvwatch_kv_cache_reuse_shortfall_bytes")


def blocks_hold_capacity(cache_config: dict[str, str]) -> bool:
    """num_gpu_blocks x block_size is the stated capacity (or none is
    stated): not so on hybrid models, where block_size is the minimum over
    the KV groups."""
    count = config_number(cache_config, "num_gpu_blocks")
    size = config_number(cache_config, "block_size")
    stated = config_number(cache_config, "kv_cache_size_tokens")
    return not (stated and count and size and stated != count * size)


@dataclass
class BlockSums:
    """Whole-block arithmetic over the engines of a view."""

    usable: float = 0.0
    used: float = 0.0
    tokens: float = 0.0
    usage_weighted: float = 0.0
    bytes_per_block: float | None = None

    def add(self, config: _EngineConfig, usage: float | None, series) -> "BlockSums | None":
        count, size = config.count, config.block_size
        if not count or count < 2 or not size or usage is None or not series:
            return None
        if not config.blocks_hold:
            return None  # hybrid: block_size is the minimum over groups, blocks x size is not the capacity
        usable = count - 1
        used = float(round(_clamp01(usage) * usable))
        self.usable += usable
        self.used += used
        self.tokens += used * size
        clamped = [(v if v < 1.0 else 1.0) if v > 0.0 else 0.0 for _t, v in series]  # _clamp01, inline
        self.usage_weighted += usable * sum(clamped) / len(series)
        memory = config.memory
        per_block = memory / count if memory else None
        if self.bytes_per_block is None or per_block is None:
            self.bytes_per_block = per_block if self.usable == usable else None
        return self


def _eta(series: list[tuple[float, float]]) -> float | None:
    """Seconds until usage reaches 1 at the least-squares slope of the last
    TREND_SECONDS (PromQL deriv()); None unless usage rises and is now at
    least its mean over that span (a cache that just emptied is not filling)."""
    if len(series) < 2:
        return None
    horizon = series[-1][0] - TREND_SECONDS
    series = [point for point in series if point[0] >= horizon]
    n = len(series)
    if n < 2:
        return None
    # The definition's sums (sum(v) / n, sum(t - t0) / n, sum((t - t0 - mean_t) ** 2), ...)
    # term by term and in the same order, with each term computed once.
    values = [v for _t, v in series]
    total = sum(values)
    if values[-1] < total / n:
        return None
    t0 = series[0][0]
    offsets = [t - t0 for t, _v in series]
    mean_t = sum(offsets) / n
    mean_v = total / n
    centred = [offset - mean_t for offset in offsets]
    var = sum([d ** 2 for d in centred])
    if var <= 0:
        return None
    slope = sum([d * (v - mean_v) for d, v in zip(centred, values)]) / var
    if slope <= 0:
        return None
    return max(0.0, 1.0 - _clamp01(series[-1][1])) / slope


# The View fields a derivation reads besides `latest`, `increase`, `notes`
# and `pinned` (_inputs handles those): every other field, so a field added
# to View joins the comparison by itself.
_PLAIN_VIEW_FIELDS = tuple(f.name for f in fields(View) if f.name not in ("latest", "increase", "notes", "pinned"))
_plain_view_fields = operator.attrgetter(*_PLAIN_VIEW_FIELDS)  # a tuple of them, read in C


def _inputs(view: View) -> tuple:
    """Everything the derivations read from a view, copied (callers may
    change the view's dicts afterwards): of `latest` only its gauges (the
    derivations read no counter or histogram of it, only the increase;
    keep it so, or add them here), the whole increase, every other field,
    and the notes it came with."""
    increase = view.increase
    return ((dict(view.latest.gauges), increase.seconds, dict(increase.counters), dict(increase.histograms),
             increase.restarts, increase.steps, tuple(view.notes))
            + _plain_view_fields(view))


def _copied(values: dict) -> dict:
    """The values, each dict among them copied too."""
    copy = dict(values)
    # The names of the dict values, picked in C (most values are floats or None).
    for name in itertools.compress(values, map(operator.is_, map(type, values.values()), itertools.repeat(dict))):
        copy[name] = dict(copy[name])
    return copy


def evaluate(view: View, model: str, engine: str | None, remembered: dict | None = None,
             kept: dict | None = None) -> Evaluated:
    """The signals of one view. With `remembered` (what the window's last
    evaluation kept, by (model, engine)): where the view's inputs equal the
    ones the values were derived from then (an idle engine, a steady load),
    those values again, not derived anew (the derivations are functions of
    the view alone); `kept` receives what this evaluation leaves for the next."""
    inputs = None
    if kept is not None:
        inputs = _inputs(view)
        found = remembered.get((model, engine)) if remembered else None
        if found is not None and found[0] == inputs:
            kept[(model, engine)] = found
            _inputs_then, values, notes, pinned = found
            view.notes = list(notes)
            view.pinned = {}
            return Evaluated(model, engine, _copied(values), view.notes, view,
                             {name: dict(q) for name, q in pinned.items()})
    evaluated = _evaluate(view, model, engine)
    if kept is not None:
        kept[(model, engine)] = (inputs, _copied(evaluated.values), list(evaluated.notes),
                                 {name: dict(q) for name, q in evaluated.pinned.items()})
    return evaluated


def _evaluate(view: View, model: str, engine: str | None) -> Evaluated:
    values = {}
    pinned = {}
    for signal in SIGNALS:
        values[signal.name] = _derive(signal, view, pinned)
    return Evaluated(model, engine, values, view.notes, view, pinned)


def _derive(signal: Signal, view: View, pinned: dict):
    """One signal's value; its pinned quantiles filed in `pinned`."""
    view.pinned = {}
    try:
        value = signal.derive(view)
    except (ArithmeticError, ValueError) as exc:  # one bad signal must not hide the rest
        value = None
        view.notes.append(f"{signal.name}: {exc}")
    if view.pinned and value is not None:
        pinned[signal.name] = view.pinned
    view.pinned = {}
    return value


class LazyValues(Mapping):
    """A view's signal values, each derived when first read (the same
    derivation, so the same value, as evaluate() gives, in any order of
    reading: a derivation reads the view alone). For the history diagnosis,
    whose rules read a few signals of each replica at each step and report
    no other: the rest are never derived. Iterating derives them all, in the
    catalogue's order. Notes and pinned quantiles gather as signals are read."""

    __slots__ = ("_view", "_values", "_pinned")

    def __init__(self, view: View, pinned: dict):
        self._view = view
        self._values: dict = {}
        self._pinned = pinned

    def __getitem__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            signal = SIGNALS_BY_NAME[name]  # KeyError for a name that is no signal, as a dict's
        value = self._values[name] = _derive(signal, self._view, self._pinned)
        return value

    def __iter__(self):
        return iter(SIGNALS_BY_NAME)

    def __len__(self) -> int:
        return len(SIGNALS_BY_NAME)


def evaluate_window(window: Window, lazy: bool = False) -> tuple[list[Evaluated], list[Evaluated]]:
    """Per (model, engine), and per model with its engines merged. `lazy`:
    values as LazyValues, derived where read (the history diagnosis); the
    window's evaluation cache is then neither read nor kept."""
    latest = window.latest
    if latest is None:
        return [], []
    # Values derived at the window's last evaluation, for views whose inputs
    # did not change since (kept for the engines and models evaluated now).
    remembered = window.evaluated
    kept: dict = {}
    window.evaluated = kept
    if lazy:
        def evaluate_view(view, model, engine):
            pinned: dict = {}
            return Evaluated(model, engine, LazyValues(view, pinned), view.notes, view, pinned)
    else:
        def evaluate_view(view, model, engine):
            return evaluate(view, model, engine, remembered, kept)
    per_engine = []
    by_key: dict[tuple[str, str], Evaluated] = {}
    by_model: dict[str, list[tuple[str, str]]] = {}
    for key in sorted(latest.engines):
        view = _view(window, [key])
        if view is not None:
            per_engine.append(by_key.setdefault(key, evaluate_view(view, key[0], key[1])))
        by_model.setdefault(key[0], []).append(key)
    per_model = []
    for model, keys in sorted(by_model.items()):
        if len(keys) == 1 and keys[0] in by_key:
            # A model of one engine: its view is that engine's (the same
            # inputs, so the same values and notes), evaluated once.
            alone = by_key[keys[0]]
            if lazy:  # the same values, derived once wherever first read
                per_model.append(Evaluated(model, None, alone.values, alone.notes, alone.view, alone.pinned))
                continue
            per_model.append(Evaluated(model, None, dict(alone.values), list(alone.notes), alone.view,
                                       {name: dict(q) for name, q in alone.pinned.items()}))
            continue
        view = _view(window, keys)
        if view is not None:
            per_model.append(evaluate_view(view, model, None))
    return per_engine, per_model


# --------------------------------------------------------------------------
# LMCache: a KV tier beside the engine, read from its own page
# --------------------------------------------------------------------------

# Its counters describe the same requests as the engine's external-cache
# counters, so they are exported apart (`kvwatch_lmcache_*`, per model, no
# `engine` label: LMCache's ranks repeat one count and kvwatch reads the first
# worker's) and never added to the engine's. kvwatch/sidecar/lmcache.py reads
# them; present only while `lmcache_target` is set and its latest poll succeeded.
TIER_IDENTITY = ("model_name",)

TIER_HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_lmcache_up", "gauge", (),
                 "1 if the latest poll of LMCache's page (lmcache_target) succeeded and carried its counters, else 0; "
                 "absent unless lmcache_target is set. The engine's signals do not depend on it.", good="high"),
)

# Central mode (`kvwatch serve --prometheus`): its own health beside every
# replica's series, without replica labels (kvwatch/sidecar/central.py).
CENTRAL_HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_central_store_up", "gauge", (),
                 "Central mode: 1 if the latest refresh read the store's query API, else 0 (the replicas' series "
                 "then stay as last read, their findings marked down on the page).", good="high"),
    HealthFamily("kvwatch_central_replicas", "gauge", (), "Central mode: replicas diagnosed at the latest refresh."),
    HealthFamily("kvwatch_central_replicas_dropped", "gauge", (),
                 "Central mode: replicas the store has beyond --max-replicas at the latest refresh, not diagnosed; "
                 "above 0, raise --max-replicas (and the memory request) or narrow --selector.", good="low"),
    HealthFamily("kvwatch_central_last_success_timestamp_seconds", "gauge", (),
                 "Central mode: Unix time of the latest refresh that read the store."),
)


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
)

TIER_SIGNALS: tuple[Signal, ...] = (
    Signal("kvwatch_lmcache_hit_ratio", "ratio",
           "LMCache's hit ratio over the window: tokens delivered over tokens asked for, from counter deltas "
           "(lmcache:num_hit_tokens / lmcache:num_requested_tokens); absent with no retrievals in the window. "
           "LMCache's retrieve_hit_rate gauge is never read: it covers one log interval and reads 1 with none.",
           lambda v: v.increase.ratio("hit_tokens", "requested_tokens"), "prefix",
           _ratio_of_rates("kvwatch_lmcache_hit_tokens_total", "kvwatch_lmcache_requested_tokens_total"),
           needs=("hit_tokens", "requested_tokens"), display="LMCache hit ratio", good="high"),
    Signal("kvwatch_lmcache_prompt_tokens_served_ratio", "ratio",
           "Share of the prompt tokens LMCache's connector saw that LMCache delivered, over the window: how much "
           "prefill the tier saved (lmcache:num_hit_tokens / lmcache:num_prompt_tokens); absent with no prompt "
           "tokens in the window or in builds without num_prompt_tokens.",
           lambda v: v.increase.ratio("hit_tokens", "prompt_tokens"), "prefix",
           _ratio_of_rates("kvwatch_lmcache_hit_tokens_total", "kvwatch_lmcache_prompt_tokens_total"),
           needs=("hit_tokens", "prompt_tokens"), display="Prompt tokens from LMCache", good="high"),
    Signal("kvwatch_lmcache_retrieved_tokens_per_second", "per_second",
           "Tokens LMCache delivered to the engine per second over the window (lmcache:num_hit_tokens).",
           _rate("hit_tokens"), "prefix",
           "sum by ({by}) (rate(kvwatch_lmcache_hit_tokens_total{{{sel}}}[{w}]))",
           needs=("hit_tokens",), display="LMCache tokens retrieved", good="high"),
    Signal("kvwatch_lmcache_stored_tokens_per_second", "per_second",
           "Tokens stored into LMCache per second over the window (lmcache:num_stored_tokens).",
           _rate("stored_tokens"), "prefix",
           "sum by ({by}) (rate(kvwatch_lmcache_stored_tokens_total{{{sel}}}[{w}]))",
           needs=("stored_tokens",), display="LMCache tokens stored"),
)
TIER_SIGNALS_BY_NAME = {signal.name: signal for signal in TIER_SIGNALS}


def evaluate_tier(view: View) -> dict[str, float | None]:
    """The tier's signals for one model's view of LMCache's window."""
    values: dict[str, float | None] = {}
    for signal in TIER_SIGNALS:
        try:
            values[signal.name] = signal.derive(view)
        except (ArithmeticError, ValueError):
            values[signal.name] = None
    return values



# --------------------------------------------------------------------------
# The engine's KV-cache event stream (kvwatch/kvevents), read beside its page
# --------------------------------------------------------------------------

# One stream per kvwatch (`kv_events`): no model or engine label (vLLM's
# events do not name them; one endpoint is one engine's publisher). Present
# only while `kv_events` is set; the series and signals only once an event
# arrived.
STREAM_HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_kv_events_up", "gauge", (),
                 "1 while kvwatch listens for the engine's KV-cache events (kv_events) and at least one has arrived, "
                 "else 0; absent unless kv_events is set. The page's signals do not depend on it.", good="high"),
    HealthFamily("kvwatch_kv_events_messages", "counter", (), "Event messages (batches) received from the engine."),
    HealthFamily("kvwatch_kv_events_dropped_messages", "counter", (),
                 "Messages kvwatch dropped because its intake queue was full (a flood faster than it accounts); "
                 "what they held is missing from every count.", good="low"),
    HealthFamily("kvwatch_kv_events_missed_messages", "counter", (),
                 "Sequence numbers that never arrived (the engine's publisher dropped them past its high-water "
                 "mark, or the connection lost them); what they held is missing from every count.", good="low"),
    HealthFamily("kvwatch_kv_events_malformed_messages", "counter", (),
                 "Messages or events that were not vLLM's KV-cache events (bad frames, bad msgpack, absurd block "
                 "counts, over the byte cap); skipped.", good="low"),
    HealthFamily("kvwatch_kv_events_publisher_restarts", "counter", (),
                 "Times the engine's sequence numbers started over (its publisher restarted)."),
    HealthFamily("kvwatch_kv_events_last_message_age_seconds", "gauge", (),
                 "Seconds since the latest event message (an idle engine sends none).", good="low"),
    HealthFamily("kvwatch_kv_events_tracked_blocks", "gauge", (),
                 "Block hashes the ledger tracks now (bounded by kv_events_table_bytes)."),
    HealthFamily("kvwatch_kv_events_sampling_ratio", "gauge", (),
                 "Share of the hash space the ledger tracks: 1 until the table fills, then halved as needed; "
                 "stored-again counts and the sizing curve are scaled from the sample.", good="high"),
)


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
                 "Blocks the engine stored in its prefix cache (BlockStored events' block_hashes), by medium (GPU, "
                 "CPU offload) and LoRA adapter (empty without one)."),
    StreamSeries("kvwatch_kv_events_blocks_stored_again", "stored_again", ("medium", "lora_name"),
                 "Blocks stored again after their eviction (a BlockStored of a hash whose BlockRemoved kvwatch "
                 "saw): recomputation a larger cache would have saved. Scaled from the ledger's sample."),
    StreamSeries("kvwatch_kv_events_blocks_evicted", "evicted", ("medium",),
                 "Blocks the engine evicted from its prefix cache (BlockRemoved events' block_hashes), by medium."),
    StreamSeries("kvwatch_kv_events_cache_cleared", "cleared", (),
                 "AllBlocksCleared events: the engine reset its prefix cache (each also a change on the timeline)."),
    StreamSeries("kvwatch_kv_events_eviction_return_seconds", "return_buckets", (),
                 "Time from a block's eviction to its return (stored again), a histogram; scaled from the sample.",
                 kind="histogram"),
)


@dataclass(frozen=True)
class StreamSignal:
    name: str
    unit: str
    key: str  # the report's window key
    help: str
    promql: str
    display: str
    good: str | None = None


STREAM_SIGNALS: tuple[StreamSignal, ...] = (
    StreamSignal("kvwatch_kv_events_blocks_stored_per_second", "per_second", "stored_per_second",
                 "Blocks stored per second over the window (BlockStored).",
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_stored_total{{{sel}}}[{w}]))", "Blocks stored"),
    StreamSignal("kvwatch_kv_events_blocks_evicted_per_second", "per_second", "evicted_per_second",
                 "Blocks evicted per second over the window (BlockRemoved).",
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_evicted_total{{{sel}}}[{w}]))", "Blocks evicted",
                 good="low"),
    StreamSignal("kvwatch_kv_events_blocks_stored_again_per_second", "per_second", "stored_again_per_second",
                 "Blocks stored again after their eviction per second over the window: recomputation a larger "
                 "cache would have saved.",
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_stored_again_total{{{sel}}}[{w}]))",
                 "Blocks stored again after eviction", good="low"),
    StreamSignal("kvwatch_kv_events_stored_again_ratio", "ratio", "stored_again_ratio",
                 "Share of the window's stored blocks that were stored again after their eviction; absent with "
                 "no stores in the window. High: eviction before reuse; 0 while stores go on: no reuse.",
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_stored_again_total{{{sel}}}[{w}])) / "
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_stored_total{{{sel}}}[{w}]))",
                 "Stored again after eviction", good="low"),
    StreamSignal("kvwatch_kv_events_return_after_eviction_seconds", "seconds", "return_seconds_median",
                 "Median time from a block's eviction to its return over the window (the bucket bound of "
                 "kvwatch_kv_events_eviction_return_seconds); absent with no returns.",
                 "histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_kv_events_eviction_return_seconds_bucket"
                 "{{{sel}}}[{w}])))", "Eviction to return (median)"),
)
STREAM_SIGNALS_BY_NAME = {signal.name: signal for signal in STREAM_SIGNALS}

# The sizing curve (kvwatch/kvevents/source.py: sizing_curve), per extra cache
# as a multiple of the engine's cache (label `extra_cache`).
STREAM_SIZING: tuple[StreamSignal, ...] = (
    StreamSignal("kvwatch_kv_events_sizing_hit_ratio", "ratio", "hit_ratio",
                 "Estimated prefix-cache hit ratio over the window with a cache larger by `extra_cache` times the "
                 "engine's (its returns whose distance is below the extra blocks counted as hits with the page's "
                 "hits; vllm:prefix_cache_hits / prefix_cache_queries for the rest). An estimate: first order.",
                 "max by ({by}, extra_cache) (kvwatch_kv_events_sizing_hit_ratio{{{sel}}})", "Hit ratio with more cache",
                 good="high"),
    StreamSignal("kvwatch_kv_events_sizing_recomputation_avoided_ratio", "ratio", "recomputation_avoided_ratio",
                 "Estimated share of the window's blocks stored again after eviction that a cache larger by "
                 "`extra_cache` times the engine's would have kept.",
                 "max by ({by}, extra_cache) (kvwatch_kv_events_sizing_recomputation_avoided_ratio{{{sel}}})",
                 "Recomputation avoided", good="high"),
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


__all__ = [
    "ENGINE_SERIES", "SIGNALS", "SIGNALS_BY_NAME", "QUANTILES", "EngineSeries", "Signal", "View", "SCRAPE",
    "GOOD_DIRECTIONS", "good_direction",
    "Evaluated", "evaluate_window", "engine_series_value", "Histogram",
    "STREAM_HEALTH", "STREAM_SERIES", "STREAM_SIGNALS", "STREAM_SIGNALS_BY_NAME", "STREAM_SIZING", "StreamSeries",
    "StreamSignal",
    "CENTRAL_HEALTH", "TIER_HEALTH", "TIER_IDENTITY", "TIER_SERIES", "TIER_SIGNALS", "TIER_SIGNALS_BY_NAME", "TierSeries", "evaluate_tier",
]
