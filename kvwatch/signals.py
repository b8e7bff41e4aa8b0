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

import math
from dataclasses import dataclass, field
from typing import Callable

from kvwatch.snapshot import EngineSnapshot, Histogram, capacity_tokens, config_number
from kvwatch.window import Increase, Window

QUANTILES = (0.5, 0.95, 0.99)

# A catalogue unit -> Grafana's unit for it.
UNITS = {
    "ratio": "percentunit",
    "seconds": "s",
    "tokens": "short",
    "requests": "short",
    "per_second": "ops",
    "bytes": "bytes",
}


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
    kind: str  # gauge | counter
    labels: tuple[str, ...]
    help: str

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_up", "gauge", (), "1 if the latest poll of the engine's /metrics succeeded, else 0."),
    HealthFamily("kvwatch_build_info", "gauge", ("version",), "kvwatch's version; always 1."),
    HealthFamily("kvwatch_polls", "counter", (), "Polls of the engine's /metrics."),
    HealthFamily("kvwatch_poll_errors", "counter", ("reason",),
                 "Failed polls by reason (refused, dns, timeout, tls, http_3xx/4xx/5xx, content_type, too_large, "
                 "truncated, decode, no_engine_metrics, ...)."),
    HealthFamily("kvwatch_parse_errors", "counter", (),
                 "Malformed lines in the engine's pages (skipped; the rest of the page counts)."),
    HealthFamily("kvwatch_dropped_series", "counter", (), "(model, engine) pairs dropped by the max_series cap."),
    HealthFamily("kvwatch_poll_duration_seconds", "gauge", (), "Wall time of the latest poll."),
    HealthFamily("kvwatch_poll_cpu_seconds", "gauge", (),
                 "CPU time of the latest poll (fetch, parse, signals, diagnosis)."),
    HealthFamily("kvwatch_last_success_timestamp_seconds", "gauge", (), "Unix time of the latest successful poll."),
    HealthFamily("kvwatch_window_seconds", "gauge", (), "Span the windowed signals cover now."),
    HealthFamily("kvwatch_engine_info", "gauge", IDENTITY + INFO_KEYS,
                 "The engine's KV-cache configuration (from vllm:cache_config_info); changes() on it marks a "
                 "configuration change."),
    HealthFamily("kvwatch_finding", "gauge", ("symptom", "cause", "severity") + IDENTITY,
                 "1 for each active diagnosis finding (absent when not active); see /api/v1/diagnosis for its "
                 "evidence."),
)
HEALTH_BY_NAME = {family.name: family for family in HEALTH}


@dataclass(frozen=True)
class EngineSeries:
    name: str  # exported family name (counters without their `_total`)
    kind: str  # gauge | counter | histogram
    key: str  # canonical snapshot key; "<key>/*" for a labelled family
    unit: str
    help: str
    label: str | None = None  # the dimension of a labelled family

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


ENGINE_SERIES: tuple[EngineSeries, ...] = (
    EngineSeries("kvwatch_engine_kv_cache_usage_ratio", "gauge", "kv_usage", "ratio",
                 "KV-cache usage 0..1 (vllm:kv_cache_usage_perc, formerly vllm:gpu_cache_usage_perc); evictable prefix-cache blocks count as free."),
    EngineSeries("kvwatch_engine_kv_cache_capacity_tokens", "gauge", "capacity_tokens", "tokens",
                 "KV-cache capacity in tokens (vllm:cache_config_info kv_cache_size_tokens, else num_gpu_blocks x block_size)."),
    EngineSeries("kvwatch_engine_kv_cache_memory_bytes", "gauge", "config/kv_cache_memory_bytes", "bytes",
                 "Bytes of the KV cache (vllm:cache_config_info kv_cache_memory_bytes, vLLM 0.24+); absent before."),
    EngineSeries("kvwatch_engine_requests_running", "gauge", "running", "requests",
                 "Requests in model execution batches (vllm:num_requests_running)."),
    EngineSeries("kvwatch_engine_requests_waiting", "gauge", "waiting", "requests",
                 "Requests waiting to be scheduled (vllm:num_requests_waiting)."),
    EngineSeries("kvwatch_engine_requests_waiting_by_reason", "gauge", "waiting_by_reason/*", "requests",
                 "Waiting requests by reason: capacity (KV blocks) or deferred (vllm:num_requests_waiting_by_reason, vLLM 0.20+).",
                 label="reason"),
    EngineSeries("kvwatch_engine_prefix_cache_queries", "counter", "prefix_queries", "tokens",
                 "Prefix-cache queries in tokens (vllm:prefix_cache_queries_total, formerly vllm:gpu_prefix_cache_queries_total; blocks before vLLM 0.9)."),
    EngineSeries("kvwatch_engine_prefix_cache_hits", "counter", "prefix_hits", "tokens",
                 "Prefix-cache hits in tokens (vllm:prefix_cache_hits_total, formerly vllm:gpu_prefix_cache_hits_total; blocks before vLLM 0.9)."),
    EngineSeries("kvwatch_engine_external_prefix_cache_queries", "counter", "external_prefix_queries", "tokens",
                 "External (KV connector) prefix-cache queries in tokens (vllm:external_prefix_cache_queries_total)."),
    EngineSeries("kvwatch_engine_external_prefix_cache_hits", "counter", "external_prefix_hits", "tokens",
                 "External (KV connector) prefix-cache hits in tokens (vllm:external_prefix_cache_hits_total)."),
    EngineSeries("kvwatch_engine_preemptions", "counter", "preemptions", "preemptions",
                 "Preemptions by the scheduler (vllm:num_preemptions_total)."),
    EngineSeries("kvwatch_engine_prompt_tokens", "counter", "prompt_tokens", "tokens",
                 "Prompt tokens processed, cached ones included (vllm:prompt_tokens_total)."),
    EngineSeries("kvwatch_engine_prompt_tokens_cached", "counter", "prompt_tokens_cached", "tokens",
                 "Prompt tokens served from a cache, local or external (vllm:prompt_tokens_cached_total, vLLM 0.16+)."),
    EngineSeries("kvwatch_engine_generation_tokens", "counter", "generation_tokens", "tokens",
                 "Generated tokens (vllm:generation_tokens_total)."),
    EngineSeries("kvwatch_engine_requests_finished", "counter", "finished/*", "requests",
                 "Finished requests by reason: stop, length, abort, error, repetition (vllm:request_success_total).",
                 label="finished_reason"),
    EngineSeries("kvwatch_engine_time_to_first_token_seconds", "histogram", "ttft", "seconds",
                 "Time to first token, from front-end arrival, so queue and prefill included (vllm:time_to_first_token_seconds)."),
    EngineSeries("kvwatch_engine_request_queue_time_seconds", "histogram", "queue_time", "seconds",
                 "Time in the WAITING phase, observed when a request finishes (vllm:request_queue_time_seconds, V0 vllm:time_in_queue_requests)."),
    EngineSeries("kvwatch_engine_request_prefill_time_seconds", "histogram", "prefill_time", "seconds",
                 "Time in the PREFILL phase, observed when a request finishes (vllm:request_prefill_time_seconds)."),
    EngineSeries("kvwatch_engine_e2e_request_latency_seconds", "histogram", "e2e_latency", "seconds",
                 "End-to-end request latency (vllm:e2e_request_latency_seconds)."),
    EngineSeries("kvwatch_engine_inter_token_latency_seconds", "histogram", "inter_token_latency", "seconds",
                 "Gap between output events (vllm:inter_token_latency_seconds, formerly vllm:time_per_output_token_seconds)."),
    EngineSeries("kvwatch_engine_request_prompt_tokens", "histogram", "prompt_len", "tokens",
                 "Prompt length per finished request (vllm:request_prompt_tokens)."),
    EngineSeries("kvwatch_engine_request_generation_tokens", "histogram", "generation_len", "tokens",
                 "Generated length per finished request (vllm:request_generation_tokens)."),
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
    notes: list[str] = field(default_factory=list)

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


def _clamp01(value: float | None) -> float | None:
    # vllm-ascend reported negative usage on hybrid models; usage is 0..1.
    return None if value is None else min(1.0, max(0.0, value))


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


def _quantiles(key: str, label: str) -> Callable[[View], dict[str, float] | None]:
    def derive(view: View) -> dict[str, float] | None:
        histogram = view.increase.histograms.get(key)
        if histogram is None or histogram.count <= 0:
            return None
        values = {}
        for q in QUANTILES:
            quantile = histogram.quantile(q)
            if quantile is None:
                continue
            values[str(q)] = quantile.value
            if quantile.pinned == "first":
                view.notes.append(f"{label} p{q * 100:g} is at most {histogram.bounds[0]:g}: pinned in the first bucket")
            elif quantile.pinned == "last":
                view.notes.append(f"{label} p{q * 100:g} is at least {quantile.value:g}: pinned at the last finite bucket")
        return values or None

    return derive


def _mean(key: str) -> Callable[[View], float | None]:
    def derive(view: View) -> float | None:
        histogram = view.increase.histograms.get(key)
        return histogram.mean() if histogram is not None else None

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
    ttft = _mean("ttft")(view)
    if not ttft:
        return None
    queue = _mean("queue_time")(view)
    prefill = _mean("prefill_time")(view)
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
    def derive(view: View) -> dict[str, float] | None:
        if view.increase.seconds <= 0:
            return None
        found = {
            key.split("/", 1)[1]: value / view.increase.seconds
            for key, value in view.increase.counters.items()
            if key.startswith(prefix + "/")
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
           record=("kvwatch_kv_cache_usage_ratio", "max")),
    Signal("kvwatch_kv_cache_usage_max_ratio", "ratio",
           "Highest KV-cache usage seen in the window (vllm:kv_cache_usage_perc).",
           lambda v: _clamp01(v.usage_max), "exhaustion",
           "max by ({by}) (max_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[{w}]))",
           record=("kvwatch_kv_cache_usage_ratio", "max_over_time{w}")),
    Signal("kvwatch_kv_cache_capacity_tokens", "tokens",
           "KV-cache capacity in tokens (vllm:cache_config_info).",
           lambda v: v.capacity_tokens, "exhaustion",
           "sum by ({by}) (kvwatch_engine_kv_cache_capacity_tokens{{{sel}}})",
           record=("kvwatch_kv_cache_capacity_tokens", "sum")),
    Signal("kvwatch_kv_cache_free_tokens", "tokens",
           "KV-cache headroom in tokens: capacity x (1 - usage), rounded down to a whole token "
           "(vllm:cache_config_info, vllm:kv_cache_usage_perc).",
           _free_tokens, "exhaustion",
           "sum by ({by}) (floor(kvwatch_engine_kv_cache_capacity_tokens{{{sel}}} * (1 - kvwatch_engine_kv_cache_usage_ratio{{{sel}}})))",
           record=("kvwatch_kv_cache_free_tokens", "sum")),
    Signal("kvwatch_kv_cache_used_bytes", "bytes",
           "KV-cache bytes held now: usage x the cache's bytes, rounded to a whole byte "
           "(vllm:kv_cache_usage_perc, vllm:cache_config_info kv_cache_memory_bytes; absent before vLLM 0.24).",
           _used_bytes, "exhaustion",
           "sum by ({by}) (clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * kvwatch_engine_kv_cache_memory_bytes{{{sel}}})",
           panel="overview", title="KV bytes in use",
           record=("kvwatch_kv_cache_used_bytes", "sum")),
    Signal("kvwatch_kv_cache_capacity_requests", "requests",
           "Concurrent requests the KV capacity holds at the window's mean prompt+generation length, block-rounded and rounded down to a whole request; a bound, not a promise "
           "(vllm:cache_config_info, vllm:request_prompt_tokens, vllm:request_generation_tokens).",
           _capacity_requests, "exhaustion",
           "floor(\nsum by ({by}) (kvwatch_engine_kv_cache_capacity_tokens{{{sel}}})\n/ on ({by}) (\n"
           + _mean_promql("kvwatch_engine_request_prompt_tokens") + "\n+ on ({by})\n"
           + _mean_promql("kvwatch_engine_request_generation_tokens") + "\n)\n)",
           record=("kvwatch_kv_cache_capacity_requests", "ratio_rate{w}")),
    Signal("kvwatch_preemptions_per_second", "per_second",
           "Preemptions per second over the window (vllm:num_preemptions_total).",
           _rate("preemptions"), "exhaustion",
           "sum by ({by}) (rate(kvwatch_engine_preemptions_total{{{sel}}}[{w}]))",
           record=("kvwatch_preemptions", "rate{w}")),
    Signal("kvwatch_requests_running", "requests",
           "Requests running now (vllm:num_requests_running).",
           lambda v: v.gauge("running"), "exhaustion",
           "sum by ({by}) (kvwatch_engine_requests_running{{{sel}}})",
           record=("kvwatch_requests_running", "sum")),
    Signal("kvwatch_requests_running_max", "requests",
           "Most requests running at once in the window: the concurrency actually reached (vllm:num_requests_running).",
           lambda v: v.running_max, "exhaustion",
           "sum by ({by}) (max_over_time(kvwatch_engine_requests_running{{{sel}}}[{w}]))",
           record=("kvwatch_requests_running", "max_over_time{w}")),
    Signal("kvwatch_requests_waiting", "requests",
           "Requests waiting now (vllm:num_requests_waiting).",
           lambda v: v.gauge("waiting"), "exhaustion",
           "sum by ({by}) (kvwatch_engine_requests_waiting{{{sel}}})",
           record=("kvwatch_requests_waiting", "sum")),
    Signal("kvwatch_requests_waiting_by_reason", "requests",
           "Requests waiting now by reason: capacity (no KV blocks) or deferred (vllm:num_requests_waiting_by_reason, vLLM 0.20+).",
           _waiting_by_reason, "exhaustion",
           "sum by ({by}, reason) (kvwatch_engine_requests_waiting_by_reason{{{sel}}})", label="reason",
           record=("kvwatch_requests_waiting", "sum")),
    # --- prefix cache ---
    Signal("kvwatch_prefix_cache_hit_ratio", "ratio",
           "Prefix-cache hits over queries in the window, from token counters, not lifetime totals "
           "(vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total, formerly gpu_prefix_cache_*; V0: vllm:gpu_prefix_cache_hit_rate).",
           _prefix_hit_ratio, "prefix",
           _ratio_of_rates("kvwatch_engine_prefix_cache_hits_total", "kvwatch_engine_prefix_cache_queries_total"),
           record=("kvwatch_prefix_cache_hit", "ratio_rate{w}")),
    Signal("kvwatch_external_prefix_cache_hit_ratio", "ratio",
           "External (KV connector) prefix-cache hits over queries in the window (vllm:external_prefix_cache_{hits,queries}_total).",
           lambda v: v.increase.ratio("external_prefix_hits", "external_prefix_queries"), "prefix",
           _ratio_of_rates("kvwatch_engine_external_prefix_cache_hits_total", "kvwatch_engine_external_prefix_cache_queries_total"),
           record=("kvwatch_external_prefix_cache_hit", "ratio_rate{w}")),
    Signal("kvwatch_prompt_tokens_cached_ratio", "ratio",
           "Share of prompt tokens served from a cache in the window (vllm:prompt_tokens_cached_total / vllm:prompt_tokens_total; "
           "before 0.16 prefix hits / prompt tokens).",
           _cached_share, "prefix",
           _ratio_of_rates("kvwatch_engine_prompt_tokens_cached_total", "kvwatch_engine_prompt_tokens_total"),
           record=("kvwatch_prompt_tokens_cached", "ratio_rate{w}")),
    # --- first token ---
    Signal("kvwatch_time_to_first_token_seconds", "seconds",
           "Time to first token quantiles over the window, from bucket increases with the scraped bounds (vllm:time_to_first_token_seconds).",
           _quantiles("ttft", "TTFT"), "first_token",
           _quantile_promql("kvwatch_engine_time_to_first_token_seconds"), label="quantile",
           record=("kvwatch_time_to_first_token_seconds", "histogram_quantile_rate{w}")),
    Signal("kvwatch_time_to_first_token_mean_seconds", "seconds",
           "Mean time to first token over the window (vllm:time_to_first_token_seconds _sum/_count).",
           _mean("ttft"), "first_token", _mean_promql("kvwatch_engine_time_to_first_token_seconds"),
           record=("kvwatch_time_to_first_token_seconds", "mean_rate{w}")),
    Signal("kvwatch_queue_time_seconds", "seconds",
           "Queue (WAITING) time quantiles over the window (vllm:request_queue_time_seconds).",
           _quantiles("queue_time", "queue time"), "first_token",
           _quantile_promql("kvwatch_engine_request_queue_time_seconds"), label="quantile",
           record=("kvwatch_queue_time_seconds", "histogram_quantile_rate{w}")),
    Signal("kvwatch_queue_time_mean_seconds", "seconds",
           "Mean queue time over the window (vllm:request_queue_time_seconds _sum/_count).",
           _mean("queue_time"), "first_token", _mean_promql("kvwatch_engine_request_queue_time_seconds"),
           record=("kvwatch_queue_time_seconds", "mean_rate{w}")),
    Signal("kvwatch_prefill_time_seconds", "seconds",
           "Prefill time quantiles over the window (vllm:request_prefill_time_seconds).",
           _quantiles("prefill_time", "prefill time"), "first_token",
           _quantile_promql("kvwatch_engine_request_prefill_time_seconds"), label="quantile",
           record=("kvwatch_prefill_time_seconds", "histogram_quantile_rate{w}")),
    Signal("kvwatch_prefill_time_mean_seconds", "seconds",
           "Mean prefill time over the window (vllm:request_prefill_time_seconds _sum/_count).",
           _mean("prefill_time"), "first_token", _mean_promql("kvwatch_engine_request_prefill_time_seconds"),
           record=("kvwatch_prefill_time_seconds", "mean_rate{w}")),
    Signal("kvwatch_time_to_first_token_share_ratio", "ratio",
           "Share of mean TTFT spent in queue, in prefill, and elsewhere (front end, tokenization, scheduling); the PromQL twin is the queue part "
           "(vllm:time_to_first_token_seconds, vllm:request_queue_time_seconds, vllm:request_prefill_time_seconds).",
           ttft_parts, "first_token",
           _mean_promql("kvwatch_engine_request_queue_time_seconds") + "\n/ on ({by})\n"
           + _mean_promql("kvwatch_engine_time_to_first_token_seconds"), label="part",
           record=("kvwatch_time_to_first_token_share", "ratio_rate{w}")),
    # --- throughput and failures ---
    Signal("kvwatch_requests_finished_per_second", "per_second",
           "Finished requests per second by reason (vllm:request_success_total).",
           _labelled_rates("finished"), "throughput",
           "sum by ({by}, finished_reason) (rate(kvwatch_engine_requests_finished_total{{{sel}}}[{w}]))",
           label="finished_reason",
           record=("kvwatch_requests_finished", "rate{w}")),
    Signal("kvwatch_requests_failed_per_second", "per_second",
           "Requests ending in abort or error per second (vllm:request_success_total{finished_reason=~\"abort|error\"}).",
           _failed_rate, "throughput",
           "sum by ({by}) (rate(kvwatch_engine_requests_finished_total{{{sel},finished_reason=~\"abort|error\"}}[{w}]))",
           record=("kvwatch_requests_failed", "rate{w}")),
    Signal("kvwatch_prompt_tokens_per_second", "per_second",
           "Prompt tokens per second, cached included (vllm:prompt_tokens_total).",
           _rate("prompt_tokens"), "throughput",
           "sum by ({by}) (rate(kvwatch_engine_prompt_tokens_total{{{sel}}}[{w}]))",
           record=("kvwatch_prompt_tokens", "rate{w}")),
    Signal("kvwatch_generation_tokens_per_second", "per_second",
           "Generated tokens per second (vllm:generation_tokens_total).",
           _rate("generation_tokens"), "throughput",
           "sum by ({by}) (rate(kvwatch_engine_generation_tokens_total{{{sel}}}[{w}]))",
           record=("kvwatch_generation_tokens", "rate{w}")),
    Signal("kvwatch_prompt_tokens_per_request_mean", "tokens",
           "Mean prompt tokens per finished request in the window (vllm:request_prompt_tokens).",
           lambda v: mean_tokens(v, "prompt_len", "prompt_tokens"), "throughput",
           _mean_promql("kvwatch_engine_request_prompt_tokens"),
           record=("kvwatch_prompt_tokens_per_request", "mean_rate{w}")),
    Signal("kvwatch_generation_tokens_per_request_mean", "tokens",
           "Mean generated tokens per finished request in the window (vllm:request_generation_tokens).",
           lambda v: mean_tokens(v, "generation_len", "generation_tokens"), "throughput",
           _mean_promql("kvwatch_engine_request_generation_tokens"),
           record=("kvwatch_generation_tokens_per_request", "mean_rate{w}")),
)

SIGNALS_BY_NAME = {signal.name: signal for signal in SIGNALS}


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


def _view(window: Window, keys: list[tuple[str, str]]) -> View | None:
    latest = window.latest
    if latest is None:
        return None
    present = [key for key in keys if key in latest.engines]
    if not present:
        return None
    merged = EngineSnapshot(present[0][0], present[0][1] if len(present) == 1 else "*")
    increase = Increase()
    span = 0.0
    capacity = None
    block_size = None
    usage_max = None
    running_max = None
    used_bytes: float | None = 0.0
    for key in present:
        engine = latest.engines[key]
        engine_bytes = config_number(latest.cache_config.get(key[1], {}), "kv_cache_memory_bytes")
        engine_usage = engine.gauges.get("kv_usage")
        if used_bytes is not None and engine_bytes is not None and engine_usage is not None:
            used_bytes += min(1.0, max(0.0, engine_usage)) * engine_bytes
        else:
            used_bytes = None
        for gauge, value in engine.gauges.items():
            if gauge == "kv_usage" or gauge == "v0_prefix_hit_rate":
                previous = merged.gauges.get(gauge)
                merged.gauges[gauge] = value if previous is None else max(previous, value)
            else:
                merged.gauges[gauge] = merged.gauges.get(gauge, 0.0) + value
        engine_increase = window.increase(key)
        increase.add(engine_increase)
        span = max(span, engine_increase.seconds)
        engine_capacity = latest.capacity_tokens(key[1])
        if engine_capacity is not None:
            capacity = (capacity or 0.0) + engine_capacity
        block_size = block_size or config_number(latest.cache_config.get(key[1], {}), "block_size")
        # The window keeps these maxima as snapshots come and go.
        usage_peak = window.gauge_max(key, "kv_usage")
        if usage_peak is not None:
            usage_max = usage_peak if usage_max is None else max(usage_max, usage_peak)
        running_peak = window.gauge_max(key, "running")
        if running_peak is not None:
            running_max = (running_max or 0.0) + running_peak
    # Engines of one model run side by side over the same span.
    increase.seconds = span
    return View(merged, increase, usage_max, running_max, capacity, block_size, used_bytes)


def evaluate(view: View, model: str, engine: str | None) -> Evaluated:
    values = {}
    for signal in SIGNALS:
        try:
            values[signal.name] = signal.derive(view)
        except (ArithmeticError, ValueError) as exc:  # one bad signal must not hide the rest
            values[signal.name] = None
            view.notes.append(f"{signal.name}: {exc}")
    return Evaluated(model, engine, values, view.notes, view)


def evaluate_window(window: Window) -> tuple[list[Evaluated], list[Evaluated]]:
    """Per (model, engine), and per model with its engines merged."""
    latest = window.latest
    if latest is None:
        return [], []
    per_engine = []
    by_model: dict[str, list[tuple[str, str]]] = {}
    for key in sorted(latest.engines):
        view = _view(window, [key])
        if view is not None:
            per_engine.append(evaluate(view, key[0], key[1]))
        by_model.setdefault(key[0], []).append(key)
    per_model = []
    for model, keys in sorted(by_model.items()):
        view = _view(window, keys)
        if view is not None:
            per_model.append(evaluate(view, model, None))
    return per_engine, per_model


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
    "ENGINE_SERIES", "SIGNALS", "SIGNALS_BY_NAME", "QUANTILES", "EngineSeries", "Signal", "View",
    "Evaluated", "evaluate_window", "engine_series_value", "Histogram",
]
